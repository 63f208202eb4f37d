"""Conceptual diagrams drawn from live objects: one module per chapter, shared drawing helpers here.

A diagram in this course is not a picture pasted into a notebook: it is drawn by code from the object
the chapter is about (a cache, a block table, a mask), so it is exact, it changes when the object
changes, and a learner can draw their own lab's state with the same call.

Each chapter's module (``kvlib.course.draw.attention``, ``.cache``, ``.memory``, ...) has functions
that take a live object and return a matplotlib ``Figure``. They share the helpers below, which tag
every cell they draw with a ``gid`` (``"filled"``, ``"empty"``, ``"masked"``, ...), so a test can
count what a figure shows and compare it with the object's real state
(``cells_with(fig, "filled") == cache length``).
"""

from __future__ import annotations

__all__ = ["COLORS", "new_figure", "cells", "grid", "cells_with", "label", "arrow", "title"]

# One palette for every diagram: the same meaning keeps the same colour across chapters.
COLORS = {
    "query": "#4C72B0",    # Q, the query token(s)
    "key": "#DD8452",      # K rows
    "value": "#55A868",    # V rows
    "filled": "#8172B3",   # a cache slot holding a token's K/V
    "new": "#C44E52",      # what this step writes
    "empty": "#EEEEEE",    # allocated, not yet written
    "masked": "#BBBBBB",   # hidden by the causal mask
    "weight": "#937860",   # model weights
    "text": "#222222",
}


def new_figure(width: float, height: float, *, title: str | None = None):
    """A figure with one axes in data units = inches (so cells are square), no ticks or frame."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, height))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=11)
    return fig, ax


def cells(ax, x: float, y: float, kinds, *, size: float = 0.3, texts=None, vertical: bool = False,
          fontsize: float = 7):
    """Draw a row (or column) of square cells from (x, y), the first cell's lower-left corner.

    kinds: one key of COLORS per cell (its colour and its gid, e.g. "filled"); texts: optional labels.
    Returns the patches. Each patch's gid is its kind, so ``cells_with(fig, kind)`` can count them.
    """
    from matplotlib.patches import Rectangle

    patches = []
    for i, kind in enumerate(kinds):
        cx, cy = (x, y - i * size) if vertical else (x + i * size, y)
        p = Rectangle((cx, cy), size, size, facecolor=COLORS[kind], edgecolor="white", linewidth=1.0, gid=kind)
        ax.add_patch(p)
        patches.append(p)
        if texts is not None and texts[i] not in (None, ""):
            dark = kind not in ("empty", "masked")
            ax.text(cx + size / 2, cy + size / 2, str(texts[i]), ha="center", va="center", fontsize=fontsize,
                    color="white" if dark else COLORS["text"])
    return patches


def grid(ax, x: float, y: float, kinds_2d, *, size: float = 0.3, texts_2d=None, fontsize: float = 7):
    """Rows of cells, the first row on top at height y; kinds_2d[r][c] as in :func:`cells`."""
    out = []
    for r, row in enumerate(kinds_2d):
        out += cells(ax, x, y - r * size, row, size=size, fontsize=fontsize,
                     texts=None if texts_2d is None else texts_2d[r])
    return out


def cells_with(fig, kind: str) -> int:
    """How many cells of this kind the figure shows (all axes): what a test compares with the object."""
    return sum(1 for ax in fig.axes for p in ax.patches if p.get_gid() == kind)


def label(ax, x: float, y: float, text: str, *, ha: str = "left", va: str = "center", fontsize: float = 9,
          color: str | None = None, **kw):
    return ax.text(x, y, text, ha=ha, va=va, fontsize=fontsize, color=color or COLORS["text"], **kw)


def arrow(ax, x0: float, y0: float, x1: float, y1: float, *, color: str | None = None, text: str | None = None):
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                arrowprops=dict(arrowstyle="->", color=color or COLORS["text"], lw=1.2))
    if text:
        label(ax, (x0 + x1) / 2, (y0 + y1) / 2 + 0.12, text, ha="center", fontsize=8)


def title(ax, text: str):
    ax.set_title(text, fontsize=11)


