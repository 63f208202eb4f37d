"""Known wrong answers to lab 07's exercises (GQA): see kvlib.course.mistakes."""

from __future__ import annotations

import math

import torch

from ._common import GQA_MODULO
from .lab01 import _attend_2d, _causal_mistakes

__all__ = ['repeat_kv', 'gqa_attention', 'mean_pool_kv', 'kv_heads_choice']

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




def kv_heads_choice():
    """Lab 07's decision: how many K/V heads a new model (32 layers, 32 query heads of dim 128) should get so that
    64 sequences of 8,192 tokens fit in an fp16 cache on an 80 GiB GPU after its 15 GiB of weights and a 2 GiB
    reserve (63 GiB left; each K/V head costs 8 GiB of cache). For each wrong count, why;
    ``kvlib.course.ch07.check_kv_heads_choice`` prints the reason for the count you chose."""
    return {
        32: "32 K/V heads is MHA, 256 GiB of cache: the K/V heads, not the query heads, set the cache's size",
        16: "16 K/V heads need 128 GiB: count both K and V (the formula's factor 2), and take the weights and the "
            "reserve off the GPU first",
        8: "8 K/V heads need 64 GiB, 1 GiB more than the 63 GiB left once the weights (15 GiB) and the reserve "
           "(2 GiB) are taken off; or K alone was counted, not K and V",
        2: "2 K/V heads fit, but so do 4: was a number counted as 4 bytes? fp16 takes 2. Each K/V head given up "
           "costs quality (chapter 07's conversion), so take the largest count that fits",
        1: "1 K/V head (MQA) fits, but so do 2 and 4: MQA gives up the most quality; take the largest count that "
           "fits",
        "not a divisor": "the K/V heads must divide the 32 query heads, so that every group has the same size",
    }
