"""Chapter 11b's picture of Quest, drawn from a live ``QuestCache``: one query's bound per block and the blocks it
reads.

- ``quest_selection(cache, q, layer, head)``: for one query head of one layer, a bar per block of the cached
  sequence: the bar is Quest's bound (``block_upper_bound`` of the query against the block's kmin/kmax, read from
  the cache), the dot is the true maximum of q . k over the block's keys (what the bound bounds). The blocks
  ``select_blocks`` picks for this query are filled (the current, partly filled block is always among them), the
  others pale; an optional ``needle`` (a range of positions) is shaded behind its blocks.

Gids: ``"selected"`` (a bar of a block the query reads), ``"skipped"`` (one it does not), ``"needle"`` (the
shading), so a test can count them against ``select_blocks``.
"""

from __future__ import annotations

import torch

from . import COLORS

__all__ = ["selection_of", "quest_selection"]


def selection_of(cache, q: torch.Tensor, layer: int, b: int = 0):
    """(bound (H, N), true max (H, N), selected block ids (H, n_sel)) for the query ``q`` (1, H, D) of sequence b
    at the cache's last position, in ``layer``: what the cache's own decode step would compute."""
    from ...sparse import block_upper_bound, select_blocks

    n = cache.held(b)
    bs = cache.block_size
    N = -(-n // bs)
    kmin, kmax = cache.kmin[layer][b: b + 1, :, :N], cache.kmax[layer][b: b + 1, :, :N]
    bound = block_upper_bound(q, kmin, kmax)  # (1, H, N)
    H, H_KV = q.shape[1], kmin.shape[1]
    keys = cache.k[layer][b: b + 1, :, :n].float().repeat_interleave(H // H_KV, 1)  # (1, H, n, D)
    scores = (keys @ q.float()[..., None])[..., 0]  # (1, H, n)
    pad = torch.full((1, H, N * bs - n), float("-inf"))
    true_max = torch.cat([scores, pad], -1).view(1, H, N, bs).amax(-1)
    sel = select_blocks(bound, torch.tensor([n]), bs, cache.n_select)  # (1, H, n_sel)
    return bound[0], true_max[0], sel[0]


def quest_selection(cache, q: torch.Tensor, layer: int, head: int = 0, *, b: int = 0, needle: range | None = None,
                    title: str | None = None):
    """Bars of Quest's bound per block for query head ``head`` in ``layer`` (dots: the true block maximum), the
    blocks the query reads filled. Returns the Figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    bound, true_max, sel = selection_of(cache, q, layer, b)
    chosen = set(sel[head][sel[head] >= 0].tolist())
    N, bs = bound.shape[1], cache.block_size
    fig, ax = plt.subplots(figsize=(9, 3.2))
    lo = float(min(bound[head].min(), true_max[head].min())) - 1
    top = float(bound[head].max()) + 1
    if needle is not None:
        first, last = needle.start // bs, (needle.stop - 1) // bs
        ax.add_patch(Rectangle((first - 0.5, lo), last - first + 1, top - lo, facecolor=COLORS["new"], alpha=0.12,
                               edgecolor="none", gid="needle"))
        ax.text((first + last) / 2, top, "the needle", ha="center", va="bottom", fontsize=7, color=COLORS["new"])
    for j in range(N):
        picked = j in chosen
        ax.add_patch(Rectangle((j - 0.4, lo), 0.8, float(bound[head, j]) - lo,
                               facecolor=COLORS["filled"] if picked else COLORS["empty"],
                               edgecolor=COLORS["filled"], linewidth=0.6, gid="selected" if picked else "skipped"))
    ax.plot(range(N), true_max[head].tolist(), "o", color=COLORS["key"], ms=3.5, label="true max of q·k in the block")
    ax.plot([], [], "s", color=COLORS["filled"], label=f"bound, block read ({len(chosen)} of {N})")
    ax.plot([], [], "s", color=COLORS["empty"], markeredgecolor=COLORS["filled"], label="bound, block skipped")
    ax.set(xlim=(-0.8, N - 0.2), ylim=(lo, top + 0.08 * (top - lo)), xlabel=f"block of {bs} positions",
           ylabel="q·k (unscaled)")
    ax.set_title(title or f"layer {layer}, query head {head}: Quest's bound per block", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig
