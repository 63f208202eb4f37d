"""Chapter 02's diagram: what a generation loop computes at each step, drawn from what it really computed.

``recomputed(trace)`` takes a :class:`kvlib.course.ch02.NaiveTrace` (a loop run with a counter on a key
projection: how many K/V rows each step computed, and the sequence length at that step) and draws one row
per step, one cell per position the step computed K/V for:

- ``"new"``: the position's K/V computed for the first time (the prompt at the first step, then the one
  token the previous step produced);
- ``"filled"``: K/V computed again for a position an earlier step already computed: the waste;
- ``"empty"``: a position that exists but this step did not compute (a loop with a cache, chapter 03).

For the naive loop the rows form a triangle: every step recomputes the whole prefix. ``tests/test_draw_decoding.py``
checks that the figure's "filled" cells equal the rows the loop recomputed (``trace.recomputed``) and its
"new" cells the positions that ever needed K/V (``trace.needed``).
"""

from __future__ import annotations

from matplotlib.patches import Rectangle

from . import COLORS, cells, label, new_figure

__all__ = ["recomputed", "MAX_STEPS", "MAX_POSITIONS"]

MAX_STEPS = 16  # rows a readable picture holds
MAX_POSITIONS = 40  # cells per row a readable picture holds


def _char(decode, token: int) -> str:
    if decode is None:
        return str(token)
    s = decode([token])
    return {" ": "␣", "\n": "↵", "\t": "⇥"}.get(s, s if s.isprintable() and len(s) == 1 else "·")


def recomputed(trace, *, decode=None, title: str | None = None):
    """One row per step of ``trace``, one cell per position whose K/V the step computed (new or again).

    decode: optional ``tokenizer.decode``, to write each position's token in its cell. Returns the Figure.
    Raises ValueError for a trace too large to draw readably (more than MAX_STEPS steps or MAX_POSITIONS
    positions): draw a shorter run; the counts hold at any size.
    """
    steps, width_pos = len(trace.rows), max(trace.lengths) if trace.lengths else 0
    if steps < 1:
        raise ValueError("recomputed: the trace has no steps")
    if steps > MAX_STEPS or width_pos > MAX_POSITIONS:
        raise ValueError(f"recomputed: {steps} steps over {width_pos} positions is too many to draw; draw at most "
                         f"{MAX_STEPS} steps and {MAX_POSITIONS} positions (the counts hold at any size)")
    size = min(0.34, 9.0 / width_pos)
    left, top, bottom = 1.0, 0.35, 1.25
    width = max(7.5, left + width_pos * size + 3.3)
    height = top + steps * (size + 0.06) + bottom
    fig, ax = new_figure(width, height)
    seen: set[int] = set()
    n_new = n_again = 0
    for i, (length, r) in enumerate(zip(trace.lengths, trace.rows)):
        y = height - top - (i + 1) * (size + 0.06)
        kinds = []
        for p in range(length):
            if p < length - r:
                kinds.append("empty")  # exists, not computed this step
            else:
                kinds.append("filled" if p in seen else "new")
                seen.add(p)
        n_new += kinds.count("new")
        n_again += kinds.count("filled")
        texts = [_char(decode, trace.tokens[p]) for p in range(length)] if size >= 0.25 else None
        cells(ax, left, y, kinds, size=size, texts=texts, fontsize=7)
        label(ax, left - 0.1, y + size / 2, f"step {i}", ha="right", fontsize=8)
        produced = f" → {_char(decode, trace.tokens[length])}" if length < len(trace.tokens) else ""
        label(ax, left + length * size + 0.1, y + size / 2,
              f"{r} computed, {kinds.count('filled')} again{produced}", fontsize=7)
    legend = [("new", "K/V computed for the first time"),
              ("filled", "K/V computed again (already computed by an earlier step)")]
    if any(length > r for length, r in zip(trace.lengths, trace.rows)):
        legend.append(("empty", "not computed at this step (kept from an earlier one)"))
    for row, (kind, text) in enumerate(legend):
        ly = 0.1 + (len(legend) - 1 - row) * 0.3
        ax.add_patch(Rectangle((left, ly), 0.2, 0.2, facecolor=COLORS[kind], edgecolor="white"))  # no gid: not counted
        label(ax, left + 0.28, ly + 0.1, text, fontsize=8)
    ax.set_title(title or f"What the loop computes: prompt of {trace.prompt_len} tokens, {steps} steps\n"
                 f"K/V rows per layer and head: {n_new + n_again} computed, {n_new} needed, {n_again} again",
                 fontsize=10)
    return fig
