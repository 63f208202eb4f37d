"""Known wrong answers to lab 03's exercises (the KV cache): see kvlib.course.mistakes."""

from __future__ import annotations

import math

import torch

from ._common import BY_D, GQA_MODULO, NO_SQRT_D

__all__ = ['append_kv', 'decode_one', 'decode_kernel', 'exact_merges', 'merge_partials', 'cached_greedy']

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


def exact_merges():
    """Lab 03's decision (which candidate merges of two partials are exact on every input): for each candidate
    A-E, why choosing it (A-D) or leaving it out (E) is wrong. ``kvlib.course.ch03.check_merge_choice`` prints
    the reason of every letter on which yours and the reference differ."""
    return {
        "A": "A averages the partials; each must weigh by its range's share exp(lse_i) of the softmax sum",
        "B": "B is exact on paper, but exp(lse) overflows once scores pass about 88 (fp32) or 709 (fp64)",
        "C": "C weighs by positions; the right weights are the ranges' softmax sums exp(lse_i)",
        "D": "D is exact on paper, but exp(lse2 - lse1) overflows when range 2's scores are far higher",
        "E": "E is exact everywhere: both exponents lse_i - m are <= 0, so nothing overflows",
    }


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
    from ...cache import KVCache

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
        "the new tokens have no positions= (or position 0), so the model puts each one at position 0: a new "
        "token's position is the number of tokens already stored, which the cache counts": lambda: run(
            lambda cache: None),
        "every new token sits at position len(prompt_ids): the position must grow by one with each token "
        "stored": lambda: run(lambda cache: torch.full((1, 1), len(prompt_ids), dtype=torch.long,
                                                       device=cache.seq_lens.device)),
        "each new token's position is one too large (seq_lens + 1): a new token's position is the number of "
        "tokens already stored, seq_lens": lambda: run(lambda cache: cache.seq_lens.long()[:, None] + 1),
        "each new token's position is one too small (seq_lens - 1): that is the previous token's position":
            lambda: run(lambda cache: cache.seq_lens.long()[:, None] - 1),
        "the prompt is returned too: return only the n new tokens": lambda: list(prompt_ids) + [
            int(t) for t in reference],
    }


