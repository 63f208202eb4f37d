"""Chapter 00's diagram (kvlib.course.draw.setup) shows the launch it is given: cdiv(n, tile) programs, n lanes inside
the tensor and programs * tile - n lanes masked off; a different launch, or a different rule for the lanes, draws a
different picture; and the figure passes the course's readability check."""

from __future__ import annotations

import pytest
import torch

import kvlib  # noqa: F401  (sets the mode before Triton is imported)
from kvlib import runtime, vector_add
from kvlib._triton import triton
from kvlib.course import figures
from kvlib.course.draw import cells_with, setup


def counts(fig):
    return cells_with(fig, "program"), cells_with(fig, "filled"), cells_with(fig, "masked")


@pytest.mark.parametrize("n, tile", [(40, 16), (10, 4), (64, 16), (1, 16), (17, 16), (1000, 64), (5, 1)])
def test_the_drawing_shows_the_launch(n, tile):
    fig = setup.program_grid(n, tile)
    programs = triton.cdiv(n, tile)
    assert counts(fig) == (programs, n, programs * tile - n)
    assert figures.figure_problems(fig) == []


def test_the_notebooks_launch_is_drawn_from_the_live_tensor():
    """Notebook 00 runs add() on 40 elements with tile 16 and draws the launch from its output tensor."""
    n, tile = 40, 16
    x = torch.arange(n, dtype=torch.float32, device=runtime.DEVICE)
    out = vector_add.add(x, x, tile=tile)
    fig = setup.program_grid(out, tile)
    assert counts(fig) == (triton.cdiv(n, tile), n, triton.cdiv(n, tile) * tile - n) == (3, 40, 8)
    assert "n = 40" in fig.axes[0].get_title() and "8 lanes masked off" in fig.axes[0].get_title()


def test_each_lane_shows_its_offset_and_only_the_last_program_is_masked():
    fig = setup.program_grid(10, 4)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert [str(i) for i in range(12)] == [t for t in texts if t.isdigit()]  # offsets 0..11, in lane order
    masked = [p for p in fig.axes[0].patches if p.get_gid() == "masked"]
    rows = {round(p.get_y(), 6) for p in masked}
    assert len(masked) == 2 and len(rows) == 1  # both in one row
    lowest_row = min(round(p.get_y(), 6) for p in fig.axes[0].patches if p.get_gid() == "filled")
    assert rows == {lowest_row}  # the last program's row (drawn lowest)


def test_changing_the_launch_or_the_lane_rule_changes_the_picture():
    assert counts(setup.program_grid(40, 16)) != counts(setup.program_grid(48, 16))
    assert counts(setup.program_grid(48, 16)) == (3, 48, 0)  # a multiple of the tile: nothing masked

    def off_by_one(pid, n, tile):  # a lab's wrong mask: keeps index n too
        offsets = pid * tile + torch.arange(tile)
        return offsets, offsets <= n

    assert counts(setup.program_grid(10, 4, lanes=off_by_one)) == (3, 11, 1)


def test_a_launch_too_large_to_draw_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="too many to draw"):
        setup.program_grid(98_765, 1024)
    with pytest.raises(ValueError, match="positive"):
        setup.program_grid(0, 16)
    with pytest.raises(ValueError, match="must give 4 offsets"):
        setup.program_grid(10, 4, lanes=lambda pid, n, tile: ([0], [True]))
