"""Known wrong answers to lab 12a's exercises (sharding the cache across processes): see kvlib.course.mistakes."""

from __future__ import annotations

import torch

__all__ = ["merge_across_ranks", "tp_choice"]


def merge_across_ranks(part: torch.Tensor, lse: torch.Tensor) -> dict:
    """Exercise 1 (merge the ranks' partials): part (B, H, R, D), lse (B, H, R) natural log, -inf for an empty rank.
    The merges learners write instead, as they would compute them."""
    B, H, R, D = part.shape

    def weighted(w, normalise=True):
        out = (w[..., None] * part).sum(2)
        return out / w.sum(2, keepdim=True) if normalise else out

    m = lse.max(dim=2, keepdim=True).values
    return {
        "the ranks' partials are averaged: each must weigh by its share exp(lse_r - m) of the whole softmax sum":
            lambda: part.mean(2),
        "the partials are added: each is already normalised over its own rank's positions": lambda: part.sum(2),
        "the weighted sum is not divided by the sum of the weights": lambda: weighted(torch.exp(lse - m), normalise=False),
        "exp(lse) overflows without subtracting the largest lse first: w_r = exp(lse_r - max_r lse_r)":
            lambda: weighted(torch.exp(lse)),
        "the weights are the lses themselves; the weights are exp(lse_r - m)":
            lambda: weighted(torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)),
        "an empty rank's lse -inf was replaced by 0: an empty rank must weigh nothing (exp(-inf) = 0)":
            lambda: weighted(torch.exp(torch.where(torch.isinf(lse), torch.zeros_like(lse), lse) - torch.maximum(
                m, torch.zeros_like(m)))),
    }


def tp_choice(yours, ref, evidence: dict, budget_gib: float) -> list[str]:
    """Exercise 2 (the smallest tp whose cache per rank fits a budget): why ``yours`` is not ``ref``, one short line
    each. evidence: {tp: GiB per rank, or None where the engines refuse that tp}."""
    lines = []
    if yours is not None and yours not in evidence:
        lines.append(f"{yours!r} is not one of the candidates {sorted(evidence)}")
    elif yours is not None and evidence[yours] is None:
        lines.append(f"tp = {yours} is refused: the 64 query heads (and the K/V heads) must divide evenly by tp, or tp "
                     f"must be a multiple of the 8 K/V heads")
    elif yours is not None and evidence[yours] > budget_gib:
        lines.append(f"at tp = {yours} each rank holds {evidence[yours]:.1f} GiB, over the {budget_gib:g} GiB budget")
    elif yours is not None and ref is not None and yours > ref:
        lines.append(f"tp = {yours} fits, but tp = {ref} already does ({evidence[ref]:.1f} GiB per rank): the extra ranks "
                     f"buy no cache room")
    if yours is not None and ref is None and evidence.get(yours) is not None and yours > 8:
        lines.append(f"beyond 8 ranks each K/V head is replicated: tp = {yours} holds {evidence[yours]:.1f} GiB per rank, "
                     f"the same as tp = 8")
    if ref is None:
        lines.append(f"no tp fits {budget_gib:g} GiB: the answer is None (the cache per rank stops falling at tp = 8; "
                     f"splitting the tokens, decode context parallelism, is what shrinks it further)")
    elif yours is None:
        lines.append(f"tp = {ref} fits: {evidence[ref]:.1f} GiB per rank")
    return lines
