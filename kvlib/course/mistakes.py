"""Known wrong answers to the labs' exercises, so that a checker can say which one you made.

Course machinery, not a chapter: each function takes the inputs of one exercise's check and returns
``{description: wrong result}`` for the mistakes learners typically make there, ready for
``kvlib.check.check(..., mistakes=...)``. A wrong result is a function of no arguments (the checker
calls it only when your answer fails), computed the way the mistaken code would compute it.
``tests/test_check.py`` feeds each mistake, written as a learner would write it, through the
checker and asserts that the report names it.
"""

from __future__ import annotations

import copy
import json
import math
import random

import torch

__all__ = [
    "n_programs", "offsets_and_mask", "axpy",
    "attention_one_head", "kv_head_for", "online_softmax",
    "greedy_naive", "recomputed_kv_rows", "top_k_sample",
    "append_kv", "decode_one", "decode_kernel", "merge_partials", "cached_greedy",
    "kv_bytes", "sequences_that_fit", "decode_step_time_floor",
    "allocator_step", "slot_of", "gather_kv", "paged_attention_one", "combine_blocks",
    "quantized_values", "quant_scales", "dequantize", "int8_attention_one",
    "repeat_kv", "gqa_attention", "mean_pool_kv",
    "admission", "preemption", "chunk_slots", "swap_or_recompute", "crossover",
    "sink_window_keep", "h2o_update", "snapkv_priority", "quantize_2bit", "quantize_keys_2bit",
    "absorbed_attention",
    "sse_transcript", "sse_reference", "read_sse", "collect_transcript", "collect_reference", "collect",
    "stream_transcript", "stream_reference", "stream_events",
    "paged_state", "truncate_transcript", "truncate_seq", "block_upper_bound",
    "accept_transcript", "speculative_accept",
]

NO_SQRT_D = "the scores are not divided by √D: scale q·k by 1/sqrt(D) before the softmax"
BY_D = "the scores are divided by D, not by √D"
GQA_MODULO = ("query head h read K/V head h % H_KV: the groups are consecutive heads, so it is "
              "K/V head h // (H // H_KV)")


# --------------------------------------------------------------------------------------------
# Lab 00 · first Triton kernel
# --------------------------------------------------------------------------------------------


def n_programs(cases):
    """cases: [(n, tile), ...]"""
    return {
        "n // tile rounds down: the last, partly filled tile gets no program": lambda: torch.tensor(
            [n // t for n, t in cases]),
        "n // tile + 1 is one program too many when n is a multiple of tile": lambda: torch.tensor(
            [n // t + 1 for n, t in cases]),
        "math.ceil(n / tile) goes through a float, which cannot hold every large n exactly: "
        "stay with integers, (n + tile - 1) // tile": lambda: torch.tensor([math.ceil(n / t) for n, t in cases]),
    }


def offsets_and_mask(pid, n, tile):
    base = pid * tile + torch.arange(tile)
    return {
        "the mask keeps offset n too (<= instead of <): the last valid index is n - 1": lambda: [base, base <= n],
        "the offsets start at pid, not at pid * tile: each program owns a whole tile": lambda: [
            pid + torch.arange(tile), pid + torch.arange(tile) < n],
        "the offsets ignore pid: every program would read the first tile": lambda: [
            torch.arange(tile), torch.arange(tile) < n],
    }


def axpy(alpha, x, y):
    return {
        "alpha is missing: the result is x + y": lambda: x + y,
        "alpha multiplies y instead of x": lambda: x + alpha * y,
        "alpha multiplies x + y": lambda: alpha * (x + y),
    }


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


# --------------------------------------------------------------------------------------------
# Lab 02 · naive decoding
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_naive(model, prompt_ids, n, reference):
    def first_position():
        ids = list(prompt_ids)
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, 0].argmax()))
        return ids[len(prompt_ids):]

    def never_grows():
        return [int(model(torch.tensor([list(prompt_ids)]))[0, -1].argmax())] * n

    return {
        "the next token comes from the logits of the first position, logits[0, 0]; the prediction for the "
        "next token is at the last one, logits[0, -1]": first_position,
        "the sequence never grows, so every step predicts the same token: append each new token to ids": never_grows,
        "the prompt is returned too: return only the n new tokens": lambda: list(prompt_ids) + [
            int(t) for t in reference],
    }


def recomputed_kv_rows(cases):
    """cases: [(prompt_len, n_new), ...]"""
    naive = [n * p + n * (n - 1) // 2 for p, n in cases]
    minimum = [p + n - 1 for p, n in cases]
    return {
        "the minimum counts the last new token too: it is never fed to the model, so prompt_len + n_new - 1":
            lambda: torch.tensor([[a, p + n] for a, (p, n) in zip(naive, cases)]),
        "the naive count is one step off: step i feeds prompt_len + i tokens for i = 0 … n_new - 1, "
        "not i = 1 … n_new": lambda: torch.tensor(
            [[n * p + n * (n + 1) // 2, b] for b, (p, n) in zip(minimum, cases)]),
        "the naive count uses the final length at every step, n_new * (prompt_len + n_new); the sequence "
        "grows one token per step": lambda: torch.tensor([[n * (p + n), b] for b, (p, n) in zip(minimum, cases)]),
    }


def top_k_sample(logits, k, temperature, seed, draws):
    from .generate import sample_next

    def sample(t, kk):
        g = torch.Generator().manual_seed(seed)
        return torch.stack([sample_next(logits, t, top_k=kk, generator=g) for _ in range(draws)])

    out = {
        "the temperature is not used: divide the logits by it before the softmax": lambda: sample(1.0, k),
        "the logits are multiplied by the temperature; divide them by it": lambda: sample(1 / temperature, k),
        "one token too many survives the top-k mask: keep exactly the k largest logits": lambda: sample(
            temperature, k + 1),
        "the draw is greedy (argmax); sample with torch.multinomial(probs, 1, generator=generator)": lambda: (
            logits.argmax(dim=-1).expand(draws, -1)),
    }
    if k > 1:
        out["one token too few survives: the mask drops the k-th largest too (mask logits < kth, not <= kth)"] = (
            lambda: sample(temperature, k - 1))
    return out


# --------------------------------------------------------------------------------------------
# Lab 03 · the KV cache
# --------------------------------------------------------------------------------------------


def append_kv(cache_before, new, seq_lens):
    """The cache (B, H_KV, S_max, D) as each mistake leaves it; ``new`` is (B, H_KV, 1, D)."""
    S_max = cache_before.shape[2]

    def write(assign):
        out = cache_before.clone()
        for b in range(new.shape[0]):
            assign(out, b, int(seq_lens[b]))
        return out

    def minus_one(out, b, s):
        out[b, :, s - 1] = new[b, :, 0]

    def plus_one(out, b, s):
        if s + 1 < S_max:  # past the end, the learner's code raises an IndexError instead
            out[b, :, s + 1] = new[b, :, 0]

    def to_the_end(out, b, s):
        out[b, :, s:] = new[b]

    def head_zero(out, b, s):
        out[b, 0, s] = new[b, 0, 0]

    def first_length(out, b, s):
        out[b, :, int(seq_lens[0])] = new[b, :, 0]

    return {
        "each row went to position seq_lens[b] - 1, over the last filled row (and, for an empty sequence, to "
        "row -1: the end of the buffer); the first free row is seq_lens[b]": lambda: write(minus_one),
        "each row went to position seq_lens[b] + 1, which skips a row: the first free row is seq_lens[b]": (
            lambda: write(plus_one)),
        "every row from seq_lens[b] to the end was written (a slice s: instead of the single row s)": lambda: write(
            to_the_end),
        "only K/V head 0 was written: index the cache as [b, :, s] to write every head at once": lambda: write(
            head_zero),
        "every sequence used seq_lens[0]: each sequence has its own length": lambda: write(first_length),
    }


def _decode(q, k_cache, v_cache, lens, *, scale=None, head=None):
    """Decode attention over rows 0 .. lens[b]-1 (fp32), with a configurable scale and head mapping."""
    q, k_cache, v_cache = q.cpu(), k_cache.cpu(), v_cache.cpu()
    B, H, D = q.shape
    H_KV = k_cache.shape[1]
    scale = 1 / math.sqrt(D) if scale is None else scale
    head = head or (lambda h: h // (H // H_KV))
    out = torch.empty(B, H, D)
    for b in range(B):
        L = int(lens[b])
        for h in range(H):
            k, v = k_cache[b, head(h), :L].float(), v_cache[b, head(h), :L].float()
            s = k @ q[b, h].float() * scale
            out[b, h] = torch.softmax(s, dim=-1) @ v
    return out.to(q.dtype)


def decode_one(q, k_cache, v_cache, seq_lens):
    D, S_max = q.shape[-1], k_cache.shape[2]
    H, H_KV = q.shape[1], k_cache.shape[1]
    lens = [int(n) for n in seq_lens]
    out = {
        NO_SQRT_D: lambda: _decode(q, k_cache, v_cache, lens, scale=1.0),
        BY_D: lambda: _decode(q, k_cache, v_cache, lens, scale=1 / D),
        "all S_max positions were read: rows seq_lens[b] … S_max - 1 are leftovers; read only [:seq_lens[b]]":
            lambda: _decode(q, k_cache, v_cache, [S_max] * len(lens)),
        "one row too many was read (:L + 1): positions 0 … L - 1 are the filled ones": lambda: _decode(
            q, k_cache, v_cache, [min(n + 1, S_max) for n in lens]),
        "the last filled row was left out (:L - 1): positions 0 … L - 1 are the filled ones": lambda: _decode(
            q, k_cache, v_cache, [n - 1 for n in lens]),
    }
    if 1 < H_KV < H:
        out[GQA_MODULO] = lambda: _decode(q, k_cache, v_cache, lens, head=lambda h: h % H_KV)
    return out


def _tiled_decode(q, k_cache, v_cache, seq_lens, tile, *, rescale=True, rescale_l=True, rescale_acc=True,
                  update_m=True, mask_scores=True, mask_loads=True, scale=None):
    """The decode kernel's loop over tiles of ``tile`` positions, one (sequence, head) at a time."""
    q, k_cache, v_cache = q.cpu(), k_cache.cpu(), v_cache.cpu()
    B, H, D = q.shape
    H_KV, S_max = k_cache.shape[1], k_cache.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = torch.empty(B, H, D)
    for b in range(B):
        L = int(seq_lens[b])
        for h in range(H):
            kh = h // (H // H_KV)
            m, l, acc = torch.tensor(-1e30), torch.tensor(0.0), torch.zeros(D)
            for start in range(0, L, tile):
                pos = torch.arange(start, start + tile)
                ok = pos < L
                inside = pos < S_max  # rows past the buffer: the interpreter reads them as zeros here
                loaded = ok if mask_loads else inside
                k = torch.zeros(tile, D)
                v = torch.zeros(tile, D)
                k[loaded] = k_cache[b, kh, pos[loaded]].float()
                v[loaded] = v_cache[b, kh, pos[loaded]].float()
                s = k @ q[b, h].float() * scale
                if mask_scores and mask_loads:
                    s = torch.where(ok, s, torch.tensor(float("-inf")))
                elif mask_scores:
                    s = torch.where(inside, s, torch.tensor(float("-inf")))
                m_new = torch.maximum(m, s.max())
                alpha = torch.exp(m - m_new) if rescale else torch.tensor(1.0)
                p = torch.exp(s - m_new)
                l = (l * alpha if rescale_l else l) + p.sum()
                acc = (acc * alpha if rescale_acc else acc) + p @ v
                if update_m:
                    m = m_new
            out[b, h] = acc / l
    return out.to(q.dtype)


def decode_kernel(q, k_cache, v_cache, seq_lens, tile):
    """Mistakes in the Triton decode kernel's inner loop (lab 03), on top of decode_one's."""
    out = decode_one(q, k_cache, v_cache, seq_lens)
    del out["the last filled row was left out (:L - 1): positions 0 … L - 1 are the filled ones"]
    out["one row too many was read: the mask must be pos < L, not pos <= L"] = out.pop(
        "one row too many was read (:L + 1): positions 0 … L - 1 are the filled ones")
    del out["all S_max positions were read: rows seq_lens[b] … S_max - 1 are leftovers; read only [:seq_lens[b]]"]
    out.update({
        "acc and l are never rescaled by alpha = exp(m_i - m_new) when the running max grows": lambda: _tiled_decode(
            q, k_cache, v_cache, seq_lens, tile, rescale=False),
        "acc is not rescaled by alpha (l_i is): when a tile raises the running max, what acc summed under the old "
        "max must be re-expressed under the new one too, acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)":
            lambda: _tiled_decode(q, k_cache, v_cache, seq_lens, tile, rescale_acc=False),
        "l_i is not rescaled by alpha (acc is): the running sum was taken under the old max as well, "
        "l_i = l_i * alpha + tl.sum(p, axis=0)": lambda: _tiled_decode(
            q, k_cache, v_cache, seq_lens, tile, rescale_l=False),
        "m_i is never updated (m_i = m_new is missing)": lambda: _tiled_decode(
            q, k_cache, v_cache, seq_lens, tile, update_m=False),
        "positions L … (end of the last tile) are not masked: they hold leftovers and must count for nothing; "
        "tl.where(pos < L, s, float('-inf')) for the scores (and mask=pos < L for the loads)": lambda: _tiled_decode(
            q, k_cache, v_cache, seq_lens, tile, mask_loads=False),
        "the loads are masked but the scores are not: a masked-out position scores 0 (from other=0.0), not "
        "-inf, and exp(0 - m) still adds to l; tl.where(pos < L, s, float('-inf'))": lambda: _tiled_decode(
            q, k_cache, v_cache, seq_lens, tile, mask_scores=False),
    })
    return out


def merge_partials(o1, lse1, o2, lse2):
    def merged(w1, w2, normalise=True):
        w1, w2 = w1[..., None], w2[..., None]
        return (w1 * o1 + w2 * o2) / ((w1 + w2) if normalise else 1)

    m = torch.maximum(lse1, lse2)
    return {
        "the two partials are averaged, (o1 + o2) / 2: each must weigh by its share exp(lse_i) of the total "
        "softmax sum": lambda: (o1 + o2) / 2,
        "the two partials are added, o1 + o2: each is already normalised over its own range": lambda: o1 + o2,
        "the weighted sum is not divided by the sum of the weights w1 + w2": lambda: merged(
            torch.exp(lse1 - m), torch.exp(lse2 - m), normalise=False),
        "the weights are lse_i themselves; the weights are exp(lse_i - m)": lambda: merged(lse1, lse2),
        "exp(lse) overflows without subtracting the larger lse first: w_i = exp(lse_i - max(lse1, lse2))":
            lambda: merged(torch.exp(lse1), torch.exp(lse2)),
    }


@torch.no_grad()
def cached_greedy(model, prompt_ids, n, reference):
    from .cache import KVCache

    def run(position):
        cache = KVCache.for_model(model, 1, len(prompt_ids) + n + 1)
        logits = model(torch.tensor([list(prompt_ids)]), cache=cache)[:, -1]
        new = []
        for _ in range(n):
            nxt = logits.argmax(dim=-1)
            new.append(int(nxt))
            pos = position(cache)
            logits = model(nxt[:, None], positions=pos, cache=cache)[:, -1]
        return new

    return {
        "the new tokens have no positions=, so the model puts each one at position 0: pass "
        "positions=cache.seq_lens.long()[:, None]": lambda: run(lambda cache: None),
        "each new token's position is one too large (seq_lens + 1): a new token's position is the number of "
        "tokens already stored, seq_lens": lambda: run(lambda cache: cache.seq_lens.long()[:, None] + 1),
        "each new token's position is one too small (seq_lens - 1): that is the previous token's position":
            lambda: run(lambda cache: cache.seq_lens.long()[:, None] - 1),
        "the prompt is returned too: return only the n new tokens": lambda: list(prompt_ids) + [
            int(t) for t in reference],
    }


# --------------------------------------------------------------------------------------------
# Lab 04 · KV memory
# --------------------------------------------------------------------------------------------


def kv_bytes(cases):
    """cases: [(n_layers, n_kv_heads, head_dim, seq_len, batch, bytes_per_element), ...]"""

    def each(f):
        return lambda: torch.tensor([f(*c) for c in cases])

    return {
        "the factor 2 is missing: every layer stores a key AND a value per head and token": each(
            lambda L, h, d, s, b, e: L * h * d * s * b * e),
        "batch is missing: each sequence of the batch has its own cache": each(
            lambda L, h, d, s, b, e: 2 * L * h * d * s * e),
        "bytes_per_element is missing: that counts numbers, not bytes": each(
            lambda L, h, d, s, b, e: 2 * L * h * d * s * b),
        "the result is in bits (× 8); count bytes": each(lambda L, h, d, s, b, e: 16 * L * h * d * s * b * e),
    }


def sequences_that_fit(cases):
    """cases: [(gpu_bytes, weight_bytes, bytes_per_sequence), ...]"""

    def each(f):
        return lambda: torch.tensor([f(*c) for c in cases])

    return {
        "no max(0, ...): when the weights alone exceed the GPU, nothing fits (0), not a negative number": each(
            lambda g, w, s: (g - w) // s),
        "the quotient is rounded to the nearest integer; a sequence fits only whole, so round down (//)": each(
            lambda g, w, s: max(0, round((g - w) / s))),
        "the quotient is rounded up; a sequence fits only whole, so round down (//)": each(
            lambda g, w, s: max(0, -(-(g - w) // s))),
        "the weights are not subtracted: they are loaded first, only the rest holds KV caches": each(
            lambda g, w, s: g // s),
    }


def decode_step_time_floor(cases, kv_of):
    """cases: [(spec, batch, context, bandwidth), ...]; ``kv_of(spec, context, batch)``: KV bytes."""

    def each(f):
        return lambda: torch.tensor([f(m, b, c, bw) for m, b, c, bw in cases], dtype=torch.float64)

    w = lambda m: m.weight_bytes("fp16")  # noqa: E731
    return {
        "the KV cache of one sequence only: a step reads the cache of every sequence in the batch": each(
            lambda m, b, c, bw: (w(m) + kv_of(m, c, 1)) / bw),
        "the weights are read once per sequence; the whole batch shares one pass over them": each(
            lambda m, b, c, bw: (b * w(m) + kv_of(m, c, b)) / bw),
        "the weights are missing: a step reads every weight once": each(lambda m, b, c, bw: kv_of(m, c, b) / bw),
        "the KV cache is missing: a step also reads every sequence's cached K/V": each(lambda m, b, c, bw: w(m) / bw),
    }


# --------------------------------------------------------------------------------------------
# Lab 05 · paged KV
# --------------------------------------------------------------------------------------------


def allocator_step(call: str, yours: str, reference: str) -> str:
    """A diagnosis for the first step where a learner's allocator and the reference disagree."""
    op = call.split("(")[0]
    if reference == "OutOfBlocksError" and yours != reference:
        if yours.endswith("Error"):
            return f"raise OutOfBlocksError when too few blocks are free, not {yours}"
        return "allocate must raise OutOfBlocksError when fewer than n blocks are free (and change nothing)"
    if reference == "ValueError" and yours != reference:
        return (f"{op} of an id that is not in the pool, or of a free block, must raise ValueError: "
                "call self._check(block) first")
    if op == "allocate" and reference.startswith("[") and yours.startswith("["):
        if sorted(eval(yours)) == sorted(eval(reference)):  # noqa: S307 - our own repr of a list of ints
            return "the right blocks in the wrong order: pop them one by one from the end of _free"
        return "other blocks than the reference's: _free is a stack, pop() from its end (and free pushes on it)"
    if op == "free" and reference in ("True", "False") and yours not in ("True", "False"):
        return "free must return True when the block went back to the pool, False while others still use it"
    if op == "free" and {yours, reference} == {"True", "False"}:
        return ("free returned the wrong bool: a block goes back to the pool (True) only when its count "
                "reaches 0")
    return ""


def slot_of(table, n_tokens, block_size):
    def each(f):
        return lambda: torch.tensor([f(pos) for pos in range(n_tokens)])

    return {
        "the block table is not used: logical block pos // block_size is not where the data is; look up "
        "block_table[pos // block_size]": each(lambda pos: pos),
        "the block is not multiplied by block_size: block b's rows start at slot b * block_size": each(
            lambda pos: table[pos // block_size] + pos % block_size),
        "a global offset inside the block (the source article's mistake): the row inside block "
        "block_table[i] is pos % block_size, not pos": each(lambda pos: table[pos // block_size] * block_size + pos),
    }


def gather_kv(k_blocks, table, seq_len):
    bs = k_blocks.shape[1]
    n = -(-seq_len // bs)
    return {
        "the block table is not used: the pool's blocks 0, 1, 2 … are not the sequence's; read "
        "k_blocks[block_table[pos // block_size], pos % block_size]": lambda: k_blocks.reshape(
            -1, *k_blocks.shape[2:])[:seq_len],
        f"whole blocks were gathered ({n * bs} rows); only the first seq_len = {seq_len} positions belong to the "
        "sequence": lambda: k_blocks[table.long()[:n]].reshape(-1, *k_blocks.shape[2:]),
    }


def paged_attention_one(q, k_blocks, v_blocks, table, seq_len):
    bs, H_KV = k_blocks.shape[1], k_blocks.shape[2]

    def gathered(L, ignore_table=False):
        pos = torch.arange(L)
        blocks = pos // bs if ignore_table else table.long()[pos // bs]
        k = k_blocks[blocks, pos % bs].transpose(0, 1)[None]  # (1, H_KV, L, D)
        v = v_blocks[blocks, pos % bs].transpose(0, 1)[None]
        return k, v

    def run(L=seq_len, ignore_table=False, **kw):
        k, v = gathered(L, ignore_table)
        return _decode(q[None], k, v, [L], **kw)[0]

    full = -(-seq_len // bs) * bs
    out = {
        NO_SQRT_D: lambda: run(scale=1.0),
        "the block table is not used: the pool's blocks 0, 1, 2 … are not the sequence's": lambda: run(
            ignore_table=True),
        f"the whole last block was read ({full} positions): only seq_len = {seq_len} are the sequence's": lambda: run(
            full),
    }
    if 1 < H_KV < q.shape[0]:
        out[GQA_MODULO] = lambda: run(head=lambda h: h % H_KV)
    return out


def combine_blocks(outs, lses):
    m = lses.max(dim=0).values
    w = torch.exp(lses - m)[..., None]
    return {
        "the blocks' outputs are averaged: each must weigh by its share exp(lse_i) of the total softmax sum":
            lambda: outs.mean(dim=0),
        "the blocks' outputs are added: each is already normalised over its own block": lambda: outs.sum(dim=0),
        "the weighted sum is not divided by the sum of the weights": lambda: (w * outs).sum(dim=0),
        "the weights are lse_i themselves; the weights are exp(lse_i - m)": lambda: (
            lses[..., None] * outs).sum(dim=0) / lses[..., None].sum(dim=0),
    }


# --------------------------------------------------------------------------------------------
# Lab 06 · INT8 KV
# --------------------------------------------------------------------------------------------


def _groups(x, dim):
    return tuple(range(x.dim())) if dim is None else dim


def _quant(x, dim, *, rounding="away", levels=127, absolute=True, zero_scale=1.0):
    amax = (x.float().abs() if absolute else x.float()).amax(dim=_groups(x, dim), keepdim=True)
    scale = torch.where(amax > 0, amax / levels, torch.full_like(amax, zero_scale))
    y = x.float() / scale
    if rounding == "away":
        r = torch.sign(y) * torch.floor(y.abs() + 0.5)
    elif rounding == "even":
        r = torch.round(y)
    elif rounding == "up":
        r = torch.floor(y + 0.5)
    else:  # truncation, what .to(torch.int8) does by itself
        r = torch.trunc(y)
    return r.clamp(-127, 127).nan_to_num(0).to(torch.int8), scale


TORCH_ROUND = ("torch.round rounds half to even (2.5 -> 2); the store kernel rounds half away from zero: "
               "sign(y) * floor(|y| + 0.5)")


def quantized_values(x, dim):
    return {
        "x / scale is converted with .to(torch.int8) without rounding, which truncates toward zero: round first, "
        "sign(y) * floor(|y| + 0.5)": lambda: _quant(x, dim, rounding="trunc")[0],
        TORCH_ROUND: lambda: _quant(x, dim, rounding="even")[0],
        "floor(y + 0.5) rounds -2.5 up to -2; round half away from zero: sign(y) * floor(|y| + 0.5)": lambda: _quant(
            x, dim, rounding="up")[0],
        "the scale is amax / 128; the largest magnitude must map to 127": lambda: _quant(x, dim, levels=128)[0],
        "the scale is amax / 255 (that is for unsigned 8-bit); symmetric int8 maps amax to 127": lambda: _quant(
            x, dim, levels=255)[0],
        "the max is taken of x, not of |x|: a group whose largest magnitude is negative gets the wrong scale":
            lambda: _quant(x, dim, absolute=False)[0],
    }


def quant_scales(x, dim):
    return {
        "the scale is amax / 128; the largest magnitude must map to 127": lambda: _quant(x, dim, levels=128)[1],
        "the scale is amax / 255 (that is for unsigned 8-bit); symmetric int8 maps amax to 127": lambda: _quant(
            x, dim, levels=255)[1],
        "the max is taken of x, not of |x|": lambda: _quant(x, dim, absolute=False)[1],
        "an all-zero group got scale 0: give it scale 1 (its values are 0 anyway), or x / scale is 0/0": lambda: _quant(
            x, dim, zero_scale=0.0)[1],
        "the scale is amax itself; it is amax / 127": lambda: _quant(x, dim, levels=1)[1],
    }


def dequantize(q, scale):
    return {"q is divided by the scale; x_hat = q * scale": lambda: q.float() / scale}


def int8_attention_one(q, k_q, k_scale, v_q, v_scale, L):
    from .quant import int8_decode_attention_ref

    one = lambda t: t[None, None]  # noqa: E731

    def ref(ks=k_scale, vs=v_scale, qq=q, length=L):
        return int8_decode_attention_ref(one(qq), one(k_q), one(ks), one(v_q), one(vs), torch.tensor([length]))[0, 0]

    ones = torch.ones_like(k_scale)
    return {
        "V's scale is missing: each row's probability must be multiplied by v_scale[s] (the values are int8 "
        "multiples of it)": lambda: ref(vs=ones),
        "K's scale is missing: each row's score must be multiplied by k_scale[s]": lambda: ref(ks=ones),
        "both scales are missing: the int8 numbers are multiples of their row's scale": lambda: ref(ones, ones),
        "K's scale was used for V too: V has scales of its own": lambda: ref(vs=k_scale),
        NO_SQRT_D: lambda: ref(qq=q * math.sqrt(q.shape[0])),
        "all S rows were read: only the first L are valid": lambda: ref(length=k_q.shape[0]),
    }


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


# --------------------------------------------------------------------------------------------
# Lab 08 · serving
# --------------------------------------------------------------------------------------------


def _admit(step, *, watermark=True, when_idle=False, stop=True, cached=True, round_up=True, extra=0,
           accumulate=True):
    """Which waiting requests (queue indices) one scheduler step admits, under a configurable rule."""
    bs = step["block_size"]
    reserve = int(step["watermark"] * step["num_blocks"]) if watermark else 0
    committed, running = sum(step["running_needs"]), len(step["running_needs"])
    admitted = []
    for i, (n_tokens, cached_tokens) in enumerate(step["waiting"]):
        blocks = -(-(n_tokens + extra) // bs) if round_up else (n_tokens + extra) // bs
        need = blocks - (cached_tokens // bs if cached else 0)
        left = step["free_blocks"] - committed - (reserve if running or when_idle else 0)
        if need <= left:
            admitted.append(i)
            running += 1
            committed += need if accumulate else 0
        elif stop:
            break
    return admitted


def admission_flags(decisions, width):
    """Per step, a row of ``width`` flags: True for each queue position admitted (steps, width)."""
    out = torch.zeros(len(decisions), width, dtype=torch.bool)
    for s, admitted in enumerate(decisions):
        for i in admitted:
            out[s, i] = True
    return out


def admission(trace):
    """trace: the steps of an engine run, each a dict of admit()'s arguments."""
    width = max(len(s["waiting"]) for s in trace)

    def each(**rule):
        return lambda: admission_flags([_admit(s, **rule) for s in trace], width)

    return {
        "the watermark is ignored: with requests running, leave int(watermark * num_blocks) blocks free for "
        "them to grow into": each(watermark=False),
        "the watermark is kept even when nothing runs: a request that needs almost the whole pool would then "
        "never get in (the engine would stall)": each(when_idle=True),
        "admission skips a request that does not fit and tries the next ones: first come, first served stops "
        "at the first misfit, or a long request could wait forever behind short ones": each(stop=False),
        "the cached tokens are counted as needing blocks: blocks of a cached prefix are shared, not taken from "
        "the pool; subtract cached_tokens // block_size": each(cached=False),
        "the blocks are rounded down (n_tokens // block_size): a partly filled last block is still a block, "
        "ceil(n_tokens / block_size)": each(round_up=False),
        "one position too many (n_tokens + 1): the engine stores a generated token only at the next step, "
        "when it counts among the running requests' pending tokens": each(extra=1),
        "an admitted request's blocks are not added to what the running requests need: the next candidate "
        "in the same step must fit beside it too": each(accumulate=False),
    }


def _preempt(step, *, victim="newest", release=True, promise=True):
    """Which running requests (ids, in order) one step preempts, under a configurable rule."""
    free, alive, victims, promised = step["free_blocks"], list(step["running"]), [], 0
    for r in step["running"]:
        rid, _, need = r
        if rid in victims:
            continue
        while need > free - (promised if promise else 0):
            others = [x for x in alive if x[0] != rid]
            if victim == "newest":
                v = alive[-1]
            elif victim == "oldest":
                v = others[0] if others else r
            elif victim == "first":  # alive.pop(0): the oldest still running, the asking request included
                v = alive[0]
            elif victim == "self":
                v = r
            else:  # the one holding the most blocks
                v = max(alive, key=lambda x: (x[1], x[0]))
            alive.remove(v)
            victims.append(v[0])
            free += v[1] if release else 0
            if v[0] == rid:
                break
        else:
            promised += need
    return victims


def preemption_flags(decisions, trace):
    """Per step and running position, the order (1, 2 ...) in which it was preempted, 0 if not (steps, width)."""
    width = max(len(s["running"]) for s in trace)
    out = torch.zeros(len(decisions), width, dtype=torch.int64)
    for s, (victims, step) in enumerate(zip(decisions, trace)):
        ids = [r[0] for r in step["running"]]
        for order, rid in enumerate(victims, start=1):
            out[s, ids.index(rid)] = order
    return out


def preemption(trace):
    """trace: decode-only steps of an engine run, each {"free_blocks", "running": [(id, held, need)]}."""

    def each(**rule):
        return lambda: preemption_flags([_preempt(s, **rule) for s in trace], trace)

    return {
        "the oldest request was preempted: the newest gives way, so the requests that have waited longest "
        "finish first": each(victim="oldest"),
        "the oldest running request was preempted (alive.pop(0), which is the asking request itself when it is "
        "the oldest): the newest gives way, alive.pop(), so the requests that have waited longest finish first":
            each(victim="first"),
        "the request that asked for a block preempted itself although newer ones were running: the newest "
        "running request gives way, and the asking one only when it is the newest": each(victim="self"),
        "the request holding the most blocks was preempted: the engine's rule is by age, newest first": each(
            victim="longest"),
        "a preempted request's blocks were not given back: after preempting, its held blocks are free "
        "again (free_blocks += held)": each(release=False),
        "the blocks promised to older requests in this step were not subtracted: each request must fit in "
        "free_blocks minus what the older ones already took": each(promise=False),
    }


def chunk_slots(cases):
    """cases: [(block_table, block_size, seq_len, T), ...]; the slots of all chunks, concatenated."""

    def each(f):
        return lambda: torch.tensor([f(table, bs, L, i) for table, bs, L, T in cases for i in range(T)])

    return {
        "a global offset inside the block (the source article's paged sketch): the row inside block "
        "block_table[p // block_size] is p % block_size, not p": each(
            lambda t, bs, L, i: t[(L + i) // bs] * bs + L + i),
        "the chunk's positions start at 0: they start at seq_len, the tokens already in the cache": each(
            lambda t, bs, L, i: t[i // bs] * bs + i % bs),
        "the block table is not used: logical block p // block_size is not where the data is; look up "
        "block_table[p // block_size]": each(lambda t, bs, L, i: L + i),
        "the block is not multiplied by block_size: block b's rows start at slot b * block_size": each(
            lambda t, bs, L, i: t[(L + i) // bs] + (L + i) % bs),
    }


def _swap_or_recompute(prompt_len, generated, prefill_s, bytes_per_token, bandwidth, *, ways=2, recomputed=None,
                       mixed=None):
    n = prompt_len + generated
    recompute = prefill_s(n if recomputed is None else recomputed(prompt_len, generated))
    swap = ways * n * bytes_per_token / bandwidth
    if mixed == "recompute per token":
        recompute /= n
    elif mixed == "swap per token":
        swap /= n
    return "swap" if swap < recompute else "recompute"


def _cost_variants():
    return {
        "swap is counted one way only: a swapped-out request's K/V go to host memory and come back, "
        "2 × n × bytes_per_token / bandwidth": dict(ways=1),
        "recompute re-prefills the prompt only: a recompute-preempted request computes its prompt AND the "
        "tokens it had generated again (n = prompt_len + generated)": dict(recomputed=lambda p, g: p),
        "recompute's time per token is compared with swap's total time: compare the totals for all n tokens":
            dict(mixed="recompute per token"),
        "recompute's total time is compared with swap's time per token: compare the totals for all n tokens":
            dict(mixed="swap per token"),
    }


def swap_or_recompute(cases, prefill_s, bytes_per_token, bandwidth):
    """cases: [(prompt_len, generated), ...]; the check compares ``choice == "swap"`` per case."""
    return {what: (lambda kw=kw: torch.tensor([
        _swap_or_recompute(p, g, prefill_s, bytes_per_token, bandwidth, **kw) == "swap" for p, g in cases]))
            for what, kw in _cost_variants().items()}


def crossover(prefill_s, bytes_per_token, bandwidth, max_len):
    def first(**kw):
        return lambda: next((n for n in range(1, max_len + 1)
                             if _swap_or_recompute(n, 0, prefill_s, bytes_per_token, bandwidth, **kw) == "swap"), None)

    out = {what: first(**kw) for what, kw in _cost_variants().items() if "recomputed" not in kw}
    out["the last length where recompute is cheaper, one too few: the crossover is the first n where swap "
        "is cheaper"] = lambda: (first()() or 1) - 1
    return out


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
    from . import lowbit

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


# --------------------------------------------------------------------------------------------
# Lab 10 · HTTP serving: a stream's two ends
# --------------------------------------------------------------------------------------------
# Results here are transcripts (lists of text lines) for kvlib.check.check_lines: what a parser read,
# what a stream generator sent and called. A learner's exception is part of the transcript ("raised
# KeyError"), except NotImplementedError (an exercise not written yet), which goes through.


def _sse_splits(raw: str) -> dict:
    """The network's ways of cutting a stream into chunks: whole, one character each, at random points."""
    rng = random.Random(len(raw))  # the same cuts on every run
    cuts = sorted(rng.sample(range(1, len(raw)), min(len(raw) - 1, max(1, len(raw) // 6))))
    return {"in one chunk": [raw], "a character at a time": list(raw),
            "cut at random points": [raw[a:b] for a, b in zip([0] + cuts, cuts + [len(raw)])]}


def _payload(obj) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False)


def sse_transcript(read_sse, cases) -> list[str]:
    """What ``read_sse`` reads from each case, cut three ways; cases: {name: (raw text, ...)}."""
    lines = []
    for name, (raw, *_) in cases.items():
        for split, chunks in _sse_splits(raw).items():
            where = f"{name}, {split}:"
            try:
                for event in read_sse(iter(chunks)):
                    lines.append(f"{where} {_payload(event)}")
                lines.append(f"{where} ended")
            except NotImplementedError:
                raise
            except Exception as err:  # noqa: BLE001 - a wrong parser's error is part of its answer
                lines.append(f"{where} raised {_parser_error(err)}")
    return lines


def _parser_error(err) -> str:
    """RuntimeError (the spec's), JSONDecodeError (data that is not JSON), or any other, as one kind: which
    other error a wrong parser raises depends on how it was written, not on the mistake."""
    if isinstance(err, RuntimeError):
        return "RuntimeError"
    if isinstance(err, json.JSONDecodeError):
        return "JSONDecodeError"
    return "an error of its own (not RuntimeError)"


def sse_reference(cases) -> list[str]:
    """The transcript a right parser gives: cases {name: (raw text, expected payloads, "ended" or "raised ...")}."""
    lines = []
    for name, (raw, payloads, ending) in cases.items():
        for split in _sse_splits(raw):
            lines += [f"{name}, {split}: {_payload(p)}" for p in payloads] + [f"{name}, {split}: {ending}"]
    return lines


def _read_sse(chunks, *, buffered=True, per_line=False, space=False, done=True, error=True, cut=True, crlf=True,
              empty=False):
    """An SSE reader with one mistake switched on (the right one with none)."""
    buffer, data = "", []

    def lines_of(chunk):
        nonlocal buffer
        if not buffered:  # each chunk on its own, its last piece taken as a whole line
            return chunk.splitlines()
        buffer += chunk
        *whole, buffer = buffer.split("\n")
        return whole

    def dispatch(payload):
        if done and payload == "[DONE]":
            return "done"
        event = json.loads(payload)
        if error and "error" in event:
            raise RuntimeError(f"the server sent an error: {event['error']}")
        return event

    for chunk in chunks:
        for line in lines_of(chunk):
            if crlf:
                line = line.removesuffix("\r")
            if line == "":
                if data or empty:
                    out, data = dispatch("\n".join(data)), []
                    if out == "done":
                        return
                    yield out
            elif not line.startswith(":"):
                if space:
                    field, value = ("data", line[6:]) if line.startswith("data: ") else (None, "")
                else:
                    field, _, value = line.partition(":")
                    value = value.removeprefix(" ")
                if field == "data":
                    if per_line:  # each data line taken as a whole event
                        out = dispatch(value)
                        if out == "done":
                            return
                        yield out
                    else:
                        data.append(value)
    if cut:
        raise RuntimeError("the stream ended before data: [DONE]")


def read_sse(cases):
    """cases: {name: (raw text, ...)}; the transcripts of the usual wrong SSE readers."""
    def each(**mistake):
        return lambda: sse_transcript(lambda chunks: _read_sse(chunks, **mistake), cases)

    return {
        "each network chunk was split into lines on its own: a chunk can end in the middle of a line or an event, "
        "so keep what is left after the last newline and put the next chunk after it": each(buffered=False),
        "each data: line was taken as a whole event: an event ends at a blank line, and its data lines join with "
        "\"\\n\" between them": each(per_line=True),
        "only \"data: \" with a space was read: the space after the colon is optional (\"data:x\" is data x)": each(
            space=True),
        "data: [DONE] was read as JSON: it is not an event but the end of the stream; stop there": each(done=False),
        "an error event was passed on as a chunk: {\"error\": ...} means the server gave up on the request; raise "
        "RuntimeError with its message": each(error=False),
        "a stream cut off before [DONE] ended quietly: without [DONE] the answer is incomplete; raise RuntimeError "
        "when the chunks run out": each(cut=False),
        "the \\r of a CRLF line end was kept: a line \"\\r\" is blank too, strip one \\r before the \\n": each(
            crlf=False),
        "a blank line with no data before it was taken as an event: keep-alive blank lines dispatch nothing": each(
            empty=True),
    }


def collect_transcript(collect, cases) -> list[str]:
    """What ``collect`` makes of each case's events; cases: {name: (events, ...)}."""
    lines = []
    for name, (events, *_) in cases.items():
        try:
            out = collect(copy.deepcopy(events))
        except NotImplementedError:
            raise
        except Exception as err:  # noqa: BLE001
            lines.append(f"{name}: raised {type(err).__name__}")
            continue
        if not isinstance(out, dict):
            lines.append(f"{name}: returned a {type(out).__name__}, not a dict")
            continue
        lines += [f"{name}: {key} {out.get(key)!r}" for key in ("text", "token_ids", "finish_reason")]
    return lines


def collect_reference(cases) -> list[str]:
    """cases: {name: (events, {"text": ..., "token_ids": ..., "finish_reason": ...})}."""
    return [f"{name}: {key} {want[key]!r}" for name, (_, want) in cases.items()
            for key in ("text", "token_ids", "finish_reason")]


def _collect(events, *, chat=True, first=False, content_key=False, skip_empty=False, join=True):
    text, ids, finish = "", [], None
    for event in events:
        for choice in [event["choices"][0]] if first else event["choices"]:
            if "delta" in choice and chat:
                piece = choice["delta"]["content"] if content_key else choice["delta"].get("content")
            else:
                piece = choice.get("text")
            piece = piece or ""
            if skip_empty and not piece:
                continue
            text = text + piece if join else piece
            ids += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
    return {"text": text, "token_ids": ids, "finish_reason": finish}


def collect(cases):
    """cases: {name: (events, expected)}; the transcripts of the usual wrong ways to put an answer together."""
    def each(**mistake):
        return lambda: collect_transcript(lambda events: _collect(events, **mistake), cases)

    return {
        "a chat chunk's text was looked for in choice[\"text\"]: chat chunks carry it in "
        "choice[\"delta\"][\"content\"]": each(chat=False),
        "choice[\"delta\"][\"content\"] was read on a chunk without it: the last chat chunk's delta is {}, use "
        ".get(\"content\")": each(content_key=True),
        "event[\"choices\"][0] was read on the usage chunk, whose choices are []: loop over the choices": each(
            first=True),
        "the chunks without text were skipped, and their token ids with them: a piece of a character has ids but "
        "no text yet": each(skip_empty=True),
        "each piece replaced the text so far: the pieces are deltas, join them": each(join=False),
    }


# The scenarios of stream_events: (name, engine messages, reader). A message None means "the client left";
# after the last message the engine sends nothing more (next_message waits). The reader takes every event
# ("all"), or ("close", n): n events, then aclose() (the server stopped iterating), or ("cancel", n): n
# events, then the task is cancelled while the generator waits (what Starlette does on a disconnect).


def stream_transcript(stream_events, scenarios, make_detok, timeout=2.0) -> list[str]:
    """What ``stream_events`` sends and calls in each scenario (run in a thread with its own event loop)."""
    import asyncio
    import concurrent.futures
    import inspect

    def framed(event):
        if not isinstance(event, str) or not event.startswith("data: ") or not event.endswith("\n\n") \
                or "\n" in event[:-2]:
            return (f"sent {event!r:.120}, not an event: send \"data: \" + the JSON + a blank line "
                    "(\"\\n\\n\"), on one line")
        payload = event[len("data: "):-2]
        if payload == "[DONE]":
            return "sent [DONE]"
        try:
            return f"sent {_payload(json.loads(payload))}"
        except ValueError:
            return f"sent {event!r:.120}, whose data is not JSON"

    async def run(messages, reader):
        log, queue = [], list(messages)

        async def next_message():
            await asyncio.sleep(0)  # a real await: the loop (and a timeout) can run
            if queue and queue[0] is None:
                return None  # the client left, and stays gone
            if queue:
                return queue.pop(0)
            await asyncio.Event().wait()  # the engine has nothing more: wait until cancelled

        def make_chunk(text=None, ids=None, finish=None, first=False):  # its arguments, those that are given
            given = dict(text=text, ids=ids, finish=finish, first=first)
            return {k: v for k, v in given.items() if v is not None and v is not False}

        gen = stream_events(next_message, make_detok(), make_chunk, lambda: log.append("abort()"))
        if inspect.iscoroutine(gen):  # no yield in it: the stub, or a coroutine by mistake
            await gen
            return log + ["returned without sending anything: stream_events must be an async generator (yield)"]
        kind, n = (reader, None) if reader == "all" else reader
        got = asyncio.Event()

        async def consume():
            async for event in gen:
                log.append(framed(event))
                if n is not None and sum(line.startswith("sent") for line in log) >= n:
                    got.set()
                    if kind == "close":
                        return
            log.append("the generator ended")

        task, waiter = asyncio.ensure_future(consume()), asyncio.ensure_future(got.wait())
        await asyncio.wait({task, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if task.done():
            err = task.exception()
            if isinstance(err, NotImplementedError):
                raise err
            if err is not None:
                log.append(f"raised {type(err).__name__}")
            elif kind == "close" and got.is_set():
                await gen.aclose()  # the server stopped iterating: the generator is closed at its yield
                log.append("closed by the reader")
        elif kind == "cancel" and got.is_set():
            await asyncio.sleep(0.01)  # let it wait for the engine again
            task.cancel()  # what Starlette does to the response task when the client disconnects
            try:
                await task
            except asyncio.CancelledError:
                log.append("cancelled while waiting")
            except NotImplementedError:
                raise
            except Exception as err:  # noqa: BLE001
                log.append(f"raised {type(err).__name__}")
        else:
            task.cancel()
            log.append(f"still running after {timeout:g} s")
        return log

    lines = []
    for name, messages, reader in scenarios:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # Jupyter's own loop is running in this thread
            log = pool.submit(asyncio.run, run(messages, reader)).result()
        lines += [f"{name}: {line}" for line in log]
    return lines


async def _stream_events(next_message, detok, make_chunk, abort, *, in_finally=True, on_none=True, always=False,
                         rest=True, done=True, error=True, opening=True, empty=True, empty_rest=False):
    """stream_events with one mistake switched on (the right one with none)."""
    finished = False

    def sse(obj):
        return f"data: {json.dumps(obj)}\n\n"

    try:
        if opening:
            yield sse(make_chunk(first=True))
        while True:
            msg = await next_message()
            if msg is None:
                if on_none and not in_finally:
                    abort()
                return
            if msg[0] == "tokens":
                piece = detok.add(msg[1])
                if piece or empty:
                    yield sse(make_chunk(text=piece, ids=msg[1]))
            elif msg[0] == "finish":
                finished = True
                _, reason, final, _ = msg
                tail = detok.finish(final)
                if rest and (tail or empty_rest):
                    yield sse(make_chunk(text=tail))
                yield sse(make_chunk(finish=reason))
                break
            elif msg[0] == "error":
                finished = True
                if error:
                    yield sse(msg[1].body())
                break
        if done:
            yield "data: [DONE]\n\n"
    finally:
        if in_finally and (always or not finished):
            abort()


def stream_events(scenarios, make_detok):
    """The transcripts of the usual wrong stream generators over the lab's scenarios."""
    def each(**mistake):
        def wrong(next_message, detok, make_chunk, abort):
            return _stream_events(next_message, detok, make_chunk, abort, **mistake)

        return lambda: stream_transcript(wrong, scenarios, make_detok)

    return {
        "abort() is called only when next_message() returns None, not in a finally: block: a client that leaves "
        "while the generator waits or yields cancels or closes it there, and the request keeps its blocks": each(
            in_finally=False),
        "abort() is never called: when the client leaves, the engine goes on computing tokens nobody reads, "
        "and the request holds its blocks until max_tokens": each(in_finally=False, on_none=False),
        "abort() is called after the request finished: a finished (or failed) request has already left the "
        "engine; abort only one that is still running": each(always=True),
        "the rest of the text (detok.finish(final)) is never sent: what detok held back, e.g. the start of a "
        "stop string that never came, is lost": each(rest=False),
        "no data: [DONE] at the end: a client cannot tell a finished stream from one cut off": each(done=False),
        "an error message is not sent on: the client must get the error event (err.body()), then [DONE]": each(
            error=False),
        "no opening chunk: first send make_chunk(first=True) (in a chat it carries the role)": each(opening=False),
        "a tokens message whose text is empty was not sent: its chunk still carries the token ids": each(
            empty=False),
        "the rest was sent even when it was empty: send detok.finish(final) only when there is some": each(
            empty_rest=True),
    }


def stream_reference(scenarios, make_detok) -> list[str]:
    """The transcript of a right stream_events over the lab's scenarios."""
    return stream_transcript(_stream_events, scenarios, make_detok)


# --------------------------------------------------------------------------------------------
# Lab 11 · beyond: rolling a paged sequence back, Quest's bound, the acceptance rule
# --------------------------------------------------------------------------------------------


def paged_state(cache, where: str) -> list[str]:
    """A paged cache's bookkeeping as text: tables and lengths, reference counts, the free stack, the registry."""
    a = cache.allocator
    tables = ", ".join(f"{s!r}: {t}" for s, t in cache.tables.items())
    lengths = ", ".join(f"{s!r}: {n}" for s, n in cache.lens.items())
    counts = {b: n for b, n in enumerate(a.refcount) if n}
    return [f"{where}: tables {{{tables}}}, lengths {{{lengths}}}",
            f"{where}: refcounts {counts}",
            f"{where}: free blocks, the next one handed out last: {list(a._free)}",
            f"{where}: registered blocks {sorted(cache.block_hash)}"]


def _append(cache, seq_id, tokens):
    """Feed ``tokens`` to ``seq_id`` through the cache's own seam, every layer (K and V of the right shapes)."""
    n_layers, (_, _, H_KV, D) = len(cache.k), cache.k[0].shape
    view = cache.batch([seq_id], [list(tokens)])
    x = torch.zeros(1, H_KV, len(tokens), D, dtype=cache.k[0].dtype)
    for layer in range(n_layers):
        view.attend(layer, x, x, x)


def truncate_transcript(make_cache, scenarios) -> list[str]:
    """What each scenario leaves in a fresh ``make_cache()`` after every truncate, as text lines.

    scenarios: {name: [operation, ...]}, an operation one of ("prompt", seq, tokens) (a new sequence: the
    prompt's cached prefix blocks are shared, the rest is fed), ("append", seq, tokens), ("fork", parent, child)
    or ("truncate", seq, length). A learner's exception is part of the transcript, and ends its scenario;
    NotImplementedError (an exercise not written yet) goes through."""
    lines = []
    for name, operations in scenarios.items():
        cache = make_cache()
        for op, seq, arg in operations:
            what = f"{op}({seq!r}, {arg!r})" if op in ("fork", "truncate") else f"{op}({seq!r}, {len(arg)} tokens)"
            try:
                if op == "prompt":
                    cached = cache.add_sequence(seq, arg)
                    _append(cache, seq, arg[cached:])
                elif op == "append":
                    _append(cache, seq, arg)
                elif op == "fork":
                    cache.fork(seq, arg)
                elif op == "truncate":
                    cache.truncate(seq, arg)
                else:
                    raise ValueError(f"unknown operation {op!r}")
            except NotImplementedError:
                raise
            except Exception as err:  # noqa: BLE001 - a wrong rollback's error is part of its answer
                lines.append(f"{name}, {what}: raised {type(err).__name__}")
                break
            if op == "truncate":
                lines += paged_state(cache, f"{name}, {what}")
    return lines


def _truncate_seq(cache, seq_id, length, *, keep="ceil", shared="decrement", freed_hash=True, cut_hash=False,
                  last_hash=True, last_shared=False, set_length=True, order="last first", cut_table=True):
    """The block side of PagedKVCache.truncate with one mistake switched on (the right one with none)."""
    bs, table, a = cache.block_size, cache.tables[seq_id], cache.allocator
    n = {"ceil": -(-length // bs), "floor": length // bs, "plus one": length // bs + 1}[keep]
    cut = table[n:]
    for b in (reversed(cut) if order == "last first" else cut):
        if shared == "decrement":
            freed = a.free(b)
        else:  # back to the pool whoever else holds it
            while not a.free(b):
                pass
            freed = True
        if (freed and freed_hash) or cut_hash:
            cache.block_hash.pop(b, None)
    if cut_table:
        del table[n:]
    if last_hash and length % bs and table and (last_shared or a.refcount[table[-1]] == 1):
        cache.block_hash.pop(table[-1], None)
    if set_length:
        cache.lens[seq_id] = length


def truncate_seq(make_cache, scenarios):
    """The transcripts of the usual wrong rollbacks; make_cache(rollback) -> a fresh cache whose truncate runs
    ``rollback(cache, seq_id, length)``."""
    def each(**mistake):
        return lambda: truncate_transcript(lambda: make_cache(lambda c, s, n: _truncate_seq(c, s, n, **mistake)),
                                           scenarios)

    return {
        "one block too few: length // block_size rounds down, and the partly filled last block (with positions "
        "the sequence keeps) is released; keep ceil(length / block_size) blocks, -(-length // block_size)": each(
            keep="floor"),
        "one block too many when length is a multiple of block_size: length // block_size + 1 keeps an empty block "
        "(with a stale hash); keep ceil(length / block_size) blocks, -(-length // block_size)": each(keep="plus one"),
        "a block another sequence still holds went back to the pool: call allocator.free(b) once, it drops this "
        "sequence's reference and frees the block only when it was the last": each(shared="free"),
        "a freed block kept its hash: a later prompt could be handed a block that is free, and soon overwritten; "
        "when allocator.free(b) returns True, remove b from block_hash": each(freed_hash=False),
        "a released block lost its hash while another sequence still holds it, full and right: unregister a "
        "released block only when allocator.free(b) returns True": each(freed_hash=False, cut_hash=True),
        "the last kept block, no longer full, kept its hash: the next tokens overwrite its rows past length, and a "
        "prompt that finds it would read them; unregister it when this sequence alone holds it (refcount 1)": each(
            last_hash=False),
        "the last kept block lost its hash while another sequence holds it too: for that one it is still full and "
        "right (this one copies it before writing, copy-on-write); unregister it only at refcount 1": each(
            last_shared=True),
        "the length was not shortened: set cache.lens[seq_id] = length, or the next token goes after the rejected "
        "ones": each(set_length=False),
        "the blocks were released first to last: release them last first (reversed), so that the pool hands the "
        "cut blocks back out in their old order, the first one first (the free list is a stack)": each(
            order="first last"),
        "the released blocks stayed in the block table: cut it too, del table[keep:]": each(cut_table=False),
    }


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


def _accept(p, q, draft, generator=None, *, rule="ratio", resample="residual", bonus="d", upfront=False,
            clamp=True, count="i"):
    """The rejection rule with one mistake switched on (the right one with none): (accepted, next token)."""
    d = len(draft)
    u_all = torch.rand(d, generator=generator) if upfront else None
    for i, x in enumerate(draft):
        px, qx = float(p[i, x]), float(q[i, x])
        if rule == "deterministic":
            ok = px >= qx
        else:
            u = float(u_all[i]) if upfront else float(torch.rand((), generator=generator))
            ok = {"ratio": u * qx < px, "p": u < px, "inverted": u * px < qx}[rule]
        if ok:
            continue
        weights = {"residual": p[i] - q[i], "p": p[i], "swapped": q[i] - p[i]}[resample]
        if clamp and resample != "p":
            weights = weights.clamp(min=0)
        nxt = int(torch.multinomial(weights, 1, generator=generator))
        return (i + 1 if count == "i + 1" else i), nxt
    return d, int(torch.multinomial(p[d - 1 if bonus == "d - 1" and d else d], 1, generator=generator))


def accept_transcript(accept, cases, seeds) -> list[str]:
    """What ``accept(p, q, draft, generator)`` returns on each case with a generator seeded with each seed."""
    lines = []
    for name, (p, q, draft) in cases.items():
        for seed in seeds:
            try:
                a, nxt = accept(p.clone(), q.clone(), list(draft), torch.Generator().manual_seed(seed))
                lines.append(f"{name}, seed {seed}: accepted {int(a)}, next token {int(nxt)}")
            except NotImplementedError:
                raise
            except Exception as err:  # noqa: BLE001 - a wrong rule's error is part of its answer
                lines.append(f"{name}, seed {seed}: raised {type(err).__name__}")
    return lines


def speculative_accept(cases, seeds):
    """The transcripts of the usual wrong acceptance rules on the lab's cases."""
    def each(**mistake):
        return lambda: accept_transcript(lambda p, q, d, g: _accept(p, q, d, g, **mistake), cases, seeds)

    return {
        "a draft was accepted whenever p(x) >= q(x), without a random draw: accept with probability "
        "min(1, p(x) / q(x)), i.e. when u * q(x) < p(x) for a fresh uniform u": each(rule="deterministic"),
        "a draft was accepted with probability p(x): the rule divides by the drafter's q(x), accept when "
        "u * q(x) < p(x)": each(rule="p"),
        "the ratio is upside down, q(x) / p(x): accept when u * q(x) < p(x)": each(rule="inverted"),
        "after a rejection the token was drawn from p: draw it from the residual max(0, p - q) (normalised), "
        "which holds exactly the probability the accepted drafts did not cover": each(resample="p"),
        "the residual is max(0, q - p): it is what the target wants *more* of than the drafter gave, "
        "max(0, p - q)": each(resample="swapped"),
        "the residual p - q was not clamped at 0: torch.multinomial refuses negative weights; "
        "(p[i] - q[i]).clamp(min=0)": each(clamp=False),
        "the bonus token (all d drafts accepted) came from p[d - 1]: it is the target's next distribution, "
        "p[d], the row after the last draft": each(bonus="d - 1"),
        "at a rejection, i + 1 drafts were counted as accepted: drafts 0 .. i - 1 were, so i": each(count="i + 1"),
        "the d uniforms were drawn all at once, before the loop: draw one per draft, only until the first "
        "rejection, so that the resample takes the generator's next numbers (the order the spec states)": each(
            upfront=True),
    }
