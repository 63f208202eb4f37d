"""Known wrong answers to lab 12b's exercises (moving the cache between workers): see kvlib.course.mistakes.

- ``remap``: copying received blocks into a receiver's pool. Each wrong result is the pair of pools (K and V stacked)
  the mistaken code leaves, so ``check`` compares what a later decode would read;
- ``score``: the router's score of a replica (the longest run of held block hashes from the first);
- ``choice_rules``: the usual wrong rules for "colocate or disaggregate" under latency targets.
"""

from __future__ import annotations

import torch

__all__ = ["remap", "remap_reference", "score", "choice_answers", "choice_rules", "CHOICES"]

CHOICES = ("colocate", "disaggregate", "neither")


def _remap(k, v, sent_table, pool_k, pool_v, free, how="right"):
    """The receiver's pools (stacked K, V) after a remap with one mistake switched on."""
    pk, pv = pool_k.clone(), pool_v.clone()
    n = k.shape[1]
    table = {"right": free[:n], "sender's ids": sent_table, "reversed": list(reversed(free[:n])),
             "K only": free[:n]}[how]
    for i, b in enumerate(table):
        pk[:, b] = k[:, i]
        if how != "K only":
            pv[:, b] = v[:, i]
    return torch.stack([pk, pv])


def remap_reference(k, v, sent_table, pool_k, pool_v, free):
    return _remap(k, v, sent_table, pool_k, pool_v, free)


def remap(k, v, sent_table, pool_k, pool_v, free) -> dict:
    args = (k, v, sent_table, pool_k, pool_v, free)
    return {
        "the blocks were written into the *sender's* block ids: on the receiver those blocks belong to other "
        "sequences (or to nobody): take the receiver's own free blocks": lambda: _remap(*args, how="sender's ids"),
        "the blocks went into the free blocks in reverse order: block i of the message is logical block i of the "
        "sequence, so it goes into the i-th block of the new table": lambda: _remap(*args, how="reversed"),
        "only K was copied: V of every block must come too": lambda: _remap(*args, how="K only"),
    }


def _runs(hashes, held, how):
    if how == "count":  # every held hash, wherever it is
        return sum(h in held for h in hashes)
    if how == "longest":  # the longest run of held hashes anywhere
        best = cur = 0
        for h in hashes:
            cur = cur + 1 if h in held else 0
            best = max(best, cur)
        return best
    if how == "after first hit":  # skips leading misses, then counts a run
        n, started = 0, False
        for h in hashes:
            if h in held:
                started, n = True, n + 1
            elif started:
                break
        return n
    raise ValueError(how)


def score(cases) -> dict:
    """cases: [(hashes, held)]; wrong results as tensors of scores, one per case."""
    def each(how):
        return lambda: torch.tensor([_runs(h, s, how) for h, s in cases])

    return {
        "every held hash was counted, wherever it is: a block's hash chains every block before it, so a hash held "
        "after a miss belongs to a prefix the replica does not have": each("count"),
        "the longest run anywhere was taken: only a run from the first block is a usable prefix": each("longest"),
        "leading misses were skipped: a prompt whose first block is not held has nothing to reuse": each("after first hit"),
    }


def _choose(case, how="right"):
    """One case's answer under a rule: case {"colocated": (ttft, itl), "disaggregated": (ttft, itl, transfer),
    "ttft_target", "itl_target"}."""
    ct, ci = case["colocated"]
    dt, di, tx = case["disaggregated"]
    T, I = case["ttft_target"], case["itl_target"]
    if how == "no transfer":
        tx = 0.0
    co = (ct <= T or how == "ignore ttft") and (ci <= I or how == "ignore itl")
    di_ok = (dt + tx <= T or how == "ignore ttft") and (di <= I or how == "ignore itl")
    if how == "prefer disaggregate":
        return "disaggregate" if di_ok else "colocate" if co else "neither"
    return "colocate" if co else "disaggregate" if di_ok else "neither"


def choice_answers(cases, how="right") -> tuple:
    return tuple(_choose(c, how) for c in cases.values())


def choice_rules(cases) -> dict:
    """{description: answers under that wrong rule}."""
    return {
        "disaggregation was preferred whenever it met the targets: when colocating meets them too, it needs no "
        "second pool and no transfer, and disaggregating does not raise throughput": choice_answers(cases, "prefer disaggregate"),
        "the per-token target was left out: colocated decodes wait for every prefill chunk in their steps":
            choice_answers(cases, "ignore itl"),
        "the transfer was left out of the disaggregated TTFT: when the answer streams from the decode worker, the "
        "client's first token comes after the prefill *and* the transfer": choice_answers(cases, "no transfer"),
    }
