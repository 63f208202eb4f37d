"""Chapter 09a's picture, drawn from live budgeted caches: which positions each rule holds after the same prompt.

- ``held_share(cache, n, b=0)``: for each of the first ``n`` positions of sequence ``b``, the share of (layer, K/V
  head) pairs whose cache holds it, read from ``cache.held_positions(b, layer)`` (so the picture is what the cache
  holds, not what a rule is supposed to keep).
- ``strips(caches, n, needle=None)``: one heat strip per cache (one rule each, after the same prompt): a cell per
  position, dark where every layer and K/V head holds it, pale where only some do, blank where none does. An
  optional ``needle`` (a range of positions) is framed across every strip.

Gids: ``"held"`` (a position some layer and head holds), ``"evicted"`` (one none holds), ``"needle"`` (the frame),
so a test can count them against ``held_positions``.
"""

from __future__ import annotations

import torch

from . import COLORS, label, new_figure

__all__ = ["held_share", "strips"]

CELL_W, CELL_H = 0.045, 0.32  # inches per position, strip height
LEFT = 2.2  # room for the rule's name


def held_share(cache, n: int, b: int = 0) -> torch.Tensor:
    """(n,) share of the cache's (layer, K/V head) pairs that hold each position 0..n-1 of sequence b."""
    layers = len(cache.k)
    count = torch.zeros(n)
    heads = 0
    for layer in range(layers):
        pos = cache.held_positions(b, layer).cpu()  # (H_KV, held)
        heads += pos.shape[0]
        for row in pos:
            row = row[(row >= 0) & (row < n)]
            count[row] += 1
    return count / heads


def strips(caches: dict, n: int, needle: range | None = None, *, b: int = 0, title: str | None = None):
    """One heat strip per cache of ``caches`` ({name: a budgeted cache after a prompt of at least ``n`` tokens}):
    position j's cell is shaded by ``held_share`` (white: no layer holds it). Returns the Figure."""
    from matplotlib import colormaps
    from matplotlib.patches import Rectangle

    if not caches:
        raise ValueError("caches must name at least one cache")
    cmap = colormaps["Purples"]
    width = LEFT + n * CELL_W + 0.4
    height = 0.7 + len(caches) * (CELL_H + 0.12) + 0.5
    fig, ax = new_figure(max(width, 6.0), height, title=title)
    top = height - 0.6
    for r, (name, cache) in enumerate(caches.items()):
        share = held_share(cache, n, b)
        y = top - (r + 1) * (CELL_H + 0.12)
        label(ax, LEFT - 0.1, y + CELL_H / 2, name, ha="right", fontsize=8)
        for j in range(n):
            s = float(share[j])
            color = cmap(0.25 + 0.75 * s) if s > 0 else COLORS["empty"]
            ax.add_patch(Rectangle((LEFT + j * CELL_W, y), CELL_W, CELL_H, facecolor=color, edgecolor="none",
                                   gid="held" if s > 0 else "evicted"))
    if needle is not None:
        y0 = top - len(caches) * (CELL_H + 0.12) - 0.04
        ax.add_patch(Rectangle((LEFT + needle.start * CELL_W, y0), len(needle) * CELL_W,
                               len(caches) * (CELL_H + 0.12) + 0.02, facecolor="none", edgecolor=COLORS["new"],
                               linewidth=1.4, gid="needle"))
        label(ax, LEFT + (needle.start + len(needle) / 2) * CELL_W, top + 0.08, "the needle", ha="center",
              fontsize=7, color=COLORS["new"])
    for j in range(0, n, 32):
        label(ax, LEFT + (j + 0.5) * CELL_W, 0.42, str(j), ha="center", fontsize=6)
    label(ax, LEFT, 0.15, "position in the prompt; dark: held by every layer and K/V head, pale: by some, "
          "grey: by none", fontsize=7)
    return fig
