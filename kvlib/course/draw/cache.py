"""Chapter 03's diagrams, drawn from the live cache: its slots, how it fills, prefill vs decode, split-K.

- ``slots(cache)``: every sequence's row of S_max slots as the cache holds them now: ``seq_lens[b]``
  cells ``"filled"``, the rest ``"empty"``; the rows the last call wrote carry a ``"new"`` frame.
- ``Recorder(cache)`` stands where a cache stands in the model (``cache.attend``), passes every call on
  to the live cache and notes what each forward pass wrote; ``filling(recorder)`` draws the cache after
  each of those calls (the last row is the cache's state now), ``prefill_vs_decode(recorder)`` puts the
  first call (a prefill: T rows at once, a T x L block of scores) beside the last (a decode step: one
  row, one row of L scores).
- ``split_k(seq_len, num_splits, lse)``: the positions one (sequence, head) reads, cut into the decode
  kernel's splits (``kernel_splits``, the kernel's own rule), each split's partial result and its
  log-sum-exp, and their merge.

Every cell carries a gid (``"filled"``, ``"new"``, ``"empty"``, ``"query"``, ``"masked"``,
``"position"``), so a test can count what a figure shows and compare it with the cache.
"""

from __future__ import annotations

from . import COLORS, arrow, cells, label, new_figure

__all__ = ["Recorder", "slots", "filling", "prefill_vs_decode", "kernel_splits", "split_k"]

SIZE = 0.3  # inches per slot
SPLIT_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974"]


class Recorder:
    """Passes every ``attend`` call on to ``cache`` and notes, per forward pass, where each sequence's
    new rows start and how many there are (layer 0's call: every layer writes the same rows).

    ``calls``: one ``(start, T)`` per forward pass, ``start`` the lengths before it (a list, one per
    sequence). Anything else (``seq_lens``, ``next_positions()``, ...) is the cache's own.
    """

    def __init__(self, cache):
        self.cache = cache
        self.calls: list[tuple[list[int], int]] = []

    def attend(self, layer_idx, q, k, v):
        if layer_idx == 0:
            self.calls.append((self.cache.seq_lens.tolist(), int(q.shape[2])))
        return self.cache.attend(layer_idx, q, k, v)

    def __getattr__(self, name):  # only called for what the recorder itself lacks
        if name == "cache":
            raise AttributeError(name)
        return getattr(self.cache, name)


def _frame(ax, x, y, size=SIZE, gid="new"):
    """A red frame over one slot: the row this call wrote (gid "new")."""
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x + 0.02, y + 0.02), size - 0.04, size - 0.04, facecolor="none",
                           edgecolor=COLORS["new"], linewidth=2.0, gid=gid))


def _row(ax, x, y, capacity, filled, new_from=None, size=SIZE):
    """One sequence's slots: ``filled`` of ``capacity`` held, frames on slots new_from .. filled - 1."""
    kinds = ["filled"] * filled + ["empty"] * (capacity - filled)
    cells(ax, x, y, kinds, size=size, texts=[str(s) for s in range(capacity)], fontsize=6)
    if new_from is not None:
        for s in range(new_from, filled):
            _frame(ax, x + s * size, y, size)


def _legend(ax, x, y):
    """What the colours mean; its sample cells carry the gid "legend", so they never count as slots."""
    from matplotlib.patches import Rectangle

    for dx, kind, text in ((0.0, "filled", "holds a token's K and V"), (2.3, "empty", "allocated, not written")):
        ax.add_patch(Rectangle((x + dx, y), 0.2, 0.2, facecolor=COLORS[kind], edgecolor="white", gid="legend"))
        label(ax, x + dx + 0.25, y + 0.1, text, fontsize=8)
    _frame(ax, x + 4.6, y - 0.05, size=0.3, gid="legend")
    label(ax, x + 4.95, y + 0.1, "written by this call", fontsize=8)


def slots(cache, new=None, *, title: str | None = None):
    """The cache now: one row of S_max slots per sequence; ``new`` (an int, or one per sequence): how many
    of each sequence's last filled rows the last call wrote (framed)."""
    lens = cache.seq_lens.tolist()
    B, cap = len(lens), cache.max_len
    news = [new] * B if isinstance(new, int) or new is None else list(new)
    width, height = 1.6 + cap * SIZE + 0.3, 0.9 + B * (SIZE + 0.15)
    fig, ax = new_figure(max(width, 7.5), height,
                         title=title or f"KVCache: {B} sequence(s), S_max = {cap}, seq_lens = {lens}")
    for b, n in enumerate(lens):
        y = height - 0.45 - (b + 1) * (SIZE + 0.15)
        label(ax, 0.1, y + SIZE / 2, f"sequence {b}", fontsize=8)
        _row(ax, 1.5, y, cap, n, None if not news[b] else n - news[b])
    _legend(ax, 0.1, 0.1)
    return fig


def filling(rec, b: int = 0, *, title: str | None = None):
    """The cache after each forward pass the recorder saw (sequence ``b``): the first is the prefill, the
    others decode steps. The last row is the live cache's state."""
    if not rec.calls:
        raise ValueError("the recorder has seen no call: run the model with cache=recorder first")
    last_start, last_T = rec.calls[-1]
    if last_start[b] + last_T != rec.cache.held(b):
        raise ValueError("the cache changed since the recorder's last call (reset or truncate?): record again")
    cap, n = rec.cache.max_len, len(rec.calls)
    width, height = 2.2 + cap * SIZE + 0.3, 1.0 + n * (SIZE + 0.12)
    fig, ax = new_figure(max(width, 7.5), height, title=title or f"The cache filling, sequence {b} (S_max = {cap})")
    for i, (start, T) in enumerate(rec.calls):
        y = height - 0.5 - (i + 1) * (SIZE + 0.12)
        what = f"prefill, T={T}" if i == 0 else f"decode step {i}" if T == 1 else f"call {i}, T={T}"
        label(ax, 0.1, y + SIZE / 2, what, fontsize=8)
        _row(ax, 2.1, y, cap, start[b] + T, start[b])
        label(ax, 2.2 + cap * SIZE, y + SIZE / 2, f"{start[b] + T}", fontsize=7)
    _legend(ax, 0.1, 0.1)
    return fig


def _scores(ax, x, y, start, T, size):
    """The T x L scores this call computes (L = start + T): query row t sees keys 0 .. start + t."""
    L = start + T
    for t in range(T):
        cells(ax, x, y - t * size, ["query" if s <= start + t else "masked" for s in range(L)], size=size)


def prefill_vs_decode(rec, b: int = 0):
    """The recorder's first call (prefill) beside its last (a decode step): what each writes into the
    cache (framed) and the block of attention scores each computes (masked cells: the causal mask)."""
    import matplotlib.pyplot as plt

    if len(rec.calls) < 2 or rec.calls[-1][1] != 1:
        raise ValueError("record a prefill and at least one decode step first")
    cap, size = rec.cache.max_len, 0.24
    (s0, T0), (s1, T1) = rec.calls[0], rec.calls[-1]
    h = 1.3 + (T0 + 1) * size
    fig, axes = plt.subplots(1, 2, figsize=(max(10.0, 2 * (cap * size + 0.6)), h))
    kinds = (("prefill", "rows written at once", "a matrix-matrix product"),
             ("decode step", "row written", "one row: a matrix-vector product"))
    for ax, (start, T), (name, rows, what) in zip(axes, ((s0[b], T0), (s1[b], T1)), kinds):
        ax.set_xlim(0, cap * size + 0.6)
        ax.set_ylim(0, h)
        ax.set_aspect("equal")
        ax.axis("off")
        L = start + T
        ax.set_title(f"{name}: {T} {rows}\n{T} x {L} scores, {what}", fontsize=9)
        _row(ax, 0.3, h - 0.75, cap, L, start, size=size)
        label(ax, 0.3, h - 0.9, "query rows x cached keys:", fontsize=7)
        _scores(ax, 0.3, h - 1.0 - size, start, T, size)
    return fig


def kernel_splits(seq_len: int, num_splits: int) -> list[tuple[int, int]]:
    """The positions [start, end) of each split, as ``kvlib.cache._decode_kernel`` cuts them: splits of
    ceil(ceil(seq_len / num_splits) / 16) * 16 positions (a whole number of 16-position tiles), the
    last ones shorter or empty (start == end)."""
    if seq_len < 1 or num_splits < 1:
        raise ValueError(f"seq_len and num_splits must be >= 1, got {seq_len}, {num_splits}")
    per_split = -(-seq_len // num_splits)  # ceil(seq_len / num_splits)
    split_len = -(-per_split // 16) * 16  # rounded up to whole 16-position tiles
    return [(min(seq_len, s * split_len), min(seq_len, (s + 1) * split_len)) for s in range(num_splits)]


def split_k(seq_len: int, num_splits: int, lse=None, *, title: str | None = None):
    """The positions of one (sequence, query head) cut into ``kernel_splits``; under each split its partial
    output o_s and log-sum-exp lse_s, then their merge. ``lse``: the splits' log-sum-exp values, if
    computed (their weights in the merge are printed); an empty split has none (lse = -inf)."""
    from matplotlib.patches import Rectangle

    ranges = kernel_splits(seq_len, num_splits)
    width = 10.0
    cell = (width - 1.0) / seq_len
    fig, ax = new_figure(width, 3.4, title=title or f"split-K: {seq_len} positions, {num_splits} splits")
    weights = None
    if lse is not None:
        import math

        vals = [float(x) for x in lse]
        top = max(v for v in vals if v != float("-inf"))
        w = [0.0 if v == float("-inf") else math.exp(v - top) for v in vals]
        weights = [x / sum(w) for x in w]
    for i, (a, e) in enumerate(ranges):
        color = SPLIT_COLORS[i % len(SPLIT_COLORS)]
        for p in range(a, e):
            ax.add_patch(Rectangle((0.5 + p * cell, 2.6), cell, 0.3, facecolor=color, edgecolor="white",
                                   linewidth=0.3, gid="position", label=f"split {i}"))
        cx = 0.5 + (i + 0.5) * (width - 1.0) / num_splits
        if e > a:
            label(ax, 0.5 + (a + e) / 2 * cell, 3.05, f"{a}-{e - 1}", ha="center", fontsize=7)
            arrow(ax, 0.5 + (a + e) / 2 * cell, 2.55, cx, 1.95)
            text = f"split {i}: o_{i}, lse_{i}" + ("" if weights is None else f"\nweight {weights[i]:.2f}")
        else:
            text = f"split {i}: empty\nlse = -inf"
        label(ax, cx, 1.7, text, ha="center", fontsize=8, color=color)
        arrow(ax, cx, 1.4, width / 2, 0.75)
    label(ax, width / 2, 0.45, "o = sum_s w_s o_s / sum_s w_s,   w_s = exp(lse_s - max lse)", ha="center",
          fontsize=9, bbox=dict(boxstyle="round", facecolor="#F5F5F5", edgecolor=COLORS["text"]))
    return fig
