"""Known wrong answers to lab 01's exercises (attention): see kvlib.course.mistakes."""

from __future__ import annotations

import math

import torch

from ._common import BY_D, GQA_MODULO, NO_SQRT_D

__all__ = ['attention_one_head', 'kv_head_for', 'online_softmax']

# --------------------------------------------------------------------------------------------
# Lab 01 · attention
# --------------------------------------------------------------------------------------------


def _attend_2d(q, k, v, scale, hide=None, dim=-1, after=False, fill=float("-inf")):
    """softmax(q k^T * scale) v for one head, q (T, D), k/v (S, D); ``hide`` (T, S) marks masked scores."""
    s = q.float() @ k.float().T * scale
    if hide is not None and not after:
        s = s.masked_fill(hide, fill)
    p = torch.softmax(s, dim=dim)
    if hide is not None and after:
        p = p.masked_fill(hide, 0.0)
    return (p @ v.float()).to(q.dtype)


def _causal_mistakes(q, k, v, causal):
    """Mistakes in one head's (T, D) attention; shared by lab 01 and lab 07."""
    T, D = q.shape
    S = k.shape[0]
    ones = torch.ones(T, S, dtype=torch.bool, device=q.device)
    future = ones.triu(1) if causal else None
    s = 1 / math.sqrt(D)
    out = {
        NO_SQRT_D: lambda: _attend_2d(q, k, v, 1.0, future),
        BY_D: lambda: _attend_2d(q, k, v, 1 / D, future),
        "the softmax runs down each column (dim=0); each query's row must sum to 1 (dim=-1)": lambda: _attend_2d(
            q, k, v, s, future, dim=0),
    }
    if causal:
        out.update({
            "there is no causal mask: with causal=True, query i must not see keys j > i": lambda: _attend_2d(
                q, k, v, s),
            "the mask hides the diagonal too (triu(0) instead of triu(1)): query i must see key i, itself "
            "(row 0 then has no key left, hence NaN)": lambda: _attend_2d(q, k, v, s, ones.triu(0)),
            "the mask hides the past instead of the future (tril instead of triu)": lambda: _attend_2d(
                q, k, v, s, ones.tril(-1)),
            "the future scores are set to 0, not -inf: exp(0) = 1 still gives them weight": lambda: _attend_2d(
                q, k, v, s, future, fill=0.0),
            "the mask is applied after the softmax: the rows no longer sum to 1; mask the scores with -inf "
            "before it": lambda: _attend_2d(q, k, v, s, future, after=True),
        })
    return out


def attention_one_head(q, k, v, causal=True):
    """q (T, D), k/v (S, D)."""
    return _causal_mistakes(q, k, v, causal)


def kv_head_for(configs):
    """configs: [(H, H_KV), ...]; the check compares one config at a time, so pass one."""
    (H, H_KV), = configs
    return {
        GQA_MODULO: lambda: torch.tensor([h % H_KV for h in range(H)]),
        "h // H_KV divides by the number of K/V heads; the group size is H // H_KV": lambda: torch.tensor(
            [h // H_KV for h in range(H)]),
    }


def _online(scores, values, chunk, *, rescale_l=True, rescale_acc=True, update_m=True, inverted=False):
    m = torch.tensor(float("-inf"))
    l = torch.tensor(0.0)
    acc = torch.zeros(values.shape[1])
    for start in range(0, scores.shape[0], chunk):
        s_c, v_c = scores[start:start + chunk], values[start:start + chunk]
        m_new = torch.maximum(m, s_c.max())
        alpha = torch.exp(m_new - m) if inverted else torch.exp(m - m_new)
        p = torch.exp(s_c - m_new)
        l = (alpha * l if rescale_l else l) + p.sum()
        acc = (alpha * acc if rescale_acc else acc) + p @ v_c
        if update_m:
            m = m_new
    return acc / l


def online_softmax(scores, values, chunk):
    return {
        "l and acc are never rescaled by alpha = exp(m_old - m_new): what was summed under the old max "
        "must be re-expressed under the new one": lambda: _online(scores, values, chunk, rescale_l=False,
                                                                   rescale_acc=False),
        "acc is rescaled by alpha but l is not": lambda: _online(scores, values, chunk, rescale_l=False),
        "l is rescaled by alpha but acc is not": lambda: _online(scores, values, chunk, rescale_acc=False),
        "m is never updated (m = m_new is missing), so alpha is 0 and each chunk throws the earlier ones "
        "away": lambda: _online(scores, values, chunk, update_m=False),
        "alpha is inverted: exp(m_new - m_old) instead of exp(m_old - m_new)": lambda: _online(
            scores, values, chunk, inverted=True),
    }


