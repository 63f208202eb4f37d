"""Chapter 09b's diagrams, drawn from live objects: a KIVI cache's groups and exact windows, a low-rank basis
before and after RoPE, and a bits-per-layer plan beside the layer sensitivities it came from.

- ``kivi(cache, b, layer, head)``: what a live ``kvlib.kivi.KiviCache`` holds for one sequence, layer and K/V
  head, keys above and values below (positions across, channels down), each number shaded by the magnitude the
  cache gives back (the dequantized codes, or the exact window). Each key group (one channel over G tokens) and
  each value group (one token over ``v_group`` channels) is framed; the positions still in the exact windows
  are shaded in the key colour. The counts come from the cache itself (``n_quantized``, ``group``,
  ``v_group``), so a test can compare the frames with its state. Gids: ``"key group"``, ``"value group"``,
  ``"exact key"``, ``"exact value"`` (one per exact position).
- ``low_rank_basis(k_pre, k_post, rank)``: one head's keys (T, D) before and after RoPE: the share of
  ‖K‖² the first r directions of an SVD keep, for every r, and the first ``rank`` directions themselves
  (|U|, channels down). Lines carry gids ``"energy before RoPE"`` / ``"energy after RoPE"``.
- ``bit_plans(sensitivity, plans)``: the per-layer sensitivity as bars (log scale), and under it, on the same
  layer axis, each plan's bits per layer as bars (gid ``"plan bar"``, height = bits), so which layers a plan
  widens can be read against how sensitive they are.
"""

from __future__ import annotations

import torch

from . import COLORS

__all__ = ["kivi", "low_rank_basis", "bit_plans", "energy"]


def _rect(ax, x, y, w, h, gid, color, lw=0.6, fill=None, alpha=1.0):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), w, h, facecolor=fill or "none", edgecolor=color, linewidth=lw, gid=gid,
                           alpha=alpha))


def _shade(mag, n_quantized, vmax):
    """(D, n) magnitudes -> an RGBA image: greys for the quantized positions, oranges for the exact window."""
    from matplotlib import colormaps

    level = (0.08 + 0.85 * mag / vmax).clamp(0, 1).numpy()
    img = colormaps["Greys"](level)
    img[:, n_quantized:] = colormaps["Oranges"](level[:, n_quantized:])
    return img


def kivi(cache, b: int = 0, layer: int = 0, head: int = 0, *, title: str | None = None):
    """The keys and values a live ``KiviCache`` holds for sequence ``b``, ``layer``, K/V ``head``. Returns a Figure."""
    import matplotlib.pyplot as plt

    from ...kivi import KiviCache

    if not isinstance(cache, KiviCache):
        raise TypeError(f"kivi draws a kvlib.kivi.KiviCache, got {type(cache).__name__}")
    n = cache.held(b)
    if n == 0:
        raise ValueError("the cache holds no positions yet: run a prompt through it first")
    n_kq, n_vq = cache.n_quantized(b)
    G, vg = cache.group, cache.v_group
    keys, values = cache._held_kv(layer, n, torch.float32)  # what attention reads: dequantized part, then exact
    k, v = keys[b, head].T.abs(), values[b, head].T.abs()  # (D, n) each
    D = k.shape[0]
    fig, axes = plt.subplots(2, 1, figsize=(min(13.0, 2.0 + 0.11 * n), 2 * (0.9 + 0.06 * D)), sharex=True)
    panels = ((axes[0], k, n_kq, "keys: per channel, one (scale, zero) per channel over each group of "
               f"G = {G} tokens"),
              (axes[1], v, n_vq, f"values: per token, one (scale, zero) per token over each {vg} channels"))
    for ax, mag, nq, name in panels:
        ax.imshow(_shade(mag, nq, float(mag.max()) or 1.0), aspect="auto", interpolation="nearest",
                  extent=(0, n, D, 0))
        ax.set_ylabel("channel")
        ax.set_title(f"{name}; {nq} positions in {cache.bits} bits, {n - nq} exact", fontsize=9, loc="left")
    for g in range(n_kq // G):  # one frame per (group of G tokens, channel)
        for d in range(D):
            _rect(axes[0], g * G, d, G, 1, "key group", COLORS["text"], lw=0.25)
    for t in range(n_vq):  # one frame per (token, group of vg channels)
        for j in range(D // vg):
            _rect(axes[1], t, j * vg, 1, vg, "value group", COLORS["text"], lw=0.25)
    for ax, nq, gid in ((axes[0], n_kq, "exact key"), (axes[1], n_vq, "exact value")):
        for t in range(nq, n):
            _rect(ax, t, 0, 1, D, gid, COLORS["key"], lw=0.0)
        if nq < n:
            ax.axvline(nq, color=COLORS["new"], lw=1.5)
            ax.text(nq + 0.3, D - 1, "exact window →", color=COLORS["new"], fontsize=8, va="bottom",
                    bbox=dict(facecolor="white", edgecolor="none", pad=1))
    axes[1].set_xlabel("position (oldest left); grey: stored in low bits and given back dequantized; orange: exact")
    fig.suptitle(title or f"KIVI cache, layer {layer}, K/V head {head}: {n} positions", fontsize=10)
    fig.tight_layout()
    return fig


def energy(x: torch.Tensor) -> torch.Tensor:
    """(T, D) rows -> (D,) the share of ‖x‖² the first r right-singular directions keep, r = 1..D."""
    s = torch.linalg.svdvals(x.double())
    return (s.pow(2).cumsum(0) / s.pow(2).sum()).float()


def low_rank_basis(k_pre: torch.Tensor, k_post: torch.Tensor, rank: int, *, title: str | None = None):
    """One head's keys (T, D) before and after RoPE: energy kept by rank, and |U| of the first ``rank``
    directions of each. Returns a Figure."""
    import matplotlib.pyplot as plt

    for name, x in (("k_pre", k_pre), ("k_post", k_post)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"{name} must be a (T, D) tensor: one head's keys, got {getattr(x, 'shape', x)}")
    if k_pre.shape != k_post.shape:
        raise ValueError(f"k_pre and k_post must have one shape, got {tuple(k_pre.shape)} and {tuple(k_post.shape)}")
    D = k_pre.shape[1]
    if not 1 <= rank <= D:
        raise ValueError(f"rank must lie in 1..D={D}, got {rank}")
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), gridspec_kw=dict(width_ratios=[1.6, 1, 1]))
    ranks = torch.arange(1, D + 1)
    for x, name, style in ((k_pre, "before RoPE", "-"), (k_post, "after RoPE", "--")):
        e = energy(x)
        axes[0].plot(ranks, 100 * e, style, gid=f"energy {name}",
                     label=f"{name}: {100 * e[rank - 1]:.1f}% kept at rank {rank}")
    axes[0].axvline(rank, color=COLORS["masked"], lw=0.8)
    axes[0].set(xlabel="rank r (directions kept)", ylabel="share of ‖K‖² kept (%)", xlim=(1, D))
    axes[0].legend(fontsize=8, loc="lower right")
    for ax, x, name in ((axes[1], k_pre, "before RoPE"), (axes[2], k_post, "after RoPE")):
        U = torch.linalg.svd(x.double(), full_matrices=False).Vh[:rank].T.abs()  # (D, rank)
        ax.imshow(U.numpy(), aspect="auto", cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
        ax.set(title=f"|U|, first {rank} directions, {name}", xlabel="direction (strongest first)", ylabel="channel",
               xticks=range(0, rank, max(1, rank // 8)))
        ax.title.set_fontsize(9)
    fig.suptitle(title or "one head's keys: how many directions they need", fontsize=10)
    fig.tight_layout()
    return fig


def _log_ticks(ax, values):
    """Plain decimal labels at 1-2-5 steps over the values' range (at least three in view)."""
    import math

    from matplotlib.ticker import NullFormatter

    if not values:
        return
    lo, hi = min(values), max(values)
    e0, e1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    ticks = [m * 10.0 ** e for e in range(e0, e1 + 1) for m in (1, 2, 5)]
    inside = [t for t in ticks if lo / 1.5 <= t <= hi * 1.5]
    if len(inside) < 3:
        inside = [t for t in ticks if lo / 5 <= t <= hi * 5][:max(3, len(inside))]
    ax.set_ylim(min(inside + [lo]) / 1.2, max(inside + [hi]) * 1.2)
    ax.set_yticks(inside, [f"{t:g}" for t in inside])
    ax.yaxis.set_minor_formatter(NullFormatter())


BIT_COLOURS = {2: "#C44E52", 4: "#DD8452", 8: "#55A868", 16: "#4C72B0"}


def bit_plans(sensitivity, plans: dict, *, title: str | None = None):
    """Per-layer sensitivity (bars, log) and each plan's bits per layer beneath it on the same layer axis."""
    import matplotlib.pyplot as plt

    sens = [float(s) for s in sensitivity]
    if not sens or not plans:
        raise ValueError("bit_plans needs one sensitivity per layer and at least one plan")
    for name, bits in plans.items():
        if len(bits) != len(sens):
            raise ValueError(f"plan {name!r} has {len(bits)} layers, the sensitivities {len(sens)}")
    L = len(sens)
    fig, axes = plt.subplots(1 + len(plans), 1, figsize=(10, 2.2 + 0.9 * len(plans)), sharex=True,
                             gridspec_kw=dict(height_ratios=[2.2] + [1] * len(plans)))
    bars = axes[0].bar(range(L), [max(s, 1e-12) for s in sens], color=COLORS["masked"], edgecolor=COLORS["text"],
                       linewidth=0.4)
    for p in bars:
        p.set_gid("sensitivity")
    axes[0].set(yscale="log", ylabel="KL (nats/token)")
    _log_ticks(axes[0], [s for s in sens if s > 0])
    axes[0].set_title("sensitivity: one layer's K/V at low bits, all others exact", fontsize=9, loc="left")
    for ax, (name, bits) in zip(axes[1:], plans.items()):
        bars = ax.bar(range(L), bits, color=[BIT_COLOURS.get(int(x), COLORS["filled"]) for x in bits])
        for p in bars:
            p.set_gid("plan bar")
        ax.set(ylim=(0, 17), yticks=[2, 4, 8, 16], ylabel="bits")
        ax.set_title(name, fontsize=8, loc="left")
    axes[-1].set(xlabel="layer", xticks=range(0, L, 2 if L > 16 else 1))
    fig.suptitle(title or "which layers each plan gives the bits to", fontsize=10)
    fig.tight_layout()
    return fig
