"""Chapter 07's diagrams, drawn from a live config: which query head reads which K/V head, and what each
decode schedule loads.

- ``head_counts(config)``: (H, H_KV) of a kvlib ``ModelConfig`` (``n_heads``, ``n_kv_heads``), a ``Transformer``
  (its ``.config``) or a ``transformers`` config (``num_attention_heads``, ``num_key_value_heads``; without the
  second the model is MHA, as transformers reads it).
- ``head_map(config)``: the H query heads (cells ``"query"``) below the H_KV K/V heads (cells ``"kv"``), one line
  (gid ``"read"``) from each query head to the K/V head it reads, h // (H / H_KV): consecutive groups.
- ``schedules(config)``: three panels, one per way of computing a decode step over a GQA cache, one row per
  program: the K/V heads it loads from the cache (``"load"``), the copies repeat-K/V writes (``"copy"``), the
  query heads it computes (``"query"``). ``panel_counts(fig, gid)`` counts each panel's cells of one kind.

Every cell and line carries a gid, so a test can recover the mapping and the loads from the figure and compare
them with the config's real head counts.
"""

from __future__ import annotations

from . import COLORS, label

__all__ = ["head_counts", "head_map", "schedules", "panel_counts", "GROUP_COLORS"]

GROUP_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
KINDS = {"query": COLORS["query"], "kv": COLORS["key"], "load": COLORS["key"], "copy": COLORS["new"]}


def head_counts(config) -> tuple[int, int]:
    """(query heads H, K/V heads H_KV) of a kvlib config or model, or of a transformers config."""
    config = getattr(config, "config", config)  # a Transformer: its ModelConfig
    if hasattr(config, "n_heads"):
        H, H_KV = int(config.n_heads), int(config.n_kv_heads)
    else:
        H = int(config.num_attention_heads)
        H_KV = int(getattr(config, "num_key_value_heads", None) or H)
    if H_KV < 1 or H % H_KV:
        raise ValueError(f"the K/V heads ({H_KV}) must divide the query heads ({H})")
    return H, H_KV


def _cell(ax, x, y, size, gid, text="", color=None):
    from matplotlib.patches import Rectangle

    p = Rectangle((x, y), size, size, facecolor=color or KINDS[gid], edgecolor="white", linewidth=1.0, gid=gid)
    ax.add_patch(p)
    if text != "":
        ax.text(x + size / 2, y + size / 2, str(text), ha="center", va="center", fontsize=7, color="white")
    return p


def _axes(ax, width, height):
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_aspect("equal")
    ax.axis("off")


def head_map(config, *, title: str | None = None):
    """Query heads (bottom row, coloured by group) and the K/V heads they read (top row), one line per query head."""
    import matplotlib.pyplot as plt

    H, H_KV = head_counts(config)
    n_rep = H // H_KV
    size = min(0.45, 10.0 / (H + H_KV))
    gap = size * 0.6  # between groups
    width = round(0.6 + H * size * 1.1 + H_KV * gap + 1.2, 1)  # whole pixels at any dpi that is a multiple of 10
    fig, ax = plt.subplots(figsize=(width, 2.6))
    _axes(ax, width, 2.6)
    qx = [0.6 + h * size * 1.1 + (h // n_rep) * gap for h in range(H)]
    y_q, y_kv = 0.45, 1.75
    for h, x in enumerate(qx):
        _cell(ax, x, y_q, size, "query", f"q{h}", GROUP_COLORS[(h // n_rep) % len(GROUP_COLORS)])
    for j in range(H_KV):
        members = qx[j * n_rep: (j + 1) * n_rep]
        x = (members[0] + members[-1]) / 2
        _cell(ax, x, y_kv, size, "kv", f"kv{j}", GROUP_COLORS[j % len(GROUP_COLORS)])
        label(ax, x + size / 2, y_q - 0.18, f"group {j}", ha="center", fontsize=7)
    for h, x in enumerate(qx):
        j = h // n_rep
        kx = (qx[j * n_rep] + qx[(j + 1) * n_rep - 1]) / 2
        ax.plot([x + size / 2, kx + size / 2], [y_q + size, y_kv], color=GROUP_COLORS[j % len(GROUP_COLORS)],
                linewidth=1.2, gid="read")
    label(ax, 0.05, y_q + size / 2, "query\nheads", fontsize=8)
    label(ax, 0.05, y_kv + size / 2, "K/V\nheads", fontsize=8)
    ax.set_title(title or f"{H} query heads share {H_KV} K/V heads: query head h reads K/V head h // {n_rep}",
                 fontsize=10)
    fig.tight_layout()
    return fig


def _program_row(ax, y, size, loads, copies, queries, n_rep):
    """One program: the K/V heads it loads, the copies it writes, the query heads it computes."""
    x = 0.1
    for text in loads:
        _cell(ax, x, y, size, "load", text, KINDS["copy"] if text.startswith("c") else None)
        x += size * 1.1
    x = max(x, 0.1 + size * 1.1) + size * 0.4
    for h in copies:
        _cell(ax, x, y, size, "copy", f"c{h}")
        x += size * 1.1
    if queries:
        label(ax, x + 0.05, y + size / 2, "→", fontsize=9)
        x += size * 0.9
    for h in queries:
        _cell(ax, x, y, size, "query", f"q{h}", GROUP_COLORS[(h // n_rep) % len(GROUP_COLORS)])
        x += size * 1.1
    return x


def schedules(config):
    """One panel per decode schedule; in each, one row per program (what it loads, writes and computes)."""
    import matplotlib.pyplot as plt

    H, H_KV = head_counts(config)
    n_rep = H // H_KV
    plans = {  # schedule -> rows of (K/V heads loaded, copies written, query heads computed)
        # first a copy: every K/V head read once, H copies written (copy h holds K/V head h // n_rep) ...
        "repeat K/V, then\nchapter 03's kernel": [([f"kv{j}" for j in range(H_KV)], list(range(H)), [])]
        + [([f"c{h}"], [], [h]) for h in range(H)],  # ... then each program reads its own copy
        "one program per\nquery head": [([f"kv{h // n_rep}"], [], [h]) for h in range(H)],
        "grouped: one program\nper K/V head": [([f"kv{j}"], [], list(range(j * n_rep, (j + 1) * n_rep)))
                                               for j in range(H_KV)],
    }
    rows = max(len(p) for p in plans.values())
    size = min(0.32, 6.0 / (rows + 1))
    widths = [0.3 + size * 1.1 * (H_KV + H + 2) + 0.3, 0.3 + size * 1.1 * 3 + 0.3, 0.3 + size * 1.1 * (n_rep + 2) + 0.3]
    height = rows * size * 1.25 + 0.2
    fig_size = (round(sum(widths) + 0.6, 1), round(height + 1.3, 1))  # whole pixels at any dpi that is a multiple of 10
    fig, axes = plt.subplots(1, 3, figsize=fig_size, gridspec_kw={"width_ratios": widths})
    for ax, (name, plan), w in zip(axes, plans.items(), widths):
        _axes(ax, w, height)
        for r, (loads, copies, queries) in enumerate(plan):
            _program_row(ax, height - (r + 1) * size * 1.25, size, loads, copies, queries, n_rep)
        n_load = sum(len(p[0]) for p in plan)
        n_copy = sum(len(p[1]) for p in plan)
        extra = f", {n_copy} copies written" if n_copy else ""
        ax.set_title(f"{name}\n{n_load} K/V head loads{extra}", fontsize=9)
    fig.suptitle(f"One decode step over {H} query heads and {H_KV} K/V heads: one row per program "
                 "(loads ▸ query heads computed)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def panel_counts(fig, gid: str) -> list[int]:
    """Cells of this gid in each panel of the figure, left to right."""
    return [sum(1 for p in ax.patches if p.get_gid() == gid) for ax in fig.axes]
