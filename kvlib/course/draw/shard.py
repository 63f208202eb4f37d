"""Chapter 12a's pictures, drawn from what the ranks returned: which heads, which token stripes each rank caches.

- :func:`tp_heads`: one row per tensor-parallel rank, its query heads and the K/V heads its cache holds (a K/V
  head held by several ranks is drawn on each: replication is visible as repeats down a column);
- :func:`cp_stripes`: one row per context-parallel rank, one column per cached position, filled where that rank
  holds the position's K/V.

Cells carry gids ("query", "filled", "empty") so a test can count them against the ranks' own reports.
"""

from __future__ import annotations

from . import cells, label, new_figure

__all__ = ["tp_heads", "cp_stripes"]


def tp_heads(results, config, *, title: str | None = None):
    """results: ``launch.run(tp.generate_tp, ...)``'s list (each with "q_heads", "kv_heads"); config: the full
    model's ``ModelConfig``. Query heads drawn as "query" cells, cached K/V heads as "filled" cells."""
    H, H_KV = config.n_heads, config.n_kv_heads
    size = min(0.4, 9.0 / (H + H_KV + 2))
    x_kv = 1.0 + H * size + 0.5
    width = round(x_kv + H_KV * size + 0.4, 1)
    height = round(0.7 + len(results) * size * 1.5, 1)
    tp = len(results)
    fig, ax = new_figure(width, height, title=title or f"tp = {tp}: each rank's query heads and the K/V heads it caches")
    top = height - 0.55
    label(ax, 1.0, top + 0.05, "query heads", fontsize=8, va="bottom")
    label(ax, x_kv, top + 0.05, "K/V heads cached", fontsize=8, va="bottom")
    for r, res in enumerate(results):
        y = top - (r + 1) * size * 1.5
        label(ax, 0.1, y + size / 2, f"rank {res.get('rank', r)}", fontsize=8)
        q = set(res["q_heads"])
        for h in range(H):  # every head's column, so a rank's share sits where the head sits
            if h in q:
                cells(ax, 1.0 + h * size, y, ["query"], size=size, texts=[str(h)])
        for j in res["kv_heads"]:
            cells(ax, x_kv + j * size, y, ["filled"], size=size, texts=[str(j)])
    return fig


def cp_stripes(results, *, title: str | None = None, max_positions: int = 48):
    """results: ``launch.run(cp.generate_cp, ...)``'s list (each with "positions"). One row per rank, one column per
    position (the first ``max_positions``): "filled" where the rank holds it, "empty" elsewhere."""
    held = [set(res["positions"]) for res in results]
    S = min(max_positions, max((max(h) + 1 for h in held if h), default=0))
    size = min(0.3, 11.0 / max(S, 1))
    width = round(1.1 + S * size + 0.3, 1)
    height = round(0.8 + len(results) * size * 1.4, 1)
    cp = len(results)
    fig, ax = new_figure(width, height, title=title or f"cp = {cp}: position p is cached on rank p % {cp}")
    top = height - 0.6
    for p in range(0, S, 4):
        label(ax, 1.1 + p * size + size / 2, top + 0.1, str(p), ha="center", fontsize=6, va="bottom")
    for r, h in enumerate(held):
        y = top - (r + 1) * size * 1.4
        label(ax, 0.1, y + size / 2, f"rank {results[r].get('rank', r)}", fontsize=8)
        cells(ax, 1.1, y, ["filled" if p in h else "empty" for p in range(S)], size=size)
    return fig
