"""Lab 04's new diagnoses: a wrong formula checked against measured memory, and the wrong beliefs behind a wrong
decision in exercise 3 (which deployments fit). Each mistake, written as a learner would, is named by the check."""

import pytest
import torch

from kvlib.course import mistakes
from kvlib.course.check import CheckFailed, check
from kvlib.memory import GiB, fit, spec

from _checks import diagnoses  # tests/_checks.py

CASE = (4, 2, 64, 4096, 3, 4)  # the fp32 KVCache the lab measures: layers, K/V heads, head dim, tokens, batch, bytes
SLACK = 2 * 8 * 4096 + 2**20
OPTIONS = {"A": ("Llama-3.1-8B", 80), "B": ("Llama-3.1-8B", 40), "C": ("Qwen2.5-7B", 40), "D": ("Llama-3-8B", 80),
           "E": ("Llama-3.1-8B", 16), "F": ("SmolLM2-135M", 141)}
RUNS = [(spec(name), gib * GiB) for name, gib in OPTIONS.values()]
BATCH, CONTEXT, RESERVE = 16, 16384, 4 * GiB


def f64(x):
    return torch.tensor(float(x), dtype=torch.float64)


def measured_check(predicted, measured=None):
    L, h, d, s, b, e = CASE
    measured = 2 * L * h * d * s * b * e + 8 * 4096 if measured is None else measured  # a page per buffer more
    return lambda: check(f64(predicted), f64(measured), atol=SLACK, rtol=0, mistakes=mistakes.measured_kv_bytes(CASE))


def test_the_right_formula_passes_against_the_measurement(capsys):
    L, h, d, s, b, e = CASE
    assert measured_check(2 * L * h * d * s * b * e)()


@pytest.mark.parametrize("wrong, words", [
    (lambda L, h, d, s, b, e: L * h * d * s * b * e, "factor 2 is missing"),
    (lambda L, h, d, s, b, e: 2 * L * h * d * s * e, "batch is missing"),
    (lambda L, h, d, s, b, e: 2 * L * h * d * s * b, "bytes_per_element is missing"),
    (lambda L, h, d, s, b, e: 16 * L * h * d * s * b * e, "in bits"),
])
def test_a_wrong_formula_is_named_against_the_measurement(wrong, words):
    found = diagnoses(measured_check(wrong(*CASE)))
    assert len(found) == 1 and words in found[0], found


def decision_check(letters):
    reference = [int(fit(m, g, BATCH, CONTEXT, reserve_bytes=RESERVE).fits) for m, g in RUNS]
    return lambda: check(torch.tensor([int(x in letters) for x in OPTIONS]), torch.tensor(reference),
                         mistakes=mistakes.deployments_that_fit(RUNS, BATCH, CONTEXT, RESERVE))


def test_the_decision_is_a_and_c(capsys):
    assert decision_check({"A", "C"})()


@pytest.mark.parametrize("letters, words", [
    ({"A", "C", "D", "F"}, "maximum context is left out"),  # D and F are configured for 8,192 tokens
    (set(), "query heads"),  # with query heads, neither Llama-3.1-8B on 80 GB nor Qwen on 40 GB fits
])
def test_a_wrong_decision_names_the_belief_behind_it(letters, words):
    found = diagnoses(decision_check(letters))
    assert len(found) == 1 and words in found[0], found


def test_forgetting_the_weights_and_counting_one_sequence_give_the_same_wrong_set():
    found = diagnoses(decision_check({"A", "B", "C"}))  # B only fits if the weights or 15 sequences are left out
    assert len(found) == 2 and any("weights are left out" in f for f in found) and any("one sequence" in f for f in found)


def test_an_unknown_wrong_decision_gets_the_hint_only():
    with pytest.raises(CheckFailed) as err:
        decision_check({"E"})()
    assert "Diagnosis" not in str(err.value)
