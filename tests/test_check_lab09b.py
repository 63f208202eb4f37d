"""Lab 09b's decision exercise (the cache to deploy within a memory budget): the evidence, the check and the diagnosis
of every wrong choice (kvlib.course.ch09b.budget_evidence / check_budget_choice, kvlib.course.mistakes.lab09b)."""

import pandas as pd
import pytest
import torch

from kvlib.corpus import course_texts
from kvlib.course import ch09b
from kvlib.course.check import CheckFailed
from kvlib.course.mistakes import lab09, lab09b
from kvlib.footprint import fp16_cache_bytes, held_bytes
from kvlib.kivi import KiviCache
from kvlib.model import load_tiny

COLS = ["nominal % of fp16", "held % of fp16 (measured)", "KL from the full cache (nats/token)"]


def _evidence():
    """The shape of what the lab measures on the tiny model at 512 tokens (numbers rounded from a run)."""
    return pd.DataFrame([[50.0, 53.1, 0.0008], [25.0, 36.7, 0.0302], [12.5, 24.6, 0.4691], [12.5, 41.6, 0.4423],
                         [12.5, 24.6, 0.5750]], index=list(ch09b.BUDGET_CANDIDATES), columns=COLS)


@pytest.fixture(scope="module")
def measured():
    model, tok = load_tiny(device="cpu")
    _, val = course_texts()
    return model, ch09b.budget_evidence(model, tok.encode(val)[:128])


def test_the_evidence_is_measured_from_the_caches(measured):
    model, ev = measured
    assert list(ev.index) == list(ch09b.BUDGET_CANDIDATES) and list(ev.columns) == COLS
    kivi = held_bytes(KiviCache.for_model(model, 1, 128, bits=2, residual=32, **ch09b.KIVI), float_bytes=2).total
    assert ev.loc["KIVI 2-bit, R=32", COLS[1]] == pytest.approx(100 * kivi / fp16_cache_bytes(model.config, 128))
    assert (ev[COLS[1]] > ev[COLS[0]]).all()  # scales (and windows) always cost something on top of the codes
    assert ev.loc["KIVI 2-bit, R=128", COLS[1]] > ev.loc["KIVI 2-bit, R=32", COLS[1]]  # the longer window
    assert (ev[COLS[2]] >= 0).all() and ev.loc["INT8 (chapter 06)", COLS[2]] < ev.loc["KIVI 2-bit, R=32", COLS[2]]


def test_the_right_choice_passes(capsys):
    assert ch09b.check_budget_choice(" KIVI 4-bit, R=32 ", _evidence(), 40) is True
    out = capsys.readouterr().out
    assert "reference 'KIVI 4-bit, R=32'  ✓" in out and "PASS ✓" in out and "budget: 40%" in out


@pytest.mark.parametrize("choice, says", [
    ("KIVI 2-bit, R=128", "is 12.5% of fp16 by its bits but holds 41.6% measured"),
    ("INT8 (chapter 06)", "holds 53.1% of fp16, over the 40% budget"),
    ("KIVI 2-bit, R=32", "but KIVI 4-bit, R=32 fits too (36.7%) and is closer to the full cache: KL 0.0302 vs 0.4691"),
    ("2-bit, prompt through the codes (not KIVI), R=32", "its prompt attended through the 2-bit codes"),
    ("KIVI 2 bit", "is not one of the candidates"),
])
def test_every_wrong_choice_is_diagnosed(choice, says):
    with pytest.raises(CheckFailed) as err:
        ch09b.check_budget_choice(choice, _evidence(), 40)
    assert "FAIL ✗" in str(err.value) and says in str(err.value)


def test_the_reference_follows_the_evidence_and_the_budget():
    ev = _evidence()
    assert ch09b.budget_reference(ev, 40) == "KIVI 4-bit, R=32"
    assert ch09b.budget_reference(ev, 60) == "INT8 (chapter 06)"
    assert ch09b.budget_reference(ev, 30) == "KIVI 2-bit, R=32"
    assert ch09b.budget_reference(ev, 20) is None
    ev.loc["KIVI 2-bit, R=32", COLS[2]] = 0.0001  # were 2 bits closer, the check would ask for them
    assert ch09b.budget_reference(ev, 40) == "KIVI 2-bit, R=32"
    with pytest.raises(CheckFailed, match="no candidate holds 20% or less"):
        ch09b.check_budget_choice("KIVI 2-bit, R=32", ev, 20)


def test_the_diagnoses_are_short():
    ev = _evidence()
    for name in ev.index:
        lines = lab09b.budget_choice(name, "KIVI 4-bit, R=32", ev, 40) if name != "KIVI 4-bit, R=32" else []
        assert all(len(line.split()) <= 35 for line in lines)


def test_the_written_exercises_share_lab_09s_diagnoses():
    assert lab09b.quantize_2bit is lab09.quantize_2bit and lab09b.absorbed_attention is lab09.absorbed_attention
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    assert any("constant group" in d for d in lab09b.quantize_2bit(x, 4))
