"""Lab 00's decision exercise (choose the tile): every wrong answer is named by the checker, the right one passes,
and the right one is what the interpreter measures (in CPU mode)."""

from __future__ import annotations

import pytest
import torch

import kvlib  # noqa: F401  (sets the mode before Triton is imported)
from kvlib import bench, runtime, vector_add
from kvlib.course import mistakes
from kvlib.course.check import CheckFailed, check
from kvlib.course.mistakes import lab00

PREFIX = "Diagnosis: yours matches a known mistake: "


def _diagnoses(yours) -> list[str]:
    with pytest.raises(CheckFailed) as err:
        check(yours, mistakes.choose_tile_reference(20_000), name="choose_tile", mistakes=mistakes.choose_tile(20_000))
    return [line[len(PREFIX):] for line in str(err.value).splitlines() if line.startswith(PREFIX)]


def test_the_right_answer_passes(capsys):
    assert mistakes.choose_tile_reference(20_000) == (1024, 2)
    assert check((1024, 2), (1024, 2), name="choose_tile", mistakes=mistakes.choose_tile(20_000))
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("yours, words", [
    ((16, 1), "masked lanes cost almost nothing"),
    ((16, 2), "launches 1,250 programs to tile 1024's 20"),
    ((16, 3), "same 3 × 4 × 20,000 bytes"),
    ((1024, 1), "masks more lanes (480) than tile 16 (0)"),
    ((1024, 3), "what differs is the number of programs"),
])
def test_each_wrong_answer_is_named(yours, words):
    found = _diagnoses(yours)
    assert len(found) == 1 and words in found[0], found


def test_every_wrong_answer_is_diagnosed_and_the_right_one_is_not():
    wrong = set(lab00.choose_tile(20_000).values())
    every = {(t, r) for t in lab00.TILE_CHOICES for r in lab00.TILE_REASONS}
    assert wrong == every - {(1024, 2)}


@pytest.mark.skipif(not runtime.INTERPRETER, reason="the decision is about Triton's interpreter (CPU mode)")
def test_the_right_tile_is_what_the_interpreter_measures():
    x = torch.randn(4_000)  # 250 programs at tile 16, 4 at tile 1024: the same rule as the lab's 20,000, faster
    t16 = bench.time_ms(lambda: vector_add.add(x, x, tile=16), warmup=1, rep=3)
    t1024 = bench.time_ms(lambda: vector_add.add(x, x, tile=1024), warmup=1, rep=3)
    assert t1024 < t16 / 4, (t16, t1024)
