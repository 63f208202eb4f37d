"""Chapter 11b's picture of a hybrid cache, drawn from a live ``HybridCache``: a window layer's ring beside a full
layer.

- ``ring_and_full(cache, window_layer, full_layer)``: the full layer's rows, one cell per position (0, 1, 2, ...),
  and the window layer's rows as the ring stores them (row r holds position ``cache.pos[layer][b, r]``; sink rows
  first when the cache keeps sinks), each cell labelled with its position; the newest position is marked in both.

Gids: ``"filled"`` (a row holding a position), ``"sink"`` (a sink row holding its position), ``"new"`` (the row of
the newest position), ``"empty"`` (a ring row holding nothing yet), so a test can count them against
``cache.held(b, layer)``.
"""

from __future__ import annotations

from . import COLORS, label, new_figure

__all__ = ["ring_and_full", "row_kinds"]

SIZE = 0.32  # inches per cell
FILL = {"filled": COLORS["filled"], "sink": COLORS["key"], "new": COLORS["new"], "empty": COLORS["empty"]}


def _row(ax, x, y, kinds, texts):
    """One row of square cells, gid = kind (``cells`` of the shared helpers, with a sink colour of its own)."""
    from matplotlib.patches import Rectangle

    for i, (kind, text) in enumerate(zip(kinds, texts)):
        ax.add_patch(Rectangle((x + i * SIZE, y), SIZE, SIZE, facecolor=FILL[kind], edgecolor="white", linewidth=1.0,
                               gid=kind))
        if text:
            ax.text(x + (i + 0.5) * SIZE, y + SIZE / 2, text, ha="center", va="center", fontsize=6,
                    color=COLORS["text"] if kind == "empty" else "white")


def row_kinds(cache, layer: int, b: int = 0) -> tuple[list, list]:
    """(kinds, positions) of each row of ``layer`` for sequence b: a full layer's rows 0 .. n - 1, a window layer's
    ring rows in storage order."""
    n = int(cache.seq_lens[b])
    if cache.plan[layer] == "full":
        positions = list(range(n))
    else:
        positions = cache.pos[layer][b].tolist()
    kinds = []
    for r, p in enumerate(positions):
        if p < 0:
            kinds.append("empty")
        elif p == n - 1:
            kinds.append("new")
        elif cache.plan[layer] == "window" and r < getattr(cache, "n_sink", 0):
            kinds.append("sink")
        else:
            kinds.append("filled")
    return kinds, positions


def ring_and_full(cache, window_layer: int, full_layer: int, *, b: int = 0, title: str | None = None):
    """Two rows of cells: ``full_layer`` (every position) and ``window_layer`` (its ring). Returns the Figure."""
    if cache.plan[window_layer] != "window" or cache.plan[full_layer] != "full":
        raise ValueError(f"layer {window_layer} must be a window layer and {full_layer} a full one, "
                         f"got {cache.plan[window_layer]!r} and {cache.plan[full_layer]!r}")
    full_kinds, full_pos = row_kinds(cache, full_layer, b)
    ring_kinds, ring_pos = row_kinds(cache, window_layer, b)
    left = 2.3
    width = left + SIZE * max(len(full_kinds), len(ring_kinds)) + 0.3
    fig, ax = new_figure(max(width, 6.0), 2.3, title=title)
    y_full, y_ring = 1.35, 0.55
    label(ax, left - 0.1, y_full + SIZE / 2, f"layer {full_layer} (full)", ha="right", fontsize=8)
    _row(ax, left, y_full, full_kinds, [str(p) for p in full_pos])
    label(ax, left - 0.1, y_ring + SIZE / 2, f"layer {window_layer} (window ring)", ha="right", fontsize=8)
    _row(ax, left, y_ring, ring_kinds, ["" if p < 0 else str(p) for p in ring_pos])
    n_sink = getattr(cache, "n_sink", 0)
    note = f"ring: {len(ring_kinds)} rows" + (f", the first {n_sink} keep the sinks" if n_sink else "")
    label(ax, 0.2, 0.2, note + "; a cell shows the position its row holds (red: the newest, orange: a sink)",
          fontsize=7)
    return fig
