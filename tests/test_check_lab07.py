"""Lab 07's decision exercise (how many K/V heads fit): the evidence, the check and the diagnosis of every wrong
choice (kvlib.course.mistakes.kv_heads_choice, kvlib.course.ch07.check_kv_heads_choice)."""

import pytest

from kvlib.course import ch07, mistakes
from kvlib.course.check import CheckFailed
from kvlib.memory import GiB, kv_cache_bytes


def test_the_evidence_is_the_formula():
    ev = ch07.kv_heads_evidence()
    c = ch07.LAB_CHOICE
    assert list(ev.index) == [32, 16, 8, 4, 2, 1]  # the divisors of the 32 query heads
    for g, row in ev.iterrows():
        want = kv_cache_bytes(c["n_layers"], g, c["head_dim"], c["seq_len"], c["batch"], "fp16") / GiB
        assert row["cache (GiB)"] == want
        assert row["fits"] == (want <= c["gpu_gib"] - c["weights_gib"] - c["reserve_gib"])
    assert ev.loc[8, "cache (GiB)"] - ev.loc[8, "left for it (GiB)"] == 1  # 8 heads miss by one GiB: the trap


def test_the_right_choice_passes(capsys):
    assert ch07.check_kv_heads_choice(4) is True
    out = capsys.readouterr().out
    assert "yours 4  reference 4  ✓" in out and "PASS ✓" in out


@pytest.mark.parametrize("yours", [32, 16, 8, 2, 1])
def test_every_wrong_divisor_is_diagnosed(yours, capsys):
    with pytest.raises(CheckFailed) as err:
        ch07.check_kv_heads_choice(yours)
    assert mistakes.kv_heads_choice()[yours] in str(err.value) and "FAIL ✗" in str(err.value)
    assert f"yours {yours}  reference 4  ✗" in capsys.readouterr().out


@pytest.mark.parametrize("yours", [3, 5, 7, 0, "4", 4.0, True, None])
def test_a_count_that_is_not_a_divisor_says_so(yours):
    with pytest.raises(CheckFailed) as err:
        ch07.check_kv_heads_choice(yours)
    assert mistakes.kv_heads_choice()["not a divisor"] in str(err.value)


def test_each_diagnosis_names_its_own_mistake():
    why = mistakes.kv_heads_choice()
    assert "factor 2" in why[16] and "weights" in why[8] and "largest" in why[1] and "2 bytes" not in why[4 if 4 in why else 1]
    assert 4 not in why  # the right answer has no diagnosis
