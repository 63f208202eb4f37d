"""Lab 06's decision exercise (the axis along which K and V get their scales): the evidence, the check and the
diagnosis of every wrong choice (kvlib.course.ch06.axis_evidence / check_axis_choice, kvlib.course.mistakes.axis_choice)."""

import itertools

import pandas as pd
import pytest
import torch

from kvlib.corpus import course_texts
from kvlib.course import ch06, mistakes
from kvlib.course.check import CheckFailed
from kvlib.model import load_tiny

AXES = ("per-token", "per-channel")


@pytest.fixture(scope="module")
def evidence():
    """Evidence of the form the lab prints, from the tiny model's K and V on 256 bytes of held-out text (cheap; the
    lab's own evidence, SmolLM2 over 2,048 tokens, is checked when nbval runs the solution)."""
    model, tok = load_tiny(device="cpu")
    _, val = course_texts()
    rec = ch06.RecordKV()
    with torch.no_grad():
        model(torch.tensor([tok.encode(val[:256])]), cache=rec)
    return ch06.axis_evidence(*rec.layers())


def test_the_evidence_supports_kivis_split(evidence):
    assert list(evidence.index) == ["K", "V"]
    assert evidence.loc["K", "per-channel error"] < evidence.loc["K", "per-token error"]
    assert evidence.loc["V", "per-token error"] < evidence.loc["V", "per-channel error"]
    # the structure a learner decides from: K's channels are less even than V's
    assert evidence.loc["K", "largest / median channel max"] > evidence.loc["V", "largest / median channel max"]
    assert (evidence[["largest / median channel max", "largest / median token max"]] >= 1).all().all()


def test_the_right_choice_passes(evidence, capsys):
    assert ch06.check_axis_choice("per-channel", " Per-Token ", evidence) is True  # case and spaces ignored
    out = capsys.readouterr().out
    assert "yours per-channel, per-token  reference per-channel, per-token  ✓" in out and "PASS ✓" in out
    assert "per-token error" in out  # the evidence, with the cost of each choice


@pytest.mark.parametrize("k_axis, v_axis", [c for c in itertools.product(AXES, AXES) if c != ("per-channel", "per-token")])
def test_every_wrong_choice_names_each_wrong_tensor(evidence, k_axis, v_axis):
    with pytest.raises(CheckFailed) as err:
        ch06.check_axis_choice(k_axis, v_axis, evidence)
    report = str(err.value)
    assert "FAIL ✗" in report
    assert ("K per token" in report) == (k_axis == "per-token")
    assert ("V per channel" in report) == (v_axis == "per-channel")


def test_an_unknown_axis_is_named(evidence):
    with pytest.raises(CheckFailed, match="'per-head' is not one of the two axes"):
        ch06.check_axis_choice("per-head", "per-token", evidence)


def test_the_reference_follows_the_evidence():
    """Were per channel better for V on some model, the check would ask for it: the answer is not hard-coded."""
    ev = pd.DataFrame({"largest / median channel max": [5.0, 4.0], "largest / median token max": [1.2, 1.1],
                       "per-token error": [0.02, 0.02], "per-channel error": [0.01, 0.01]}, index=["K", "V"])
    assert ch06.check_axis_choice("per-channel", "per-channel", ev) is True
    with pytest.raises(CheckFailed, match="V per token: its largest channel is 4.0x"):
        ch06.check_axis_choice("per-channel", "per-token", ev)


def test_the_diagnoses_quote_the_evidence_in_one_short_line(evidence):
    lines = mistakes.axis_choice({"K": "per-token", "V": "per-channel"}, {"K": "per-channel", "V": "per-token"}, evidence)
    assert len(lines) == 2 and all(len(line.split()) <= 35 for line in lines)
    assert f"{evidence.loc['K', 'per-token error']:.4f} vs {evidence.loc['K', 'per-channel error']:.4f}" in lines[0]
    assert f"{evidence.loc['V', 'per-channel error']:.4f} vs {evidence.loc['V', 'per-token error']:.4f}" in lines[1]
