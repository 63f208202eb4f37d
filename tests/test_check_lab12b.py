"""Lab 12b's checkers: the right answers pass, and each usual wrong answer is named as itself and only itself."""

import pytest
import torch

from kvlib.course import ch12b
from kvlib.course.check import CheckFailed, check
from kvlib.course.mistakes import lab12b
from kvlib.dist import router
from kvlib.model import load_tiny

from _checks import diagnoses_in  # tests/_checks.py


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()[0]


def failure(call) -> str:
    with pytest.raises(CheckFailed) as err:
        call()
    return str(err.value)


def test_remap_mistakes_are_named(tiny):
    k, v, sent, pk, pv, free = ch12b.remap_lab_case(tiny)
    ref = lab12b.remap_reference(k, v, sent, pk, pv, free)
    assert set(sent) & (set(range(pk.shape[1])) - set(free))  # the sender's ids hit busy receiver blocks
    wrongs = lab12b.remap(k, v, sent, pk, pv, free)
    values = [f() for f in wrongs.values()]
    assert all(not torch.equal(w, ref) for w in values)
    assert all(not torch.equal(a, b) for i, a in enumerate(values) for b in values[i + 1:])
    for what, f in wrongs.items():
        found = diagnoses_in(failure(lambda: check(f(), ref, name="pools", atol=0, rtol=0, mistakes=wrongs)))
        assert found == [what], (what, found)


def test_score_mistakes_are_named(tiny):
    cases = ch12b.score_cases(tiny)
    ref = torch.tensor([router.prefix_score(h, s) for h, s in cases])
    wrongs = lab12b.score(cases)
    values = [f() for f in wrongs.values()]
    assert all(not torch.equal(a, b) for i, a in enumerate(values) for b in values[i + 1:])
    for what, f in wrongs.items():
        found = diagnoses_in(failure(lambda: check(f(), ref, name="scores", mistakes=wrongs)))
        assert found == [what], (what, found)


FAKE = dict(decode_step=0.004, mixed_step=0.03, prefill_step=0.025, chunks=4, transfer=0.01)


@pytest.mark.parametrize("costs", [FAKE, dict(FAKE, transfer=0.02), dict(FAKE, mixed_step=0.2, prefill_step=0.01)])
def test_decision_rule_and_its_mistakes(costs, capsys):
    cases = ch12b.decision_cases(costs)
    assert lab12b.choice_answers(cases) == ("colocate", "disaggregate", "neither", "neither")
    assert ch12b.check_choice_12b(ch12b.choose, cases) is True
    assert "PASS" in capsys.readouterr().out
    rules = lab12b.choice_rules(cases)
    assert len(set(rules.values())) == len(rules) and lab12b.choice_answers(cases) not in rules.values()
    for what, answers in rules.items():
        pick = dict(zip(cases, answers))
        report = failure(lambda: ch12b.check_choice_12b(lambda c: pick[next(k for k in cases if cases[k] is c)], cases))
        assert [line for line in report.splitlines() if "known mistake" in line] == \
               [f"  Diagnosis: yours matches a known mistake: {what}"]


def test_a_malformed_choice_says_what_is_expected():
    cases = ch12b.decision_cases(FAKE)
    with pytest.raises(ValueError, match="must be one of"):
        ch12b.check_choice_12b(lambda c: "both", cases)


def test_a_receipt_slower_than_a_chunk_step_is_refused():
    with pytest.raises(ValueError, match="receipt"):
        ch12b.decision_cases(dict(FAKE, transfer=0.05))
