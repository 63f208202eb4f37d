"""Lab 07's decision exercise (how many K/V heads fit beside the model's own weights): the evidence, the check
and the diagnosis of every wrong choice (kvlib.course.mistakes.kv_heads_choice, ch07.check_kv_heads_choice)."""

import pytest

from kvlib.course import ch07, mistakes
from kvlib.course.check import CheckFailed
from kvlib.memory import GiB, kv_cache_bytes


def test_the_evidence_is_the_formula_with_the_weights_of_each_choice():
    ev = ch07.kv_heads_evidence()
    c = ch07.LAB_CHOICE
    assert list(ev.index) == [32, 16, 8, 4, 2, 1]  # the divisors of the 32 query heads
    for g, row in ev.iterrows():
        cache = kv_cache_bytes(c["n_layers"], g, c["head_dim"], c["seq_len"], c["batch"], "fp16") / GiB
        # wk and wv: (g * head_dim, d_model) each per layer, in fp16; the MHA weights are weights_gib
        weights = c["weights_gib"] - c["n_layers"] * 2 * c["d_model"] * (c["n_heads"] - g) * c["head_dim"] * 2 / GiB
        assert row["cache (MiB)"] == cache * 1024 and row["weights (MiB)"] == weights * 1024
        assert row["left for the cache (MiB)"] == (c["gpu_gib"] - weights - c["reserve_gib"]) * 1024
        assert row["fits"] == (cache <= c["gpu_gib"] - weights - c["reserve_gib"])
    # the trap: with MHA's weights 8 heads would miss; with their own weights they fit
    assert ev.loc[8, "cache (MiB)"] > (c["gpu_gib"] - c["weights_gib"] - c["reserve_gib"]) * 1024
    assert ev.loc[8, "fits"] and not ev.loc[16, "fits"]


def test_the_right_choice_passes(capsys):
    assert ch07.check_kv_heads_choice(8) is None  # no stray value in the lab's cell
    out = capsys.readouterr().out
    assert "yours 8  reference 8  ✓" in out and "PASS ✓" in out


@pytest.mark.parametrize("yours", [32, 16, 4, 2, 1])
def test_every_wrong_divisor_is_diagnosed(yours, capsys):
    with pytest.raises(CheckFailed) as err:
        ch07.check_kv_heads_choice(yours)
    assert mistakes.kv_heads_choice(ch07.kv_heads_evidence())[yours] in str(err.value) and "FAIL ✗" in str(err.value)
    assert f"yours {yours}  reference 8  ✗" in capsys.readouterr().out


@pytest.mark.parametrize("yours", [3, 5, 7, 0, "8", 8.0, True, None])
def test_a_count_that_is_not_a_divisor_says_so(yours):
    with pytest.raises(CheckFailed) as err:
        ch07.check_kv_heads_choice(yours)
    assert mistakes.kv_heads_choice(ch07.kv_heads_evidence())["not a divisor"] in str(err.value)


def test_each_diagnosis_names_its_own_mistake():
    why = mistakes.kv_heads_choice(ch07.kv_heads_evidence())
    assert "factor 2" in why[16] and "weights" in why[4] and "shrink" in why[4] and "MQA" in why[1]
    assert "13.5 GiB" in why[4] and "64.5 GiB" in why[4]  # read from the evidence, not typed in
    assert 8 not in why  # the right answer has no diagnosis
