"""Lab 11a's checks (kvlib.course.mistakes.lab11a, kvlib.course.ch11a.check_k_choice): the solution passes, every known
wrong answer is named as itself and only itself, and each wrong decision is diagnosed."""

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

import kvlib  # noqa: F401  (sets the mode before Triton is imported)
from kvlib.course import ch11a
from kvlib.course.check import CheckFailed, check_lines
from kvlib.course.mistakes import lab11a
from kvlib.speculate import speculative_accept

from _checks import diagnoses


def diagnosed(call, words: str) -> str:
    """The one diagnosis of a failing check; it must contain ``words``."""
    found = diagnoses(call)
    assert len(found) == 1 and words in found[0], found
    return found[0]

REPO = Path(__file__).resolve().parents[1]
SKIP = ("check_lines(", "tol = 2 * ", "ok = ch11a.check_k_choice", "hint = Hints(", "prompt = tok.encode(", "def yours_in_the_loop")


@pytest.fixture(scope="module")
def lab():
    """The solution notebook's definitions and cases (its checks and long runs left out): its namespace."""
    nb = json.loads((REPO / "solutions" / "11a_speculative_decoding_lab.ipynb").read_text(encoding="utf-8"))
    namespace = {"display": lambda *a, **k: None}
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] != "code" or src.lstrip().startswith(SKIP) or "for x in drafts:" in src:
            continue
        if "for name, (p, q, draft) in ACCEPT_CASES.items():" in src:
            src = src[:src.index("for name, (p, q, draft)")]
        exec(compile(src, "lab11a", "exec"), namespace)
    return namespace


def test_every_variant_is_named_as_itself_and_only_itself(lab):
    pool, scenarios = lab["small_pool"], lab["SCENARIOS"]
    cases, seeds = lab["ACCEPT_CASES"], lab["SEEDS"]
    sets = [(lab11a.truncate_transcript(pool, scenarios), lab11a.truncate_seq(pool, scenarios)),
            (lab11a.accept_transcript(speculative_accept, cases, seeds), lab11a.speculative_accept(cases, seeds))]
    problems = []
    for reference, variants in sets:
        for what, wrong in variants.items():
            value = wrong()
            found = diagnoses(lambda: check_lines(value, reference, mistakes=variants))
            if found != [what]:
                problems.append((what, found))
    assert not problems, problems


def test_the_solution_passes(lab):
    pool, scenarios = lab["small_pool"], lab["SCENARIOS"]
    assert check_lines(lab11a.truncate_transcript(lambda: pool(lab["truncate_seq"]), scenarios),
                       lab11a.truncate_transcript(pool, scenarios))
    cases, seeds = lab["ACCEPT_CASES"], lab["SEEDS"]
    assert check_lines(lab11a.accept_transcript(lab["speculative_accept"], cases, seeds),
                       lab11a.accept_transcript(speculative_accept, cases, seeds))
    assert ch11a.check_k_choice(lab["choose_k"](), lab["evidence"]) is True


def _evidence():
    """Two tasks, k = 1, 2, 4: one where k = 1 pays, one where nothing reaches the 5% margin."""
    rows = [("phrase", 1, 64, 55.3, 0.28, 1.24), ("phrase", 2, 64, 57.2, 0.17, 1.29), ("phrase", 4, 64, 60.5, 0.12, 1.37),
            ("doc", 1, 64, 61.5, 0.13, 1.12), ("doc", 2, 64, 66.7, 0.07, 1.12), ("doc", 4, 64, 76.5, 0.03, 1.12)]
    return pd.DataFrame(rows, columns=["task", "k", "new tokens", "cost of the steps (forwards over 1)",
                                       "share of drafts accepted", "tokens per forward"])


def test_the_reference_follows_the_costs():
    ev = _evidence()
    assert ch11a.k_reference(ev, "phrase") == 1 and ch11a.k_reference(ev, "doc") == 0
    ev.loc[ev.k == 4, "cost of the steps (forwards over 1)"] = 40.0  # were k = 4's steps cheap, it would win
    assert ch11a.k_reference(ev, "phrase") == 4 and ch11a.k_reference(ev, "doc") == 4


@pytest.mark.parametrize("choice, says", [
    ({"phrase": 4, "doc": 0}, "yields the most tokens per forward"),
    ({"phrase": 1, "doc": 1}, "no k reaches 1.05x"),
    ({"phrase": 0, "doc": 0}, "but k = 1 is predicted at"),
    ({"phrase": 2, "doc": 0}, "k = 1 at"),
    ({"phrase": "one", "doc": 0}, "is not one of 0, 1, 2, 4"),
])
def test_every_wrong_decision_is_diagnosed(choice, says):
    with pytest.raises(CheckFailed) as err:
        ch11a.check_k_choice(choice, _evidence())
    assert "FAIL ✗" in str(err.value) and says in str(err.value), str(err.value)


def test_the_right_decision_passes(capsys):
    assert ch11a.check_k_choice({"phrase": 1, "doc": 0}, _evidence()) is True
    assert "PASS ✓" in capsys.readouterr().out


# The learner-style answers of lab 11 (tests/test_check.py), moved with the two exercises.
def _learner_truncate(mistake=""):
    """truncate_seq as a learner might write it (another way than the solution's), with one mistake switched on."""
    def truncate_seq(cache, seq_id, length):
        bs, table, pool = cache.block_size, cache.tables[seq_id], cache.allocator
        n_keep = {"floor": length // bs, "plus one": length // bs + 1}.get(mistake, math.ceil(length / bs))
        released = table[n_keep:] if mistake == "first to last" else table[n_keep:][::-1]
        for b in released:
            if mistake == "free shared":  # "free" it until it really is free
                while pool.refcount[b]:
                    pool.free(b)
                back = True
            else:
                back = pool.free(b)
            if (back and mistake != "freed keeps its hash") or mistake == "unregister every released block":
                if b in cache.block_hash:
                    del cache.block_hash[b]
        if mistake != "table not cut":
            cache.tables[seq_id] = table[:n_keep]  # a new list instead of del table[keep:]: also right
        kept = cache.tables[seq_id]
        partial = length % bs != 0
        if mistake != "last keeps its hash" and partial and kept:
            if pool.refcount[kept[-1]] == 1 or mistake == "last unregistered though shared":
                cache.block_hash.pop(kept[-1], None)
        if mistake != "length":
            cache.lens[seq_id] = length

    return truncate_seq


@pytest.mark.parametrize("mistake, words", [
    ("floor", "one block too few"),
    ("plus one", "one block too many"),
    ("free shared", "a block another sequence still holds went back to the pool"),
    ("freed keeps its hash", "a freed block kept its hash"),
    ("unregister every released block", "lost its hash while another sequence still holds it"),
    ("last keeps its hash", "no longer full, kept its hash"),
    ("last unregistered though shared", "the last kept block lost its hash while another sequence holds it too"),
    ("length", "the length was not shortened"),
    ("first to last", "released first to last"),
    ("table not cut", "stayed in the block table"),
])
def test_truncate_mistakes(lab, mistake, words):
    pool, scenarios = lab["small_pool"], lab["SCENARIOS"]
    ref = lab11a.truncate_transcript(pool, scenarios)
    assert check_lines(lab11a.truncate_transcript(lambda: pool(lab["truncate_seq"]), scenarios), ref)
    assert check_lines(lab11a.truncate_transcript(lambda: pool(_learner_truncate()), scenarios), ref)
    mine = lab11a.truncate_transcript(lambda: pool(_learner_truncate(mistake)), scenarios)
    diagnosed(lambda: check_lines(mine, ref, mistakes=lab11a.truncate_seq(pool, scenarios)), words)


def _learner_accept(mistake=""):
    """speculative_accept as a learner might write it, with one mistake switched on."""
    def accept(p, q, draft, generator=None):
        us = torch.rand(len(draft), generator=generator).tolist() if mistake == "up front" else None
        for i, x in enumerate(draft):
            if mistake == "deterministic":
                ok = bool(p[i, x] >= q[i, x])
            else:
                u = us[i] if us else torch.rand((), generator=generator).item()
                ratio = {"p": p[i, x], "inverted": q[i, x] / p[i, x]}.get(mistake, p[i, x] / q[i, x])
                ok = u < min(1.0, float(ratio))
            if not ok:
                if mistake == "resample p":
                    w = p[i]
                elif mistake == "swapped":
                    w = torch.clamp(q[i] - p[i], min=0)
                elif mistake == "no clamp":
                    w = p[i] - q[i]
                else:
                    w = torch.clamp(p[i] - q[i], min=0)
                    w = w / w.sum()  # normalised first: the same draw
                return (i + 1 if mistake == "i + 1" else i), torch.multinomial(w, 1, generator=generator).item()
        last = p[len(draft) - 1] if mistake == "bonus" and draft else p[len(draft)]
        return len(draft), torch.multinomial(last, 1, generator=generator).item()

    return accept


@pytest.mark.parametrize("mistake, words", [
    ("deterministic", "whenever p(x) >= q(x)"),
    ("p", "with probability p(x)"),
    ("inverted", "upside down"),
    ("resample p", "drawn from p: draw it from the residual"),
    ("swapped", "max(0, q - p)"),
    ("no clamp", "not clamped at 0"),
    ("bonus", "p[d - 1]"),
    ("i + 1", "i + 1 drafts were counted"),
    ("up front", "drawn all at once"),
])
def test_accept_mistakes(lab, mistake, words):
    from kvlib.speculate import speculative_accept

    cases, seeds = lab["ACCEPT_CASES"], lab["SEEDS"]
    ref = lab11a.accept_transcript(speculative_accept, cases, seeds)
    assert check_lines(lab11a.accept_transcript(lab["speculative_accept"], cases, seeds), ref)
    assert check_lines(lab11a.accept_transcript(_learner_accept(), cases, seeds), ref)
    assert check_lines(lab11a.accept_transcript(lab11a._accept, cases, seeds), ref)
    mine = lab11a.accept_transcript(_learner_accept(mistake), cases, seeds)
    diagnosed(lambda: check_lines(mine, ref, mistakes=lab11a.speculative_accept(cases, seeds)), words)


def test_the_distribution_test_fails_the_wrong_rules():
    """The lab's distribution test (10,000 one-draft rounds, the tolerance from the draw count) passes the right
    rule and fails the two plausible wrong ones, sampled as the learner's would be."""
    p0 = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.10])
    q0 = torch.tensor([0.05, 0.10, 0.15, 0.30, 0.40])
    p, q, n = torch.stack([p0, torch.full((5,), 0.2)]), q0[None], 10_000
    tol = 2 * (p0 * (1 - p0) / n).sqrt().sum().item()
    drafts = torch.multinomial(q0, n, replacement=True, generator=torch.Generator().manual_seed(1)).tolist()

    def distance(**mistake):
        gen, counts = torch.Generator().manual_seed(2), torch.zeros(5)
        for x in drafts:
            a, nxt = lab11a._accept(p, q, [x], gen, **mistake)
            counts[x if a == 1 else nxt] += 1
        return 0.5 * (counts / n - p0).abs().sum().item()

    assert distance() < tol
    assert distance(resample="p") > 3 * tol and distance(rule="deterministic") > 3 * tol
