"""Known wrong answers to lab 07's exercises (GQA): see kvlib.course.mistakes."""

from __future__ import annotations

import math

import torch

from ._common import GQA_MODULO
from .lab01 import _attend_2d, _causal_mistakes

__all__ = ['repeat_kv', 'gqa_attention', 'mean_pool_kv']

# --------------------------------------------------------------------------------------------
# Lab 07 · GQA
# --------------------------------------------------------------------------------------------


def repeat_kv(x, n_rep):
    return {
        "the heads are interleaved (0, 1, 0, 1 …, what x.repeat or an axis expanded before H_KV gives): "
        "K/V head j must fill positions j * n_rep … j * n_rep + n_rep - 1": lambda: x.repeat(1, n_rep, 1, 1),
    }


def gqa_attention(q, k, v):
    """q (H, T, D), k/v (H_KV, T, D), causal."""
    H, H_KV = q.shape[0], k.shape[0]
    n_rep = H // H_KV

    def stacked(description, head=lambda h: h // n_rep):
        return lambda: torch.stack([_causal_mistakes(q[h], k[head(h)], v[head(h)], True)[description]()
                                    for h in range(H)])

    out = {d: stacked(d) for d in _causal_mistakes(q[0], k[0], v[0], True)}
    if 1 < H_KV < H:
        s = 1 / math.sqrt(q.shape[-1])
        future = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1)
        out[GQA_MODULO] = lambda: torch.stack([_attend_2d(q[h], k[h % H_KV], v[h % H_KV], s, future)
                                               for h in range(H)])
    return out


def mean_pool_kv(w, n_heads, n_kv_heads, head_dim):
    C = w.shape[1]
    n_rep = n_heads // n_kv_heads
    blocks = w.view(n_heads, head_dim, C)
    return {
        "the groups are interleaved (heads g, g + H_KV, g + 2·H_KV …): a group is n_rep consecutive heads, "
        "view(n_kv_heads, n_rep, head_dim, C)": lambda: w.view(n_rep, n_kv_heads, head_dim, C).mean(0).reshape(-1, C),
        "the group's heads are summed; average them (mean)": lambda: blocks.view(n_kv_heads, n_rep, head_dim, C).sum(
            1).reshape(-1, C),
        "only the first head of each group is kept; average all n_rep of them": lambda: blocks[::n_rep].reshape(-1, C),
    }


