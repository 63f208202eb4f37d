"""Chapter 00's diagram: a Triton launch as a grid of programs over a vector, the last tile's mask drawn.

``program_grid(n, tile)`` draws the launch ``vector_add.add`` makes for ``n`` elements and tiles of
``tile``: one row per program (``triton.cdiv(n, tile)`` of them), one cell per lane, each cell showing the
element index (offset) that lane handles. Lanes inside the tensor are drawn "filled" (they load and
store); lanes past its end are drawn "masked" (``mask=False``: no load, no store). So the figure shows
``cdiv(n, tile)`` programs, ``n`` filled lanes and ``programs * tile - n`` masked ones, which is what
``tests/test_draw_setup.py`` counts.

``lanes``: optionally, a function ``lanes(pid, n, tile) -> (offsets, mask)`` that decides each program's
offsets and mask (a lab's own answer, say); by default the kernel's rule ``offsets = pid * tile +
arange(tile)``, ``mask = offsets < n``. The picture then shows what that function says, right or wrong.
"""

from __future__ import annotations

from matplotlib.patches import Rectangle

from . import COLORS, cells, label, new_figure

__all__ = ["program_grid", "kernel_lanes", "MAX_PROGRAMS", "MAX_TILE"]

MAX_PROGRAMS = 16  # rows a readable picture holds
MAX_TILE = 64  # lanes per row a readable picture holds


def kernel_lanes(pid: int, n: int, tile: int):
    """What ``add_kernel`` computes for program ``pid``: (offsets, mask) as Python lists."""
    offsets = [pid * tile + i for i in range(tile)]  # pid * TILE + tl.arange(0, TILE)
    return offsets, [o < n for o in offsets]  # mask = offsets < n_elements


def program_grid(n, tile: int, *, lanes=None, title: str | None = None):
    """The launch of a 1-D elementwise kernel over ``n`` elements (an int, or a tensor: its numel) in tiles of
    ``tile``: one row per program, its lanes coloured filled (in the tensor) or masked (past its end).

    Returns the matplotlib Figure. Raises ValueError for a launch too large to draw readably
    (more than MAX_PROGRAMS programs or MAX_TILE lanes per program): draw a smaller case.
    """
    n = int(n.numel()) if hasattr(n, "numel") else int(n)
    if n < 1 or tile < 1:
        raise ValueError(f"program_grid: n and tile must be positive, got n={n}, tile={tile}")
    programs = -(-n // tile)  # triton.cdiv(n, tile)
    if programs > MAX_PROGRAMS or tile > MAX_TILE:
        raise ValueError(f"program_grid: {programs} programs of {tile} lanes is too many to draw; pick n and tile "
                         f"with at most {MAX_PROGRAMS} programs and {MAX_TILE} lanes (the same rule holds at any size)")
    who = "add_kernel's launch" if lanes is None else f"the launch {getattr(lanes, '__name__', 'lanes')}() describes"
    lanes = lanes or kernel_lanes
    size = min(0.4, 8.0 / tile)  # inches per lane
    left, top_pad, bottom_pad = 1.2, 0.3, 0.95
    width = max(5.4, left + tile * size + (0.3 if size >= 0.25 else 1.0))
    height = top_pad + programs * (size + 0.12) + bottom_pad
    fig, ax = new_figure(width, height)
    fs = 7 if size >= 0.35 else 6
    y_end_top = height - top_pad
    masked_total = 0
    for pid in range(programs):
        offsets, mask = lanes(pid, n, tile)
        offsets = [int(o) for o in (offsets.tolist() if hasattr(offsets, "tolist") else offsets)]
        mask = [bool(m) for m in (mask.tolist() if hasattr(mask, "tolist") else mask)]
        if len(offsets) != tile or len(mask) != tile:
            raise ValueError(f"program_grid: lanes({pid}, {n}, {tile}) must give {tile} offsets and {tile} mask values")
        y = y_end_top - (pid + 1) * (size + 0.12)
        kinds = ["filled" if m else "masked" for m in mask]
        masked_total += kinds.count("masked")
        cells(ax, left, y, kinds, size=size, texts=offsets if size >= 0.25 else None, fontsize=fs)
        if size < 0.25:  # lanes too small to hold their index: name the row's first and last offset
            label(ax, left + tile * size + 0.08, y + size / 2, f"{offsets[0]}…{offsets[-1]}", fontsize=7)
        ax.add_patch(Rectangle((left - 0.03, y - 0.03), tile * size + 0.06, size + 0.06, fill=False,
                               edgecolor=COLORS["text"], linewidth=0.8, gid="program"))
        label(ax, left - 0.12, y + size / 2, f"program {pid}", ha="right", fontsize=8)
    # where the tensor ends: after element n - 1, in the row and lane that hold it
    last_pid, last_lane = divmod(n - 1, tile)
    if (last_pid, last_lane) != (programs - 1, tile - 1):
        x_end = left + (last_lane + 1) * size
        y_row = y_end_top - (last_pid + 1) * (size + 0.12)
        ax.plot([x_end, x_end], [y_row - 0.12, y_row + size + 0.05], color=COLORS["new"], linewidth=1.5)
        label(ax, x_end, y_row - 0.2, f"end of the tensor (n = {n})", ha="center", va="top", fontsize=8,
              color=COLORS["new"])
    # legend: two rows under the grid (its swatches are drawn without a gid, so they are not counted as lanes)
    for row, (kind, text) in enumerate([("filled", "lane inside the tensor: loads and stores"),
                                        ("masked", "lane masked off (mask False): no load, no store")]):
        ly = 0.08 + (1 - row) * 0.28
        ax.add_patch(Rectangle((left, ly), 0.2, 0.2, facecolor=COLORS[kind], edgecolor="white"))
        label(ax, left + 0.28, ly + 0.1, text, fontsize=8)
    ax.set_title(title or f"{who}: n = {n} elements, TILE = {tile}\n"
                 f"grid = cdiv({n}, {tile}) = {programs} programs, {masked_total} lanes masked off", fontsize=10)
    return fig
