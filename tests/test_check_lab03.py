"""Lab 03's decision exercise (which merges of two partial results are exact): the evidence, the check and the
diagnosis of every wrong choice (kvlib.course.mistakes.exact_merges, kvlib.course.ch03.check_merge_choice)."""

import itertools

import pytest
import torch

from kvlib.course import ch03, mistakes
from kvlib.course.check import CheckFailed

LETTERS = "ABCDE"


def test_the_evidence_is_what_each_formula_does():
    ev = ch03.merge_evidence()
    assert list(ev.index) == list(LETTERS) and ev.shape == (5, 3)
    ordinary, lifted, huge = ev.columns
    assert ev[ordinary].tolist() == ["wrong", "exact", "wrong", "exact", "exact"]  # B and D right on paper
    assert ev[lifted].tolist() == ["wrong", "overflows", "wrong", "overflows", "exact"]  # exp(>88) in fp32
    assert ev[huge].tolist() == ["wrong", "overflows", "wrong", "exact", "exact"]  # exp(1000) in fp64; D's difference is small
    assert ch03.merge_evidence().equals(ev)  # the same words every time (seeded inputs)


def test_the_candidates_are_the_formulas_shown():
    g = torch.Generator().manual_seed(1)
    o1, o2 = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    l1, l2 = torch.randn(3, generator=g), torch.randn(3, generator=g)
    w1, w2 = l1.exp()[:, None], l2.exp()[:, None]
    exact = (w1 * o1 + w2 * o2) / (w1 + w2)
    for name in "BDE":
        torch.testing.assert_close(ch03.MERGES[name][1](o1, l1, o2, l2, 5, 7), exact)
    torch.testing.assert_close(ch03.MERGES["A"][1](o1, l1, o2, l2, 5, 7), (o1 + o2) / 2)
    torch.testing.assert_close(ch03.MERGES["C"][1](o1, l1, o2, l2, 5, 7), (5 * o1 + 7 * o2) / 12)


def test_the_right_choice_passes(capsys):
    assert ch03.check_merge_choice({"E"}) is True
    assert ch03.check_merge_choice("e") is True  # a string of letters, any case
    out = capsys.readouterr().out
    assert "yours ['E']  reference ['E']  ✓" in out and "PASS ✓" in out and "overflows" in out


def choices():
    subsets = itertools.chain.from_iterable(itertools.combinations(LETTERS, r) for r in range(0, 6))
    return [set(s) for s in subsets if set(s) != {"E"}]


@pytest.mark.parametrize("yours", choices(), ids=lambda s: "".join(sorted(s)) or "none")
def test_every_wrong_choice_names_each_wrong_letter(yours):
    why = mistakes.exact_merges()
    with pytest.raises(CheckFailed) as err:
        ch03.check_merge_choice(yours)
    report = str(err.value)
    assert "FAIL ✗" in report
    for letter in yours ^ {"E"}:
        assert why[letter] in report
    for letter in set(LETTERS) - (yours ^ {"E"}):
        assert why[letter] not in report  # only the letters you got wrong


@pytest.mark.parametrize("letter, words", [("B", "exp(lse) overflows"), ("D", "exp(lse2 - lse1) overflows"),
                                           ("A", "averages"), ("C", "weighs by positions"), ("E", "nothing overflows")])
def test_the_reasons_say_what_the_evidence_shows(letter, words):
    assert words in mistakes.exact_merges()[letter]


def test_an_unknown_letter_is_named():
    with pytest.raises(CheckFailed, match="F: not one of the candidates"):
        ch03.check_merge_choice({"E", "F"})


def test_the_diagnoses_are_one_short_line_each():
    assert all(len(reason.split()) <= 25 for reason in mistakes.exact_merges().values())


# ---------------------------------------------------------------- exercise 6: where the new token sits ------


@pytest.fixture(scope="module")
def tiny_run():
    from kvlib.generate import generate_naive
    from kvlib.model import load_tiny

    model, tok = load_tiny(device="cpu")
    prompt_ids, n = tok.encode("Return a new list containing"), 12
    return model, prompt_ids, n, generate_naive(model, [prompt_ids], n)[0]


@pytest.mark.parametrize("position, words", [
    (lambda cache, T: None, "position 0"),
    (lambda cache, T: torch.zeros(1, 1, dtype=torch.long), "position 0"),
    (lambda cache, T: torch.full((1, 1), T, dtype=torch.long), "len(prompt_ids)"),
])
def test_each_usual_wrong_position_is_named(tiny_run, position, words):
    from kvlib.cache import KVCache
    from kvlib.course.check import check_tokens

    model, prompt_ids, n, reference = tiny_run
    with torch.no_grad():  # the learner's loop, with the position under test
        cache = KVCache.for_model(model, 1, len(prompt_ids) + n)
        logits = model(torch.tensor([prompt_ids]), cache=cache)[:, -1]
        mine = []
        for _ in range(n):
            nxt = logits.argmax(dim=-1)
            mine.append(int(nxt))
            logits = model(nxt[:, None], positions=position(cache, len(prompt_ids)), cache=cache)[:, -1]
    with pytest.raises(CheckFailed) as err:
        check_tokens(mine, reference, mistakes=mistakes.cached_greedy(model, prompt_ids, n, reference))
    found = [line for line in str(err.value).splitlines() if line.startswith("Diagnosis:")]
    assert len(found) == 1 and words in found[0]
