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




def kv_heads_choice(evidence):
    """Lab 07's decision: how many K/V heads a new model (32 layers, d_model 4,096, 32 query heads of dim 128;
    15 GiB of fp16 weights as MHA, wk and wv shrinking with the K/V heads) should get so that 64 sequences of 8,192
    tokens fit in an fp16 cache on an 80 GiB GPU beside a 2 GiB reserve. For each wrong count, why (the figures
    are read from ``evidence``, the table ``kvlib.course.ch07.kv_heads_evidence()`` returns, in MiB);
    ``check_kv_heads_choice`` prints the one you chose."""
    ev = evidence / 1024  # MiB -> GiB
    cache, left, weights = (ev[f"{name} (MiB)"].map("{:g}".format) for name in ("cache", "left for the cache", "weights"))
    return {
        32: f"32 K/V heads is MHA, {cache[32]} GiB of cache: the K/V heads, not the query heads, set the cache's size",
        16: f"16 K/V heads need {cache[16]} GiB, and {left[16]} GiB are left: was K alone counted? The cache holds K "
            "and V (the formula's factor 2)",
        4: f"4 K/V heads fit, but so do 8: 8 need {cache[8]} GiB, and with 8 K/V heads the weights are "
           f"{weights[8]} GiB, not the MHA figure {weights[32]} GiB (wk and wv shrink with the K/V heads), which "
           f"leaves {left[8]} GiB. Or was a number counted as 4 bytes? fp16 takes 2",
        2: "2 K/V heads fit, but so do 4 and 8: was a number counted as 4 bytes (fp16 takes 2), and the weights "
           "kept at the MHA figure?",
        1: "1 K/V head (MQA) fits, but so do 2, 4 and 8: the team wants as many K/V heads as the workload allows",
        "not a divisor": "the K/V heads must divide the 32 query heads, so that every group has the same size",
    }
