"""Chapter 08's diagrams, drawn from the serving engine's real state.

- ``step(view)``: one engine step as the forward sees it. ``view`` is what ``kvlib.course.ch08.replay(...,
  record=True)`` noted when the engine built the step's ragged batch (``engine.cache.ragged``): the requests in the
  forward, how many tokens each brought, where they start, the slots they write, every running request's block
  table. Top: the one forward's row of tokens, laid end to end (gid ``"prefill"`` or ``"decode"`` per token,
  ``"sampled"`` over each position whose logits draw a token). Bottom: the pool, one cell per block (gid
  ``"touched"``: a block this step writes into; ``"held"``: held by a running request, not written this step;
  ``"cached"``: kept for the prefix cache, no holder; ``"free"``).
- ``timelines(panels)``: continuous vs static batching from the same trace, one row per request and one column per
  engine step (the image's values are ``ch08``'s WAIT/PREFILL/DECODE/IDLE/PREEMPT codes).
- ``prefix_blocks(prompts, cached_tokens, block_size)``: the prompts' full blocks as their chained hashes (chapter
  05): a hash gets a number the first time it is seen, so a number repeated down a column is one shared block; gid
  ``"hit"`` for a block found in the cache at admission, ``"computed"`` for one the request computed, ``"tail"`` for
  the last, partial block (never shared).
"""

from __future__ import annotations

from . import COLORS, label, new_figure

__all__ = ["step", "timelines", "prefix_blocks", "KIND_COLORS", "REQ_COLORS"]

KIND_COLORS = ["white", "lightgrey", "C0", "C1", "khaki", "red"]  # 0 .. 5: absent, WAIT, PREFILL, DECODE, IDLE, PREEMPT
KIND_LABELS = ["waiting", "prefill", "decode", "done, row still decoding", "preempted"]
REQ_COLORS = ["#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD", "#2F4F4F",
              "#B8860B"]  # one per request; not the roles' blue and orange
ROLE = {"prefill": "#4C72B0", "decode": "#DD8452"}  # the timeline's C0 / C1


def _rect(ax, x, y, w, h, face, gid, *, edge="white", lw=0.8, hatch=None):
    from matplotlib.patches import Rectangle

    p = Rectangle((x, y), w, h, facecolor=face, edgecolor=edge, linewidth=lw, gid=gid, hatch=hatch)
    ax.add_patch(p)
    return p


def step(view, *, title: str | None = None, blocks_per_row: int = 40):
    """One engine step (see the module docstring). Returns the figure."""
    from matplotlib.patches import Polygon

    ids, counts, starts = view["seq_ids"], view["counts"], view["start"]
    bs, nb = view["block_size"], view["num_blocks"]
    color = {rid: REQ_COLORS[rid % len(REQ_COLORS)] for rid in view["held"]}
    n_tokens = sum(counts)
    width = 13.0
    cell = min(0.3, (width - 1.6) / max(n_tokens, 1))
    bcell = min(0.3, (width - 1.6) / blocks_per_row)
    rows = -(-nb // blocks_per_row)
    height = 2.1 + rows * (bcell + 0.08)
    fig, ax = new_figure(width, height, title=title or (
        f"Engine step {view['step']}: one forward over {n_tokens} tokens of {len(ids)} requests; "
        f"{sum(d for d in view['decode'])} decode, {sum(not d for d in view['decode'])} prefill chunk(s)"))
    top = height - 1.0
    label(ax, 0.1, top + cell + 0.45, "the one forward: every token of the step, end to end (bar under it: whose)",
          fontsize=8)
    x = 1.4
    for rid, n, dec, start, smp in zip(ids, counts, view["decode"], starts, view["samples"]):
        role = "decode" if dec else "prefill"
        for k in range(n):
            _rect(ax, x + k * cell, top, cell, cell, ROLE[role], role)
        _rect(ax, x, top - 0.12, n * cell, 0.08, color[rid], "owner", edge="none")  # whose tokens these are
        label(ax, x + n * cell / 2, top - 0.3, f"r{rid}" + ("" if dec else f" {start}..{start + n - 1}"), ha="center",
              fontsize=7)
        if smp:  # the output head runs on this request's last position
            cx = x + (n - 0.5) * cell
            ax.add_patch(Polygon([(cx - cell * 0.35, top + cell + 0.05), (cx + cell * 0.35, top + cell + 0.05),
                                  (cx, top + cell + 0.25)], closed=True, facecolor=COLORS["new"], gid="sampled"))
        x += n * cell
    label(ax, 0.1, top + cell / 2, "tokens", fontsize=8)
    touched = {}
    for s in view["slots"]:
        touched.setdefault(s // bs, None)
    writer = {}
    for rid, table in view["held"].items():
        for b in table:
            writer.setdefault(b, rid)
    slot_i = 0
    for rid, n in zip(ids, counts):  # a written block belongs to the request that writes it
        for s in view["slots"][slot_i: slot_i + n]:
            touched[s // bs] = rid
        slot_i += n
    cached = set(view["cached"])
    y0 = top - 0.75 - bcell
    label(ax, 0.1, y0 + bcell + 0.2, "the pool (one cell per block; number: the request that holds it)", fontsize=8)
    for b in range(nb):
        r, c = divmod(b, blocks_per_row)
        bx, by = 1.4 + c * bcell, y0 - r * (bcell + 0.08)
        if b in touched:
            _rect(ax, bx, by, bcell, bcell, color[touched[b]], "touched", edge="black", lw=1.0)
            ax.text(bx + bcell / 2, by + bcell / 2, str(touched[b]), ha="center", va="center", fontsize=5.5,
                    color="white")
        elif b in writer:
            _rect(ax, bx, by, bcell, bcell, color[writer[b]], "held", hatch="////", lw=0.5)
            ax.text(bx + bcell / 2, by + bcell / 2, str(writer[b]), ha="center", va="center", fontsize=5.5)
        elif b in cached:
            _rect(ax, bx, by, bcell, bcell, COLORS["masked"], "cached", edge="0.6", lw=0.5)
        else:
            _rect(ax, bx, by, bcell, bcell, "white", "free", edge="0.75", lw=0.5)
    label(ax, 0.1, 0.12, "blue: a prefill chunk's tokens, orange: a decode token, red triangle: the output head draws "
          "a token there; pool: framed = written this step, hatched = held, not written; grey = cached; white = free",
          fontsize=7)
    return fig


def timelines(panels, *, width=None):
    """One panel per (grid, title): rows are requests (arrival order), columns engine steps; colours as in
    KIND_LABELS. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    cmap = ListedColormap(KIND_COLORS)
    width = width or max(g.shape[1] for g, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 3.6 * len(panels)), squeeze=False)
    for ax, (grid, title) in zip(axes[:, 0], panels):
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=5, aspect="auto", interpolation="nearest")
        ax.set(xlabel="engine step", ylabel="request (arrival order)", title=title, xlim=(-0.5, width - 0.5))
    fig.legend(handles=[Patch(color=c, label=lab) for c, lab in zip(KIND_COLORS[1:], KIND_LABELS)],
               loc="lower center", fontsize=9, ncol=5)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def prefix_blocks(prompts, cached_tokens, block_size, *, names=None, title=None):
    """The prompts' blocks as chained hashes, hits and computed (see the module docstring). ``cached_tokens``: per
    prompt, the positions the engine served from its prefix cache at admission. Returns the figure."""
    from ...paged import chained_block_hashes

    numbers, first_prompt = {}, {}
    rows = []
    for i, p in enumerate(prompts):
        full = len(p) // block_size
        hashes = chained_block_hashes(p, block_size, full)
        for h in hashes:
            if h not in numbers:
                numbers[h], first_prompt[h] = len(numbers), i
        rows.append((hashes, len(p) % block_size > 0 or full == 0))
    longest = max(len(h) + t for h, t in rows)
    cell = min(0.42, 11.0 / longest)
    height = 0.5 + len(prompts) * (cell + 0.1) + 0.5
    fig, ax = new_figure(13.0, height, title=title or "Each prompt's blocks by chained hash: one number per distinct prefix block")
    for i, (hashes, tail) in enumerate(rows):
        y = height - 0.5 - (i + 1) * (cell + 0.1)
        label(ax, 0.05, y + cell / 2, names[i] if names else f"request {i}", fontsize=7)
        hits = min(cached_tokens[i] // block_size, len(hashes))
        for j, h in enumerate(hashes):
            kind = "hit" if j < hits else "computed"
            face = REQ_COLORS[first_prompt[h] % len(REQ_COLORS)] if kind == "hit" else "white"
            _rect(ax, 1.6 + j * cell, y, cell, cell, face, kind, edge="0.3" if kind == "hit" else "0.6", lw=0.6)
            ax.text(1.6 + (j + 0.5) * cell, y + cell / 2, str(numbers[h]), ha="center", va="center", fontsize=6,
                    color="white" if kind == "hit" else COLORS["text"])
        if tail:
            j = len(hashes)
            _rect(ax, 1.6 + j * cell, y, cell, cell, COLORS["empty"], "tail", edge="0.6", lw=0.6, hatch="..")
    label(ax, 0.05, 0.2, "filled: found in the prefix cache at admission (coloured by the request that first computed "
          "it); white: computed by this request; dotted: the last, partial block (never shared)", fontsize=7)
    return fig
