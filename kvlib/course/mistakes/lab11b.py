"""Known wrong answers to lab 11b's exercises (Quest's bound on a block; a decision about the window layers): see
kvlib.course.mistakes. (The bound's diagnoses are lab 11's, moved here with its exercise; lab11.py keeps its copy
while the old chapter 11 lab exists.)"""

from __future__ import annotations

import torch

from ._common import GQA_MODULO

__all__ = ["block_upper_bound", "window_choice", "WINDOW_CHOICES"]

# --------------------------------------------------------------------------------------------
# Exercise 1 · Quest's bound on a block
# --------------------------------------------------------------------------------------------


def block_upper_bound(q, kmin, kmax):
    """Wrong Quest bounds; q (H, D), kmin and kmax (H_KV, N, D) -> (H, N)."""
    H, H_KV = q.shape[0], kmin.shape[0]
    n_rep = H // H_KV

    def heads(index):  # each query head's K/V head summaries, (H, N, D) for lo and hi
        idx = torch.tensor([index(h) for h in range(H)])
        return kmin.float()[idx], kmax.float()[idx]

    def bound(index=lambda h: h // n_rep, form="quest"):
        lo, hi = heads(index)
        qe = q.float()[:, None]  # (H, 1, D)
        if form == "kmax":
            return (qe * hi).sum(-1)
        if form == "after":
            return torch.maximum((qe * hi).sum(-1), (qe * lo).sum(-1))
        if form == "abs":
            return (qe.abs() * torch.maximum(lo.abs(), hi.abs())).sum(-1)
        if form == "min":
            return torch.minimum(qe * hi, qe * lo).sum(-1)
        return torch.maximum(qe * hi, qe * lo).sum(-1)

    out = {
        "only kmax was used, q · kmax: where q_i < 0 the largest q_i k_i comes from the smallest k_i, so it is not a "
        "bound; take max(q_i kmax_i, q_i kmin_i) per dimension": lambda: bound(form="kmax"),
        "the max was taken after the sums, max(q · kmax, q · kmin): a key can take its largest product from kmax "
        "in one dimension and from kmin in another; take the max per dimension, then sum": lambda: bound(
            form="after"),
        "|q_i| · max(|kmin_i|, |kmax_i|) is a bound, but a looser one than Quest's: it ignores the signs, so "
        "blocks rank differently; use max(q_i kmax_i, q_i kmin_i)": lambda: bound(form="abs"),
        "the min per dimension gives a lower bound of the block's scores, not an upper one: max(q_i kmax_i, "
        "q_i kmin_i)": lambda: bound(form="min"),
    }
    if 1 < H_KV < H:
        out[GQA_MODULO] = lambda: bound(index=lambda h: h % H_KV)
    if H_KV < H and n_rep != H_KV and (H - 1) // H_KV < H_KV:  # (else h // H_KV runs past the K/V heads: an error)
        out["query head h read K/V head h // H_KV: the group size is H // H_KV, so it is h // (H // H_KV)"] = (
            lambda: bound(index=lambda h: h // H_KV))
    return out


# --------------------------------------------------------------------------------------------
# Exercise 2 · a decision: spend 4 positions per window layer on sinks, or on a longer window?
# --------------------------------------------------------------------------------------------

WINDOW_CHOICES = ("window of 132", "window of 128 + 4 sinks")

WHY_NOT = {
    "window of 132": "the 4 extra rows keep 4 more recent positions, which the window layers' next tokens barely "
                     "need, and lose the first 4 once the text is longer than the window. SmolLM2 was trained with "
                     "full attention and parks much of each head's attention on its first tokens (the attention sink, "
                     "chapter 09a, StreamingLLM): without them that attention lands on whatever the window holds",
    "window of 128 + 4 sinks": "on this text the 4 more recent positions mattered more than the sinks: look at where "
                               "the scored tokens' attention goes (a model trained with windows, or with a learned "
                               "sink, would not need the first tokens)",
}


def window_choice(yours: str, ref: str, evidence) -> list[str]:
    """Lab 11b's decision (which spends 4 more rows per window layer better on this model): why the chosen plan
    predicts the text worse, from the evidence (``kvlib.course.ch11b.window_evidence``)."""
    if yours not in evidence.index:
        return [f"{yours!r} is not one of the plans measured: {', '.join(map(repr, evidence.index))}"]
    mine, right = float(evidence.loc[yours, "perplexity"]), float(evidence.loc[ref, "perplexity"])
    return [f"{yours}: perplexity {mine:.2f}, {ref}: {right:.2f} at the same bytes; {WHY_NOT.get(yours, '')}".rstrip("; ")]
