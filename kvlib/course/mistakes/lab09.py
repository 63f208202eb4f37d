"""Known wrong answers to lab 09a's exercises (keeping fewer positions), and the diagnoses of the former lab 09's
low-bit and MLA exercises that lab 09b imports (quantize_2bit, quantize_keys_2bit, absorbed_attention): see
kvlib.course.mistakes."""

from __future__ import annotations

import math

import torch

from ._common import GQA_MODULO, NO_SQRT_D

__all__ = ['sink_window_keep', 'h2o_update', 'snapkv_priority', 'needle_choice', 'quantize_2bit', 'quantize_keys_2bit',
           'absorbed_attention']

# --------------------------------------------------------------------------------------------
# Lab 09 · keeping less
# --------------------------------------------------------------------------------------------


def sink_window_keep(n, budget, n_sink):
    """Wrong keep lists for sinks + window over n held positions (a list of ints, ascending)."""
    def window(w):
        return list(range(max(0, n - w), n))

    def sinks_then(w):
        return sorted(set(range(min(n_sink, n))) | set(window(w))) if n > budget else list(range(n))

    out = {
        "no sinks: only the most recent positions are kept (that is the plain sliding window); keep the first "
        "n_sink positions too": lambda: window(budget),
        "the window has budget positions on top of the sinks, so n_sink + budget are kept: the sinks count "
        "toward the budget (the window is budget - n_sink long)": lambda: sinks_then(budget),
        "one position too many in the window: it is budget - n_sink long, not budget - n_sink + 1": lambda: sinks_then(
            budget - n_sink + 1),
        "one position too few in the window: it is budget - n_sink long, not budget - n_sink - 1": lambda: sinks_then(
            budget - n_sink - 1),
        "under the budget some positions were dropped or repeated: when n <= budget every position is kept, "
        "each once": lambda: list(range(min(n_sink, n))) + window(budget - n_sink),
    }
    if n < budget:  # the over-budget formula alone starts the window before the sinks end
        start = n - (budget - n_sink)
        no_case = list(range(n_sink)) + list(range(start, n))
        where = (f"n = {n} is under the budget {budget}, so the window's start n - (budget - n_sink) = {start} lies "
                 "inside the sinks")
        out[f"there is no case for n <= budget: {where}, and positions are repeated"
            + (f" ({start} is not a position at all)" if start < 0 else "")
            + "; when n <= budget, return list(range(n))"] = lambda: no_case
        if start < 0:  # a set removes the repeats, not the negative start
            out[f"there is no case for n <= budget: {where}, and {start} is not a position; when n <= budget, return "
                "list(range(n))"] = lambda: sorted(set(range(n_sink)) | set(range(start, n)))
    return out


def h2o_update(scores, probs):
    """Wrong score updates; scores (H_KV, N), probs (H, T, N)."""
    H, T, N = probs.shape
    H_KV = scores.shape[0]
    n_rep = H // H_KV
    grouped = probs.view(H_KV, n_rep, T, N)
    modulo = torch.stack([probs[[h for h in range(H) if h % H_KV == g]].sum(dim=(0, 1)) for g in range(H_KV)])
    return {
        GQA_MODULO.replace("read K/V head", "was added to the score of K/V head"): lambda: scores + modulo,
        "the old scores were replaced: H2O *accumulates*, score + this step's attention": lambda: grouped.sum(dim=(1, 2)),
        "only the last query's attention was added: every one of the T new queries attends, and each adds its "
        "probabilities": lambda: scores + grouped[:, :, -1].sum(1),
        "the attention was averaged over the T queries: H2O sums it": lambda: scores + grouped.mean(2).sum(1),
        "the attention was averaged over the group's query heads: a K/V head's score sums over all n_rep heads "
        "that read it": lambda: scores + grouped.sum(2).mean(1),
        "only the group's first query head was counted: sum over all n_rep heads that read the K/V head": lambda: (
            scores + grouped[:, 0].sum(1)),
    }


WHY_NOT = {
    "sinks + window": "a window that ends at the question holds only the last budget - 4 positions (and the 4 sinks): a "
                      "needle further back than that is gone in every layer, whatever attention says",
    "H2O": "H2O has read the question too, but it ranks a position by the attention it received from every prompt "
           "query, summed: the question's few queries are a small part of that sum, the filler's many do not refer to "
           "the needle, and half of H2O's budget is its recent window",
    "H2O, streamed (ours)": "the streamed H2O (ours) evicts as the prompt streams in, 32 tokens at a time: each choice is "
                            "made by the queries read so far, before the question exists, and the filler after the "
                            "needle does not refer to it; half of its budget is its recent window",
    "SnapKV": "SnapKV lets the prompt's last tokens, the question among them, vote after the whole prompt was read; "
              "here its vote went elsewhere: read the evidence table",
}


def needle_choice(yours: str, ref: str, evidence) -> list[str]:
    """Lab 09a's decision (whose attention holds the most of the needle once the question has been read): why the
    chosen rule holds less than the reference, from the evidence (``kvlib.course.ch09.needle_evidence``)."""
    if yours not in evidence.index:
        return [f"{yours!r} is not one of the rules measured: {', '.join(map(repr, evidence.index))}"]
    col = "needle held (mean %)"
    mine, right = float(evidence.loc[yours, col]), float(evidence.loc[ref, col])
    return [f"{yours} holds {mine:.0f}% of the needle on average, {ref} {right:.0f}%: {WHY_NOT.get(yours, '')}".rstrip(": ")]


CONSTANT_GROUP = ("a constant group (max = min) got scale 0: (x - zero) / 0 is 0/0, NaN, before the cast; give it "
                  "scale 1 instead, torch.where(scale > 0, scale, torch.ones_like(scale)): its codes are then 0 and "
                  "it comes back exactly, zero")


def quantize_2bit(x, group):
    """Wrong (q, scale, zero) for asymmetric 2-bit quantization in groups of ``group`` along the last dim."""
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)

    def asym(levels=3, rounding=torch.round, zero_at="min", grouped=True, constant=1.0):
        t = g if grouped else x.float().reshape(*x.shape[:-1], 1, x.shape[-1])
        lo, hi = t.amin(-1, keepdim=True), t.amax(-1, keepdim=True)
        scale = (hi - lo) / levels
        if constant is not None:  # None: the scale left 0, as (max - min) / 3 gives it
            scale = torch.where(scale > 0, scale, torch.full_like(scale, constant))
        zero = lo if zero_at == "min" else hi
        q = rounding((t - zero) / scale).clamp(0, 3).to(torch.uint8)
        if not grouped:
            q = q.reshape(g.shape)
            scale = scale.expand(*g.shape[:-1], 1)
            zero = zero.expand(*g.shape[:-1], 1)
        return q, scale, zero

    def symmetric():
        amax = g.abs().amax(-1, keepdim=True)
        scale = torch.where(amax > 0, amax / 1.5, torch.ones_like(amax))
        q = (torch.round(g / scale + 1.5)).clamp(0, 3).to(torch.uint8)
        return q, scale, torch.full_like(scale, -1.5) * scale

    return {
        "the scale is (max - min) / 4: four levels are three steps apart, so it is (max - min) / 3": lambda: asym(4),
        "the codes were truncated with floor: round to the nearest level (torch.round)": lambda: asym(
            rounding=torch.floor),
        "the zero point is the group's max: it is the min, so that x - zero >= 0 and codes run 0..3": lambda: asym(
            zero_at="max"),
        "one group per row: the min and max run over groups of `group` numbers, reshape to (..., D // group, "
        "group) first": lambda: asym(grouped=False),
        "symmetric (absmax) quantization around 0: asymmetric uses the group's min as zero point and spends all "
        "four levels between min and max": symmetric,
        CONSTANT_GROUP: lambda: asym(constant=None),
    }


def _snapkv(probs, n_kv_heads, kernel, *, pool="max", pad=True, group="sum", queries="sum", modulo=False,
            pool_first=False, window="inf"):
    """SnapKV's priority (H_KV, N + window) with one mistake switched on (the right one with none)."""
    import torch.nn.functional as F

    H, w, N = probs.shape
    n_rep = H // n_kv_heads
    p = probs.float()
    per_head = {"sum": p.sum(1), "mean": p.mean(1), "last": p[:, -1]}[queries]  # (H, N)

    def pooled(x):  # x (rows, N)
        padding = kernel // 2 if pad else 0
        if pool == "none":
            return x
        fn = F.max_pool1d if pool == "max" else F.avg_pool1d
        return fn(x[:, None], kernel, stride=1, padding=padding)[:, 0]

    if pool_first:
        per_head = pooled(per_head)
    if modulo:
        heads = [per_head[[h for h in range(H) if h % n_kv_heads == g]] for g in range(n_kv_heads)]
    else:
        heads = list(per_head.view(n_kv_heads, n_rep, -1))
    votes = torch.stack([x.sum(0) if group == "sum" else x.mean(0) for x in heads])
    if not pool_first:
        votes = pooled(votes)
    if window == "missing":
        return votes
    fill = float("inf") if window == "inf" else 0.0
    return torch.cat([votes, torch.full((n_kv_heads, w), fill)], dim=1)


def snapkv_priority(probs, n_kv_heads, kernel):
    """Wrong SnapKV priorities; probs (H, window, N) over the positions before the window."""
    H = probs.shape[0]

    def each(**mistake):
        return lambda: _snapkv(probs, n_kv_heads, kernel, **mistake)

    out = {
        "average pooling (F.avg_pool1d, SnapKV's code's default pooling='avgpool'): the course's SnapKVCache "
        "max-pools, F.max_pool1d": each(pool="avg"),
        "no pooling: the votes are max-pooled over `kernel` neighbouring positions, so that a chosen position "
        "keeps its neighbours": each(pool="none"),
        "the pool has no padding, so only N - kernel + 1 positions got a vote: pad kernel // 2 on each side "
        "(padding=kernel // 2)": each(pad=False),
        "only the window's last query voted: all `window` queries vote, sum their probabilities (dim 1)": each(
            queries="last"),
        "the window's queries were averaged: SnapKV sums their votes (attn_weights.sum(dim=-2))": each(
            queries="mean"),
        "the window's positions are missing: the priority covers N + window positions, the window's +inf": each(
            window="missing"),
        "the window's positions got priority 0: give them +inf, so that the window is always kept": each(
            window="zero"),
    }
    if n_kv_heads < H:
        out["the group's query heads were averaged: a K/V head's vote sums the votes of its n_rep heads"] = each(
            group="mean")
        out["each query head was pooled before the group's votes were added: add a K/V head's votes first, then "
            "pool (a max pool of a sum is not the sum of max pools)"] = each(pool_first=True)
    if 1 < n_kv_heads < H:
        out[GQA_MODULO.replace("read K/V head", "voted for K/V head")] = each(modulo=True)
    return out


def quantize_keys_2bit(k, group):
    """Wrong (q, scale, zero) for KIVI's keys: k (H_KV, S, D), per channel over groups of ``group`` tokens."""
    H_KV, S, D = k.shape

    def asym(t, dim, levels=3, rounding=torch.round, constant=True):
        lo, hi = t.amin(dim, keepdim=True), t.amax(dim, keepdim=True)
        scale = (hi - lo) / levels
        if constant:  # False: the scale left 0, as (max - min) / 3 gives it
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return rounding((t - lo) / scale).clamp(0, 3).to(torch.uint8), scale, lo

    def per_channel(levels=3, rounding=torch.round, constant=True):
        q, scale, zero = asym(k.float().reshape(H_KV, S // group, group, D), 2, levels, rounding, constant)
        return q.reshape(H_KV, S, D), scale[:, :, 0], zero[:, :, 0]

    def over_channels():  # exercise 4's dim=-1 on the (H_KV, S // group, group, D) reshape
        q, scale, zero = asym(k.float().reshape(H_KV, S // group, group, D), -1)
        return q.reshape(H_KV, S, D), scale[:, :, 0], zero[:, :, 0]

    def per_token():  # exercise 4's layout: groups of `group` channels inside each token
        q, scale, zero = asym(k.float().reshape(H_KV, S, D // group, group), -1)
        return q.reshape(H_KV, S, D), scale[..., 0], zero[..., 0]

    def not_transposed_back():  # exercise 4 on k.transpose(1, 2), the scales left (H_KV, D, S // group)
        q, scale, zero = asym(k.float().transpose(1, 2).reshape(H_KV, D, S // group, group), -1)
        return q.reshape(H_KV, D, S).transpose(1, 2), scale[..., 0], zero[..., 0]

    return {
        "groups of `group` channels inside each token (exercise 4's layout): KIVI's keys group `group` consecutive "
        "tokens per channel, reshape(H_KV, S // group, group, D) and min/max over dim 2": per_token,
        "one (scale, zero) per channel over all S tokens: the min and max run over each group of `group` tokens, "
        "reshape(H_KV, S // group, group, D) first": lambda: _lowbit().quantize_asym(k, 2, dim=1),
        "the min and max ran over the channels (the last dim): per channel means over a group's tokens, dim 2 of "
        "(H_KV, S // group, group, D)": over_channels,
        "the scale and zero came back (H_KV, D, S // group), as the transposed keys had them: transpose them back "
        "to (H_KV, S // group, D)": not_transposed_back,
        "the scale is (max - min) / 4: four levels are three steps apart, so it is (max - min) / 3": lambda: (
            per_channel(levels=4)),
        "the codes were truncated with floor: round to the nearest level (torch.round)": lambda: per_channel(
            rounding=torch.floor),
        CONSTANT_GROUP.replace("a constant group (max = min)", "a constant (group, channel), max = min,"): lambda: (
            per_channel(constant=False)),
    }


def _lowbit():
    from ... import lowbit

    return lowbit


def _absorbed(q, c, w_uk, w_uv, *, scale="D", uk="heads", uv="heads", softmax_dim=-1, values="uv"):
    """MLA's absorbed attention (scores, out) with one mistake switched on (the right one with none)."""
    H, D = q.shape
    d_c = c.shape[1]

    def per_head(w, layout):  # (d_c, H, width): head h's columns h*width .. h*width + width - 1
        width = w.shape[1] // H
        return w.view(d_c, H, width) if layout == "heads" else w.view(d_c, width, H).transpose(1, 2)

    q_lat = torch.einsum("hd,chd->hc", q, per_head(w_uk, uk))
    div = {"D": math.sqrt(D), "d_c": math.sqrt(d_c), "none": 1.0}[scale]
    scores = q_lat @ c.T / div
    o_lat = torch.softmax(scores, dim=softmax_dim) @ c
    w_out = per_head(w_uv if values == "uv" else w_uk, uv)
    return scores, torch.einsum("hc,chv->hv", o_lat, w_out)


def absorbed_attention(q, c, w_uk, w_uv):
    """Wrong (scores, out) of MLA's absorbed attention; q (H, D), c (S, d_c), w_uk (d_c, H*D), w_uv (d_c, H*D_v)."""
    def each(**mistake):
        return lambda: _absorbed(q, c, w_uk, w_uv, **mistake)

    out = {
        "the scores are divided by √d_c, the latent's width: q̃·c is the same number as q·k, so it keeps the "
        "head's scale 1/√D": each(scale="d_c"),
        NO_SQRT_D: each(scale="none"),
        "the softmax ran over the heads (dim 0): each head's probabilities run over the S positions (dim -1)": each(
            softmax_dim=0),
    }
    if q.shape[0] > 1:
        out["W_uk's heads were read interleaved: head h's columns are h·D … h·D + D - 1, w_uk.view(d_c, H, D), "
            "not view(d_c, D, H)"] = each(uk="interleaved")
        out["W_uv's heads were read interleaved: head h's columns are h·D_v … h·D_v + D_v - 1, "
            "w_uv.view(d_c, H, D_v)"] = each(uv="interleaved")
    if w_uk.shape == w_uv.shape:
        out["the values were rebuilt with W_uk: the output goes through W_uv"] = each(values="uk")
    return out


