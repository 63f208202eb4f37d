"""Lab 02's decision exercise (how each count grows with n): the reference counted on the real loops, and
every known wrong decision named by the checker (kvlib.course.mistakes.lab02.growth)."""

from __future__ import annotations

import math

import pytest
import torch

import kvlib  # noqa: F401  (sets the mode before Triton is imported)
from kvlib.course import ch02, mistakes
from kvlib.course.check import CheckFailed, check
from kvlib.model import ModelConfig, Transformer

RIGHT = {"A": 1, "B": 2, "C": 2, "D": 3, "E": 0, "F": 1}
KEYS = "ABCDEF"


def _tensor(answer: dict) -> torch.Tensor:
    return torch.tensor([answer[k] for k in KEYS])


def _diagnoses(answer: dict) -> list[str]:
    prefix = "Diagnosis: yours matches a known mistake: "
    with pytest.raises(CheckFailed) as err:
        check(_tensor(answer), _tensor(RIGHT), name="growth", mistakes=mistakes.growth(RIGHT))
    return [line[len(prefix):] for line in str(err.value).splitlines() if line.startswith(prefix)]


@pytest.fixture(scope="module")
def model():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=2, hidden_dim=64)).eval()


def test_the_reference_counted_on_the_real_loops_is_the_right_answer(model):
    def counts(n):  # as the lab's check cell counts them
        naive, cached = ch02.trace_naive(model, [1], n), ch02.trace_cached(model, [1], n)
        return {"A": naive.rows[-1], "B": naive.computed, "C": naive.rows[-1] ** 2,
                "D": sum(r * r for r in naive.rows), "E": cached.rows[-1], "F": cached.computed}

    small, large = counts(32), counts(64)
    assert {k: round(math.log2(large[k] / small[k])) for k in KEYS} == RIGHT
    assert small["B"] == 32 * 33 // 2 and small["F"] == 32  # the counter saw what the formulas say


def test_the_right_answer_passes(capsys):
    assert check(_tensor(RIGHT), _tensor(RIGHT), name="growth", mistakes=mistakes.growth(RIGHT))


@pytest.mark.parametrize("wrong, words", [
    ({"B": 1}, "B: a total adds up the steps"),
    ({"C": 1}, "C: the naive step scores all t query rows"),
    ({"D": 2}, "D: the sum of n steps"),
    ({"E": 1}, "E: with a cache a step computes K/V for its one new token"),
    ({"F": 2}, "F: with a cache each position's K/V is computed once"),
    ({"E": 1, "F": 2}, "E and F"),
    ({"A": 2, "B": 1}, "A and B are swapped"),
])
def test_each_wrong_decision_is_named(wrong, words):
    found = _diagnoses({**RIGHT, **wrong})
    assert len(found) == 1 and found[0].startswith(words), found


def test_an_answer_wrong_in_an_unusual_way_gets_the_hint_not_a_wrong_diagnosis():
    assert _diagnoses({**RIGHT, "A": 0, "D": 1}) == []


def test_every_diagnosis_is_a_short_line():
    for what in mistakes.growth(RIGHT):
        assert len(what.split()) <= 30, what
