"""Chapter 05's diagrams, drawn from the live paged cache and from the pool simulator's record.

- ``pool(cache)``: every sequence's block table (one cell per entry, the physical block id written in it) and
  the pool under it, block by block and slot by slot, with an arrow from each table entry to its block. A slot
  that holds a token is ``"filled"``; a slot of a taken block that holds nothing yet is ``"empty"``; every
  slot of a free block is ``"free"``. A block held by more than one table (reference count > 1, after a
  fork or a prefix-cache hit) carries a ``"shared"`` frame and its count; ``new`` (slot ids, e.g. the
  ``slots`` a ``cache.batch(...)`` view wrote) frames the slots the last call wrote (``"new"``).
- ``sim_moments(run, fracs)``, ``sim_timeline(run)``: the simulator's ``record=True`` snapshots (which
  request owns each block, per iteration) at a few moments, and the whole run as one picture (iteration
  across, block id down), the static companion of a slider.

Every table entry and slot is a patch with a gid (``"table"``, ``"filled"``, ``"empty"``, ``"free"``,
``"shared"``, ``"new"``), so a test counts what a figure shows and compares it with the cache
(``cells_with(fig, "filled")`` = the slots holding tokens, ``cells_with(fig, "table")`` = the table entries).
"""

from __future__ import annotations

from . import COLORS, label, new_figure

__all__ = ["pool", "filled_slots", "SEQ_COLORS", "sim_snapshot", "sim_moments", "sim_timeline"]

# one colour per sequence (matplotlib's tab10 without its grey), repeated past ten
SEQ_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf"]
FREE = "#FFFFFF"  # a free block's slots


def filled_slots(cache) -> dict[int, set[int]]:
    """{block id: the offsets in it that hold a token of some sequence}: position p of a sequence of length L
    (p < L) lives in block table[p // block_size] at offset p % block_size. A shared block counts once."""
    bs, out = cache.block_size, {}
    for s, table in cache.tables.items():
        for p in range(cache.lens[s]):
            out.setdefault(table[p // bs], set()).add(p % bs)
    return out


def _rect(ax, x, y, w, h, face, gid, *, edge="white", lw=0.8):
    from matplotlib.patches import Rectangle

    p = Rectangle((x, y), w, h, facecolor=face, edgecolor=edge, linewidth=lw, gid=gid)
    ax.add_patch(p)
    return p


def pool(cache, new=None, *, title: str | None = None, blocks_per_row: int | None = None, colors=None):
    """The block tables of ``cache`` above its pool (see the module docstring). ``new``: slot ids written by the
    last call (block * block_size + offset), framed in red. ``colors``: {sequence id: colour}, to keep a
    sequence's colour from one drawing to the next (default: SEQ_COLORS in table order). Returns the figure."""
    bs, nb = cache.block_size, cache.allocator.num_blocks
    refcount = cache.allocator.refcount
    seqs = list(cache.tables)
    color = {s: SEQ_COLORS[i % len(SEQ_COLORS)] for i, s in enumerate(seqs)} | dict(colors or {})
    owners = {}
    for s in seqs:
        for b in cache.tables[s]:
            owners.setdefault(b, []).append(s)
    filled = filled_slots(cache)
    new = set() if new is None else {int(x) for x in new}
    per_row = blocks_per_row or max(1, min(nb, 48 // bs if bs <= 16 else 2))
    cell = min(0.32, 11.0 / (per_row * (bs + 0.8)))  # inches per slot
    bw = bs * cell  # a block's width
    gap = 0.8 * cell
    n_rows = -(-nb // per_row)
    longest = max([len(t) for t in cache.tables.values()] + [1])
    tcell = max(cell, 0.3)
    width = max(7.5, 1.2 + per_row * (bw + gap), 1.4 + longest * tcell)
    table_h = len(seqs) * (tcell + 0.12)
    pool_h = n_rows * (cell + 0.42)
    height = 0.75 + table_h + 0.55 + pool_h + 0.35
    fig, ax = new_figure(width, height, title=title or (
        f"PagedKVCache: {nb} blocks of {bs} slots, {cache.allocator.num_free} free; "
        f"lens = {dict(cache.lens)}"))

    def block_xy(b):
        r, c = divmod(b, per_row)
        return 0.3 + c * (bw + gap), 0.4 + (n_rows - 1 - r) * (cell + 0.42)

    top = height - 0.55
    for i, s in enumerate(seqs):  # the block tables
        y = top - (i + 1) * (tcell + 0.12)
        label(ax, 0.1, y + tcell / 2, f"{s!s}: table", fontsize=8)
        for j, b in enumerate(cache.tables[s]):
            x = 1.2 + j * tcell
            _rect(ax, x, y, tcell, tcell, color[s], "table")
            ax.text(x + tcell / 2, y + tcell / 2, str(b), ha="center", va="center", fontsize=7, color="white")
            bx, by = block_xy(b)
            ax.annotate("", xy=(bx + bw / 2, by + cell + 0.3), xytext=(x + tcell / 2, y),
                        arrowprops=dict(arrowstyle="->", color=color[s], lw=0.6, alpha=0.6))
    for b in range(nb):  # the pool
        x, y = block_xy(b)
        held = owners.get(b, [])
        for o in range(bs):
            if not held:
                _rect(ax, x + o * cell, y, cell, cell, FREE, "free", edge="0.75", lw=0.5)
            elif o in filled.get(b, ()):
                _rect(ax, x + o * cell, y, cell, cell, color[held[0]], "filled")
            else:
                _rect(ax, x + o * cell, y, cell, cell, COLORS["empty"], "empty", edge="0.75", lw=0.5)
            if b * bs + o in new:
                _rect(ax, x + o * cell + 0.03 * cell, y + 0.03 * cell, 0.94 * cell, 0.94 * cell, "none", "new",
                      edge=COLORS["new"], lw=1.8)
        if refcount[b] > 1:
            _rect(ax, x - 0.04, y - 0.04, bw + 0.08, cell + 0.08, "none", "shared", edge="black", lw=2.0)
        who = ",".join(map(str, held)) if held else "free"
        ref = f" ref {refcount[b]}" if held else ""
        label(ax, x + bw / 2, y + cell + 0.15, f"{b}: {who}{ref}", ha="center", fontsize=6.5)
    label(ax, 0.1, 0.15, "pool (block id: holders, reference count); a coloured slot holds a token, "
          "grey: taken, not written; white: free" + ("; black frame: shared" if any(r > 1 for r in refcount) else "")
          + ("; red frame: written by the last call" if new else ""), fontsize=7.5)
    return fig


# --------------------------------------------------------------------------------------------
# The simulator's record (kvlib.pool_sim.simulate(..., record=True))
# --------------------------------------------------------------------------------------------


def _req_cmap():
    """18 colours (tab20 without its greys), reordered so that requests k and k + 1 differ in hue; free: white."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    tab20 = [c for i, c in enumerate(plt.get_cmap("tab20").colors) if i not in (14, 15)]
    return ListedColormap(tab20[0::2] + tab20[1::2]).with_extremes(under="white", bad="none")


def sim_snapshot(run, step: int, ax, cols: int = 16):
    """The pool at iteration ``step`` of a recorded run: one cell per block, labelled with its request's id."""
    import numpy as np

    cmap = _req_cmap()
    snap = np.array(run.snapshots[step])
    rows = -(-len(snap) // cols)
    grid = np.full(rows * cols, np.nan)  # a last row the pool does not fill stays blank
    grid[: len(snap)] = np.where(snap < 0, -1, snap % cmap.N)
    grid = np.ma.masked_invalid(grid.reshape(rows, cols))
    ax.pcolormesh(grid, cmap=cmap, vmin=0, vmax=cmap.N - 1, edgecolors="0.6", linewidth=0.3)
    for b, rid in enumerate(snap):
        if rid >= 0:
            ax.text(b % cols + 0.5, b // cols + 0.5, str(rid), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, cols)
    ax.set_ylim(grid.shape[0], 0)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_aspect("equal")
    ax.set_title(f"iteration {step}: {int((snap >= 0).sum())} of {len(snap)} blocks in use, "
                 f"{len(set(snap[snap >= 0].tolist()))} requests", fontsize=9)


def sim_moments(run, fracs=(0.1, 0.35, 0.6, 0.85), *, title: str = ""):
    """Four moments of a recorded run (fractions of its iterations), two by two."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 6.4), layout="constrained")
    for ax, frac in zip(axes.flat, fracs):
        sim_snapshot(run, int(frac * (len(run.snapshots) - 1)), ax)
    fig.suptitle(title, fontsize=10)
    return fig


def sim_timeline(run, *, title: str = ""):
    """The whole recorded run in one picture: iteration across, block id down, each block coloured by the request
    that owns it (white: free). A request's band grows as it generates, ends when it finishes, and vanishes and
    reappears elsewhere when it is preempted and admitted again."""
    import matplotlib.pyplot as plt
    import numpy as np

    cmap = _req_cmap()
    snaps = np.array(run.snapshots)  # (iterations, blocks)
    grid = np.where(snaps < 0, -1, snaps % cmap.N).T  # (blocks, iterations)
    fig, ax = plt.subplots(figsize=(12, 3.6))
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=cmap.N - 1, aspect="auto", interpolation="nearest")
    used = (snaps >= 0).sum(1)
    ax2 = ax.twinx()
    ax2.plot(used, color="black", lw=1.0, label="blocks in use")
    ax2.set_ylim(0, snaps.shape[1] * 1.05)
    ax2.set_ylabel("blocks in use (line)")
    ax.set(xlabel="iteration", ylabel="block id", title=title)
    return fig
