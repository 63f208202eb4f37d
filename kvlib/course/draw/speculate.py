"""Chapter 11a's picture, drawn from a live verification step (``kvlib.course.ch11a.capture_step``).

``verification(trace, tok=None, context=6)`` draws four rows over the last positions of the sequence:

1. **fed**: the tokens of the one verification forward: the last emitted token, then the drafts;
2. **target's choice**: the target's argmax at each of those rows; a draft it agrees with is *accepted*, the first
   it disagrees with is *rejected* (the target's own token replaces it there), drafts after it are *unchecked*;
3. **cache after the forward**: the rows it held before the step and the rows the forward *wrote*;
4. **cache after truncate**: the rows it *holds* now (read from ``cache.seq_lens``), and the *rolled-back* rows:
   written by the forward, now past the cache's length.

Gids: ``"held"`` (row 4's kept rows, and row 3's old ones), ``"written"`` (row 3's new rows), ``"accepted"``,
``"rejected"``, ``"unchecked"`` (row 2), ``"rolled"`` (row 4's cut rows), ``"fed"`` (row 1), so a test can count
them against the cache: ``cells_with(fig, "rolled") == trace.written - int(trace.cache.seq_lens[0])``.
"""

from __future__ import annotations

from . import COLORS, label, new_figure

__all__ = ["PALETTE", "verification"]

PALETTE = {"fed": COLORS["query"], "held": COLORS["filled"], "written": COLORS["new"], "accepted": COLORS["value"],
           "rejected": COLORS["new"], "unchecked": COLORS["masked"], "rolled": COLORS["empty"]}
SIZE = 0.62  # inches per cell
LEFT = 2.3  # room for the row labels


def _cell(ax, x, y, kind, text=""):
    from matplotlib.patches import Rectangle

    hatch = "////" if kind == "rolled" else None
    ax.add_patch(Rectangle((x, y), SIZE, SIZE, facecolor=PALETTE[kind], edgecolor="white" if not hatch else
                           COLORS["new"], linewidth=1.0, hatch=hatch, gid=kind))
    if text:
        dark = kind not in ("rolled", "unchecked")
        label(ax, x + SIZE / 2, y + SIZE / 2, text, ha="center", fontsize=6.5,
              color="white" if dark else COLORS["text"])


def _short(tok, t) -> str:
    if tok is None:
        return str(t)
    s = tok.decode([t]).replace("\n", "\\n")
    return s if len(s) <= 7 else s[:6] + "…"


def verification(trace, tok=None, context: int = 6, title: str | None = None):
    """The picture of one verification step (see the module docstring). ``tok``: a tokenizer to write tokens as text
    (ids otherwise); ``context``: how many positions before the step to show. Returns the Figure."""
    n0, fed, target, a = trace.n0, list(trace.fed), list(trace.target), int(trace.accepted)
    held_now = int(trace.cache.seq_lens[0])  # read from the live cache
    d = len(fed) - 1
    first = max(0, n0 - context)
    cols = trace.written - first
    width, height = LEFT + cols * SIZE + 0.5, 4 * (SIZE + 0.35) + 1.0
    fig, ax = new_figure(width, height, title=title)
    ys = [height - 0.9 - r * (SIZE + 0.35) for r in range(4)]
    names = ["fed to one forward", "target's choice", "cache after the forward", "cache after truncate"]
    for y, name in zip(ys, names):
        label(ax, LEFT - 0.12, y + SIZE / 2, name, ha="right", fontsize=8)
    tokens = list(trace.tokens)
    for j, pos in enumerate(range(first, trace.written)):
        x = LEFT + j * SIZE
        i = pos - n0  # the row of the verification forward, 0..d
        if i >= 0:
            _cell(ax, x, ys[0], "fed", _short(tok, fed[i]))
            kind = "accepted" if i < a else "rejected" if i == a else "unchecked"
            if i == d and a == d:
                kind = "accepted"  # every draft taken: this row's choice is the bonus token
            _cell(ax, x, ys[1], kind, _short(tok, target[i]))
        text = _short(tok, tokens[pos]) if pos < len(tokens) else _short(tok, fed[i])
        _cell(ax, x, ys[2], "held" if pos < n0 else "written", text)
        _cell(ax, x, ys[3], "held" if pos < held_now else "rolled", text if pos < held_now else "")
        if j % 2 == 0 or pos == n0:
            label(ax, x + SIZE / 2, ys[3] - 0.18, str(pos), ha="center", fontsize=6)
    label(ax, LEFT, 0.25, f"positions {first}–{trace.written - 1}; {a} of {d} drafts accepted; the cache keeps "
          f"{held_now} positions (hatched: written, then rolled back)", fontsize=7.5)
    return fig
