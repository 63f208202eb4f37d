"""Lab 08a's checkers: the traces are the engine's own decisions, and every known wrong answer to the admission,
preemption, chunk-slot and recompute-or-swap exercises is diagnosed (kvlib.course.ch08, kvlib.course.mistakes.lab08)."""

import pandas as pd
import pytest
import torch

from kvlib.course import ch08, mistakes
from kvlib.course.check import CheckFailed, check
from kvlib.course.mistakes import lab08

from _checks import diagnoses  # tests/_checks.py


@pytest.fixture(scope="module")
def traces():
    model = ch08.toy_model()
    return ch08.admission_trace(model)[0], ch08.preemption_trace(model)[0]


def test_the_reference_rules_are_the_engine_s(traces):
    adm, pre = traces
    assert all(lab08._admit(s) == s["admitted"] for s in adm)
    assert all(lab08._preempt(s) == s["preempted"] for s in pre)
    assert any(c > 0 for s in adm for _, c in s["waiting"])  # the trace holds cached prefixes
    assert sum(bool(s["preempted"]) for s in pre) > 0


@pytest.mark.parametrize("rule, words", [
    (dict(watermark=False), "watermark is ignored"), (dict(stop=False), "first come, first served"),
    (dict(cached=False), "cached tokens"), (dict(accumulate=False), "admitted request's blocks"),
])
def test_admission_mistakes_are_diagnosed(traces, rule, words):
    adm = traces[0]
    width = max(len(s["waiting"]) for s in adm)
    ref = mistakes.admission_flags([s["admitted"] for s in adm], width)
    mine = mistakes.admission_flags([lab08._admit(s, **rule) for s in adm], width)
    found = diagnoses(lambda: check(mine, ref, name="admitted", mistakes=mistakes.admission(adm)))
    assert any(words in f for f in found), found


def test_chunk_cases_are_the_cache_s_slots():
    for n, (bs, L, T) in enumerate(ch08.CHUNK_SHAPES):
        table, slots = ch08.chunk_case(bs, L, T, seed=n)
        assert slots.tolist() == [table[p // bs] * bs + p % bs for p in range(L, L + T)]


def _costs(cheaper):
    return pd.DataFrame({"n tokens": [16, 64, 256], "cheaper": cheaper}).set_index("n tokens")


@pytest.mark.parametrize("cheaper, right", [(["swap"] * 3, "swap"), (["recompute"] * 3, "recompute"),
                                            (["recompute", "swap", "swap"], "it depends")])
def test_the_preemption_decision_follows_the_measurements(cheaper, right, capsys):
    table = _costs(cheaper)
    assert ch08.preemption_answer(table) == right
    assert ch08.check_preemption_choice(right, table) is None and "PASS ✓" in capsys.readouterr().out
    for wrong in {"swap", "recompute", "it depends", "both"} - {right}:
        with pytest.raises(CheckFailed) as err:
            ch08.check_preemption_choice(wrong, table)
        assert lab08.preemption_choice(wrong, right) in str(err.value)


def test_the_usual_wrong_choice_on_a_cpu_is_explained():
    why = lab08.preemption_choice("recompute", "swap")
    assert "GPU" in why and "swap" in why
    assert "changed with the length" in lab08.preemption_choice("swap", "it depends")


def test_measured_costs_give_a_table_the_decision_reads():
    lengths, times, per_token, bandwidth = ch08.measured_costs(ch08.toy_model(), lengths=(8, 32))
    table = ch08.cost_table(lengths, times, per_token, bandwidth)
    assert list(table.index) == [8, 32] and set(table["cheaper"]) <= {"swap", "recompute"}
    f = ch08.interpolate(lengths, times)
    assert f(8) == pytest.approx(times[0]) and f(32) == pytest.approx(times[1]) and f(0) == 0
    assert torch.isclose(torch.tensor(f(20)), torch.tensor((times[0] + times[1]) / 2))
