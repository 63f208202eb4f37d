"""Lab 09a's decision (which rule still holds the needle): the evidence is measured from the caches, the checker
passes the rule that holds the most and diagnoses every other choice (kvlib.course.ch09.needle_evidence /
check_needle_choice, kvlib.course.mistakes.lab09.needle_choice)."""

import pandas as pd
import pytest
import torch

from kvlib.corpus import ByteTokenizer
from kvlib.course import ch09, mistakes
from kvlib.course.check import CheckFailed
from kvlib.course.mistakes import lab09
from kvlib.model import ModelConfig, Transformer


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64,
                                   max_seq_len=1024)).eval()


@pytest.fixture(scope="module")
def evidence(small):
    return ch09.needle_evidence(small, ch09.passkey_prompts(ByteTokenizer(), n=4, length=418), frac=0.25)


def _fake(shares, rules=ch09.CHOICES):
    return pd.DataFrame({"needle held (mean %)": shares, "prompts holding any of it": [0, 1, 2], "prompts": [3] * 3},
                        index=list(rules))


def test_the_evidence_is_what_the_caches_hold(small, evidence):
    assert list(evidence.index) == list(ch09.CHOICES) and (evidence["prompts"] == 4).all()
    p = ch09.passkey_prompts(ByteTokenizer(), n=4, length=418)[0]
    cache = ch09.prefilled(small, p.ids, ch09.budget_for(0.25, 418), ["sinks + window"])["sinks + window"]
    held = set(cache.held_positions(0, 0)[0].tolist())
    assert ch09.needle_held(cache, p.needle) == sum(j in held for j in p.needle) / len(p.needle)  # one layer's head 0
    window = range(418 - (ch09.budget_for(0.25, 418) - 4), 418)
    assert held == set(range(4)) | set(window)


def test_the_window_holds_no_needle_outside_it(small):
    prompts = ch09.passkey_prompts(ByteTokenizer(), n=4, length=418)
    early = [p for p in prompts if p.needle.stop < 418 - ch09.budget_for(0.25, 418)]
    ev = ch09.needle_evidence(small, early, frac=0.25, rules=["sinks + window"])
    assert early and ev.loc["sinks + window", "needle held (mean %)"] == 0


@pytest.mark.parametrize("shares, right", [([10.0, 40.0, 90.0], "SnapKV"), ([60.0, 10.0, 30.0], "H2O"),
                                           ([30.0, 80.0, 40.0], "H2O, streamed (ours)")])
def test_the_reference_is_the_rule_that_holds_most(shares, right, capsys):
    ev = _fake(shares)
    assert ch09.check_needle_choice(right, ev) is True
    assert "PASS" in capsys.readouterr().out
    for wrong in set(ch09.CHOICES) - {right}:
        with pytest.raises(CheckFailed) as e:
            ch09.check_needle_choice(wrong, ev)
        assert f"yours {wrong}" in str(e.value) and f"reference {right}" in str(e.value)


@pytest.mark.parametrize("wrong, words", [("sinks + window", "further back"), ("H2O", "every prompt query"),
                                          ("H2O, streamed (ours)", "before the question")])
def test_each_wrong_choice_gets_its_reason(wrong, words):
    rules = ch09.CHOICES if wrong in ch09.CHOICES else (wrong, "H2O", "SnapKV")  # the window: an extra rule to try
    shares = [85.0 if r == "SnapKV" else 5.0 + 25.0 * (r == wrong) for r in rules]
    lines = lab09.needle_choice(wrong, "SnapKV", _fake(shares, rules))
    assert len(lines) == 1 and words in lines[0] and f"{wrong} holds" in lines[0]
    assert mistakes.needle_choice is lab09.needle_choice  # the package gathers it


def test_a_choice_that_is_not_a_rule_is_named():
    lines = lab09.needle_choice("TOVA", "SnapKV", _fake([5.0, 30.0, 85.0]))
    assert "not one of the rules" in lines[0]
    with pytest.raises(CheckFailed):
        ch09.check_needle_choice("snapkv", _fake([5.0, 30.0, 85.0]))  # the names are exact


def test_the_former_lab_09_diagnoses_stay_for_lab_09b():
    for name in ("sink_window_keep", "h2o_update", "snapkv_priority", "quantize_2bit", "quantize_keys_2bit",
                 "absorbed_attention"):
        assert name in lab09.__all__ and callable(getattr(mistakes, name))


def test_the_lead_is_a_paired_interval_over_the_prompts(capsys):
    per = {"H2O, streamed (ours)": [10.0, 10.0, 10.0, 10.0], "H2O": [20.0, 10.0, 30.0, 20.0],
           "SnapKV": [30.0, 20.0, 40.0, 30.0]}
    ev = pd.DataFrame({"needle held (mean %)": [sum(v) / 4 for v in per.values()], "prompts holding any of it": [4] * 3,
                       "prompts": [4] * 3, "per prompt (%)": list(per.values())}, index=list(per))
    leads = ch09.needle_lead(ev)  # against each other rule, in order of their mean
    assert leads[0] == ("SnapKV", "H2O", 10.0, 10.0, 10.0)  # +10 on every prompt: paired, no spread
    assert leads[1][:3] == ("SnapKV", "H2O, streamed (ours)", 20.0) and leads[1][3] < 20.0 < leads[1][4]
    assert ch09.check_needle_choice("SnapKV", ev) is True
    out = capsys.readouterr().out
    assert "SnapKV - H2O: +10.0 points of the needle [+10.0, +10.0] (95% paired bootstrap over 4 prompts)" in out
    assert "SnapKV - H2O, streamed (ours): +20.0 points" in out
    assert "per prompt" not in out  # the per-prompt shares feed the interval; the table shows the means
    ev.at["SnapKV", "per prompt (%)"] = [40.0, 0.0, 50.0, 30.0]  # the same mean lead, not on every prompt
    best, other, lead, lo, hi = ch09.needle_lead(ev)[0]
    assert (best, other) == ("SnapKV", "H2O") and lo < 0 < lead < hi
