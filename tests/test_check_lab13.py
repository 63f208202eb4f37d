"""Lab 13 (the capstone): every known mistake of its two exercises is named by the check, and every wrong decision
gets its diagnosis (kvlib.course.mistakes.lab13, kvlib.course.capstone.check_decision)."""

import pandas as pd
import pytest
import torch

from kvlib.course import capstone
from kvlib.course.check import CheckFailed, check
from kvlib.course.mistakes import lab13
from kvlib.quant import quantize_int8


def _pools():
    g = torch.Generator().manual_seed(1)
    codes, scales = torch.zeros(4, 4, 3, 8, dtype=torch.int8), torch.ones(4, 4, 3, dtype=torch.float16)
    rows = torch.randn(5, 3, 8, generator=g) * torch.tensor([1.0, 4.0, 0.1])[:, None]
    return codes, scales, rows, torch.tensor([13, 2, 3, 8, 9])


def _write(codes, scales, q, s, slots):
    H_KV, D = codes.shape[2:]
    codes.view(-1, H_KV, D)[slots] = q
    scales.view(-1, H_KV)[slots] = s.to(scales.dtype).expand(len(slots), H_KV)


def per_tensor(codes, scales, rows, slots):  # as the source article: one scale for everything
    q, s = quantize_int8(rows, dim=None)
    _write(codes, scales, q, s.reshape(1, 1), slots)


def per_token(codes, scales, rows, slots):
    q, s = quantize_int8(rows, dim=(1, 2))
    _write(codes, scales, q, s.reshape(-1, 1), slots)


def truncated(codes, scales, rows, slots):
    amax = rows.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    _write(codes, scales, (rows / s).to(torch.int8), s[..., 0], slots)


@pytest.mark.parametrize("wrong, words", [(per_tensor, "per-tensor"), (per_token, "shared by its K/V heads"),
                                          (truncated, "truncated, not rounded")])
def test_store_mistakes_are_named(wrong, words):
    codes, scales, rows, slots = _pools()
    mine, ref = (codes.clone(), scales.clone()), (codes.clone(), scales.clone())
    wrong(*mine, rows, slots)
    capstone.store_int8(*ref, rows, slots)
    with pytest.raises(CheckFailed, match=words):
        check(mine, ref, name="store_int8", atol=0, mistakes=lab13.store_int8(codes, scales, rows, slots))


def until_under(table, held, budget, bs, sinks):
    n = 0
    while held - n * bs >= budget and len(table) - n > sinks + 1:
        n += 1
    return n


def whole_overflow(table, held, budget, bs, sinks):
    return min(max(0, held - budget) // bs, max(0, len(table) - sinks - 1))


def sinks_too(table, held, budget, bs, sinks):
    n = 0
    while held - n * bs > budget and len(table) - n > 1:
        n += 1
    return n


@pytest.mark.parametrize("wrong, case, words", [
    (until_under, ([0, 1, 2, 3], 64, 64, 16, 1), "strictly under the budget"),
    (whole_overflow, ([0, 1, 2, 3, 4], 70, 48, 16, 1), "rounds the overflow down"),
    (sinks_too, ([1, 2], 30, 8, 16, 1), "sink blocks are dropped too"),
])
def test_drop_mistakes_are_named(wrong, case, words):
    assert wrong(*case) != capstone.drop_blocks(*case)
    with pytest.raises(CheckFailed, match=words):
        check(wrong(*case), capstone.drop_blocks(*case), name="drop_blocks", mistakes=lab13.drop_blocks(*case))


def _rules():
    nll = {"none": torch.full((64,), 2.75), "window": torch.full((64,), 4.4) + torch.linspace(-1, 1, 64),
           "sinks + window": torch.full((64,), 3.0) + torch.linspace(-1, 1, 64)}
    return pd.DataFrame({"decode peak KiB": [12994.0, 928.1, 928.1], "meets target": [False, True, True],
                         "perplexity": [15.7, 84.5, 19.9], "ppl low": [12.0, 48.3, 15.3],
                         "ppl high": [20.7, 147.2, 26.3], "nll": list(nll.values())}, index=list(nll))


def test_rule_decision():
    ev = _rules()
    assert capstone.check_decision("rule", "sinks + window", ev)
    with pytest.raises(CheckFailed, match="over the memory target"):
        capstone.check_decision("rule", "none", ev)
    with pytest.raises(CheckFailed, match="attention sinks"):
        capstone.check_decision("rule", "window", ev)
    with pytest.raises(CheckFailed, match="not one of the rules"):
        capstone.check_decision("rule", "H2O", ev)


def _budgets():
    # the memory columns as served_memory measured them for SmolLM2 (blocks of 16, a 1,024-token prompt)
    return pd.DataFrame({"between steps KiB": [556.9, 742.5, 928.1, 1113.8],
                         "decode peak KiB": [742.5, 928.1, 1113.8, 1299.4],
                         "decode mean KiB": [568.5, 754.1, 939.7, 1125.4],
                         "prefill peak KiB": [2041.9, 2227.5, 2413.2, 2598.8],
                         "fp16 count KiB": [1080.0, 1440.0, 1800.0, 2160.0],
                         "int8 codes count KiB": [540.0, 720.0, 900.0, 1080.0],
                         "meets target": [True, True, True, False], "perplexity": [24.0, 21.3, 20.5, 19.9],
                         "ppl low": [18.6, 16.4, 15.8, 15.3], "ppl high": [31.5, 27.7, 27.0, 26.3]},
                        index=pd.Index([48, 64, 80, 96], name="budget"))


def test_budget_decision():
    ev, target = _budgets(), 1152 * 1024
    assert capstone.check_decision("budget", 80, ev, target_bytes=target)
    with pytest.raises(CheckFailed, match="over the 1152 KiB target.*between steps it holds 1114 KiB"):
        capstone.check_decision("budget", 96, ev, target_bytes=target)
    with pytest.raises(CheckFailed, match="counting the budget's positions at fp16"):
        capstone.check_decision("budget", 48, ev, target_bytes=target)
    with pytest.raises(CheckFailed, match="holds every position a smaller one holds"):
        capstone.check_decision("budget", 64, ev, target_bytes=target)
    ev.loc[112] = [1200.0, 1300.0, 1250.0, 2700.0, 2520.0, 1100.0, False, 19.0, 15.0, 25.0]  # the codes fit
    with pytest.raises(CheckFailed, match="every row has an fp16 scale"):
        capstone.check_decision("budget", 112, ev, target_bytes=target)


def test_block_decision():
    # budget 80, as block_evidence measured it for SmolLM2
    ev = pd.DataFrame({"held (mean)": [76.5, 72.5, 64.5], "held (min)": [73, 65, 49],
                       "held % of budget": [95.6, 90.6, 80.6], "sink positions": [8, 16, 32],
                       "decode peak KiB": [1021.0, 1113.8, 1113.8], "decode mean KiB": [939.8, 939.7, 939.7],
                       "meets target": [True, True, True]}, index=pd.Index([8, 16, 32], name="block_size"))
    assert capstone.check_decision("block_size", 16, ev)
    with pytest.raises(CheckFailed, match="saws down by up to 31 positions"):
        capstone.check_decision("block_size", 32, ev)
    with pytest.raises(CheckFailed, match="shorter block table"):
        capstone.check_decision("block_size", 8, ev)
    ev.loc[16, ["decode peak KiB", "meets target"]] = [1299.4, False]  # a peak over the target rules a size out
    assert capstone.best_block(ev) == 8
    with pytest.raises(CheckFailed, match="whole block of 16 more"):
        capstone.check_decision("block_size", 16, ev)


def test_the_evidence_rules_follow_the_measurements():
    assert capstone.best_rules(_rules()) == ["sinks + window"]
    tied = _rules()
    noise = torch.randn(64, generator=torch.Generator().manual_seed(0))  # paired differences around 0
    tied.at["window", "nll"] = tied.at["sinks + window", "nll"] + (noise - noise.mean())
    tied.at["window", "perplexity"] = 20.1
    assert set(capstone.best_rules(tied)) == {"window", "sinks + window"}  # not separated: either is right
    assert capstone.check_decision("rule", "window", tied)
    assert capstone.best_budget(_budgets()) == 80
    none_fit = _budgets().assign(**{"meets target": False})
    assert capstone.best_budget(none_fit) is None
