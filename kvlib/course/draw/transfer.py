"""Chapter 12b's pictures, drawn from the live results: blocks moving between workers, and the router's hash runs.

- ``transfer(spec, sent, got)``: the prefill worker's pool (the blocks each request was prefilled into), the message,
  and the decode worker's pool (the free blocks it copied them into: a new block table). Cells of transferred
  blocks are tagged "filled" on the prefill side and "new" on the decode side; a request the decode worker had to
  recompute shows its own blocks as "masked" (nothing it received was used).
- ``hash_runs(router, docs, block_size)``: per replica, each document's chained block hashes, "filled" where the
  router's index (built from the replicas' KV events) holds it, "empty" where it does not.
"""

from __future__ import annotations

from ..draw import COLORS, arrow, cells, label, new_figure

__all__ = ["transfer", "hash_runs"]

_SIZE = 0.34


def transfer(spec, sent, got, max_blocks: int = 24):
    """The first ``max_blocks`` blocks of each worker's pool after a ``disagg_worker`` run (rank results ``sent``,
    ``got``), each cell labelled request.logical block."""
    w = 1.6 + max_blocks * _SIZE + 0.3
    fig, ax = new_figure(w, 2.6, title="each request's blocks: prefilled on rank 0, copied into rank 1's own free blocks")
    send_pool = ["empty"] * max_blocks
    send_txt = [""] * max_blocks
    recv_pool, recv_txt = ["empty"] * max_blocks, [""] * max_blocks
    for i in sorted(sent["sent"]):  # the requests rank 0 prefilled (a request local to rank 1 is not drawn)
        s, g = sent["sent"][i], got["out"][i]
        moved = g["how"] == "transfer"
        for j, b in enumerate(s["table"]):
            if b < max_blocks and moved:  # the sender's pool is reused by later requests: show what was sent
                send_pool[b], send_txt[b] = "filled", f"{i}.{j}"
        for j, b in enumerate((g["table"] or [])[: s["n_blocks"]]):
            if b < max_blocks:
                recv_pool[b], recv_txt[b] = ("new" if moved else "masked"), f"{i}.{j}"
    label(ax, 0.05, 2.0, "rank 0 pool\n(prefill)", fontsize=8)
    cells(ax, 1.6, 1.85, send_pool, size=_SIZE, texts=send_txt, fontsize=6)
    label(ax, 0.05, 0.45, "rank 1 pool\n(decode)", fontsize=8)
    cells(ax, 1.6, 0.3, recv_pool, size=_SIZE, texts=recv_txt, fontsize=6)
    mid = 1.6 + max_blocks * _SIZE / 2
    arrow(ax, mid, 1.8, mid, 0.7)
    label(ax, mid + 0.15, 1.25, "header (with prompt and table): the store; K and V stacked: one dist.send", fontsize=8)
    label(ax, 1.6, 2.45, "cell text: request.logical block; grey on rank 1: a request recomputed there "
                         "(its transfer failed or arrived damaged)", fontsize=7, color=COLORS["masked"])
    return fig


def hash_runs(router, docs: dict, block_size: int):
    """One row per (replica, document): the document's chained block hashes, filled where the replica holds them.
    ``docs``: {document number: tokens} (``kvlib.dist.router.documents``)."""
    from ...paged import chained_block_hashes

    rows = [(k, d) for k in range(router.n) for d in docs]
    n_max = max(len(doc) // block_size for doc in docs.values())
    fig, ax = new_figure(2.2 + n_max * _SIZE + 0.2, 0.5 + len(rows) * (_SIZE + 0.08),
                         title="what the router's index holds, per replica (from the replicas' KV events)")
    for r, (k, d) in enumerate(rows):
        y = (len(rows) - 1 - r) * (_SIZE + 0.08) + 0.1
        hashes = chained_block_hashes(docs[d], block_size, len(docs[d]) // block_size)
        kinds = ["filled" if h in router.index[k] else "empty" for h in hashes]
        label(ax, 0.05, y + _SIZE / 2, f"replica {k}, doc {d}", fontsize=7)
        cells(ax, 2.2, y, kinds, size=_SIZE)
    return fig
