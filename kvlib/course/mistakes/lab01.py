"""Known wrong answers to lab 01's exercises (attention): see kvlib.course.mistakes."""

from __future__ import annotations

import math

import torch

from ._common import BY_D, GQA_MODULO, NO_SQRT_D

__all__ = ['attention_one_head', 'kv_head_for', 'online_softmax', 'chunk_combinations', 'combine_chunks',
           'combine_chunks_reference', 'hidden_counts', 'hidden_counts_reference']

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


def _online(scores, values, chunk, *, rescale_l=True, rescale_acc=True, update_m=True, inverted=False, guard=True):
    m = torch.tensor(float("-inf"))
    l = torch.tensor(0.0)
    acc = torch.zeros(values.shape[1])
    for start in range(0, scores.shape[0], chunk):
        s_c, v_c = scores[start:start + chunk], values[start:start + chunk]
        m_new = torch.maximum(m, s_c.max())
        if guard and torch.isinf(m_new):  # every key so far masked: nothing to add
            continue
        alpha = torch.exp(m_new - m) if inverted else torch.exp(m - m_new)
        p = torch.exp(s_c - m_new)
        l = (alpha * l if rescale_l else l) + p.sum()
        acc = (alpha * acc if rescale_acc else acc) + p @ v_c
        if update_m:
            m = m_new
    return acc / l


def online_softmax(scores, values, chunk):
    """Known wrong loops of exercise 3. On scores with masked keys (-inf), a loop without the test for an
    all-masked chunk gives NaN; a variant that gives the same NaN there (the inverted alpha does) is left out,
    so that each wrong answer is named once (the unmasked checks before it name the others)."""
    no_guard = ("NaN from a chunk whose keys are all masked while m is still -inf: exp(-inf - (-inf)) = exp(nan); "
                "such a chunk adds nothing, so skip it until some key is visible")
    variants = {
        "l and acc are never rescaled by alpha = exp(m_old - m_new): what was summed under the old max "
        "must be re-expressed under the new one": lambda: _online(scores, values, chunk, rescale_l=False,
                                                                   rescale_acc=False),
        "acc is rescaled by alpha but l is not": lambda: _online(scores, values, chunk, rescale_l=False),
        "l is rescaled by alpha but acc is not": lambda: _online(scores, values, chunk, rescale_acc=False),
        "m is never updated (m = m_new is missing), so alpha is 0 and each chunk throws the earlier ones "
        "away": lambda: _online(scores, values, chunk, update_m=False),
        "alpha is inverted: exp(m_new - m_old) instead of exp(m_old - m_new)": lambda: _online(
            scores, values, chunk, inverted=True),
        no_guard: lambda: _online(scores, values, chunk, guard=False),
    }
    if not torch.isinf(scores).any():
        return variants
    nan = variants[no_guard]()
    return {what: fn for what, fn in variants.items()
            if what == no_guard or not torch.allclose(fn(), nan, equal_nan=True)}


# Exercise 4 (a decision): which combination of per-chunk results is the row's softmax-weighted sum?

COMBINE_REASON = 2  # each o_c is normalised by its own chunk's sum: rescale it by the chunk's share of the row's


def chunk_combinations(scores, values, chunk):
    """The three candidate combinations of exercise 4, computed from per-chunk results only:
    {1: mean of the o_c, 2: o_c weighted by l_c e^(m_c) / sum, 3: the o_c of the chunk with the largest m_c}."""
    outs, maxes, sums = [], [], []
    for start in range(0, scores.shape[0], chunk):
        s_c, v_c = scores[start:start + chunk].double(), values[start:start + chunk].double()
        m_c = s_c.max()
        e = torch.exp(s_c - m_c)
        outs.append(e @ v_c / e.sum())  # o_c = softmax(s_c) V_c
        maxes.append(m_c)
        sums.append(e.sum())
    outs, maxes, sums = torch.stack(outs), torch.stack(maxes), torch.stack(sums)
    share = sums * torch.exp(maxes - maxes.max())  # l_c e^(m_c), all relative to the largest max: no overflow
    return {1: outs.mean(0), 2: (share / share.sum()) @ outs, 3: outs[int(maxes.argmax())]}


def combine_chunks_reference(scores, values, chunk):
    """The right (combination, reason) of exercise 4, found by computing the three combinations on these inputs
    and keeping the one equal to softmax(scores) @ values (there is exactly one)."""
    true = torch.softmax(scores.double(), 0) @ values.double()
    right = [n for n, out in chunk_combinations(scores, values, chunk).items() if torch.allclose(out, true, atol=1e-9)]
    if len(right) != 1:
        raise ValueError(f"combine_chunks_reference: {len(right)} combinations equal the true output on these inputs")
    return right[0], COMBINE_REASON


def combine_chunks(scores, values, chunk):
    """Every wrong (combination, reason) answer to exercise 4, each with what it misses."""
    combos = chunk_combinations(scores, values, chunk)
    true = torch.softmax(scores.double(), 0) @ values.double()
    off = {n: (out - true).abs().max().item() for n, out in combos.items()}
    n = len(range(0, scores.shape[0], chunk))
    return {
        f"the plain mean weighs every chunk equally, whatever its scores (off by {off[1]:.2f} here), and softmax is not "
        "linear: exp of a sum is a product, so averaging softmaxes is not the softmax of the average. This is the "
        "first source article's mistake in its paged attention": (1, 1),
        f"reason 2 is right, but it rules out option 1: the plain mean gives every chunk the same weight instead "
        f"of its share of the row's sum (off by {off[1]:.2f} here)": (1, 2),
        f"the plain mean weighs every chunk equally (off by {off[1]:.2f} here), which reason 3 argues against: if "
        f"one chunk held nearly all the weight, the mean would shrink it to 1/{n}": (1, 3),
        f"the chunk with the largest score holds nearly all the weight only when its scores stand far above the "
        f"others'; here the other chunks still count (off by {off[3]:.2f})": (3, 3),
        f"the chunk with the largest maximum alone leaves the other chunks out (off by {off[3]:.2f} here), and "
        "softmax is not linear: exp of a sum is a product": (3, 1),
        f"reason 2 is right, but it rules out option 3: the other chunks have a share of the row's sum too (off "
        f"by {off[3]:.2f} here)": (3, 2),
        "the right combination for the wrong reason: softmax is not linear (exp of a sum is a product), so "
        "averaging softmaxes is not the softmax of the average": (2, 1),
        "the right combination for the wrong reason: no chunk is negligible here; option 2 is exact however the "
        "scores are spread, because it renormalises each o_c by its chunk's share of the row's sum": (2, 3),
    }


# Exercise 5 (a decision): how many (query, key) pairs does the causal mask hide?

HIDDEN_CASES = ((7, 7), (3, 7), (1, 7))  # (T queries, S keys): a prefill, 3 new tokens after 4 cached, 1 new token


def hidden_counts_reference(cases=HIDDEN_CASES):
    """Pairs the causal mask hides for each (T, S), the queries being the last T of S tokens: query i sits at
    position S - T + i and may not see keys after it, which leaves T(T-1)/2 hidden pairs whatever S is."""
    return tuple(sum(max(0, S - (S - T + i) - 1) for i in range(T)) for T, S in cases)


def hidden_counts(cases=HIDDEN_CASES):
    """Every typical wrong count for exercise 5, each with what it misses."""
    def count(rule):
        return tuple(sum(rule(i, j, T, S) for i in range(T) for j in range(S)) for T, S in cases)

    return {
        "the diagonal is hidden too: a query always sees its own key (j = i is visible), so a prefill of T tokens "
        "hides T(T-1)/2 pairs, not T(T+1)/2": count(lambda i, j, T, S: j >= S - T + i),
        "the mask is aligned to the start, not to the end: the T queries are the *last* T tokens, so query i sits "
        "at position S - T + i and sees keys 0 .. S - T + i": count(lambda i, j, T, S: j > i),
        "new queries still hide each other's future: with 3 new tokens, the first new token must not see the two "
        "after it (only a single new token, T = 1, has nothing to hide)": tuple(
            T * (T - 1) // 2 if T == S else 0 for T, S in cases),
    }
