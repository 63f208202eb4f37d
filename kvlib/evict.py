"""Budgeted KV caches (chapter 09): keep at most ``budget`` positions per sequence, evict the rest.

What you will learn:
- a cache with a budget holds a *choice* of past positions. Which ones is the whole method:
  the most recent (sliding window), the first few + the most recent (attention sinks, StreamingLLM,
  Xiao et al. 2023), the ones that received the most attention (from the whole prompt, then from
  every decoded token) + the most recent (heavy hitters, H2O, Zhang et al. 2023), or the ones the
  last prompt tokens attend to most, chosen once after a prefill, every later token kept (SnapKV,
  Li et al. 2024; PyramidKV with a budget per layer);
- one cache class, four *priorities*: every method is a score per held position, and eviction keeps
  the ``budget`` highest (``keep_highest``). Sinks and the recent window get +inf;
- the index layout: K/V rows stay where they were written (physical slots of a buffer of
  ``budget + chunk`` rows) and an index lists, per K/V head, the slots held in position order.
  Evicting rewrites the index and frees slots; nothing is copied. ``index_decode_attention`` is the
  decode kernel that reads K/V through that index (and can also return each held position's
  attention probability, which H2O accumulates);
- positions after eviction: by default RoPE is applied before the cache sees a key, so a key keeps
  the position it was computed at ("kept", the default). StreamingLLM (Xiao et al. 2023, "Efficient
  Streaming Language Models with Attention Sinks", arXiv:2309.17453) instead numbers the held
  positions 0..n-1 inside the cache ("reassign"), so positions never exceed the budget. Two ways to
  get there: ``rope="after"`` (the default) stores rotated keys and re-rotates each held key in place
  to its new rank after an eviction (RoPE's rotations compose: rotate(rotate(x, a), b) =
  rotate(x, a + b)), which rounds the stored key again at every renumbering and so drifts in half
  precision; ``rope="before"`` is what StreamingLLM's code does: the cache stores keys *before* RoPE,
  keeps only each slot's RoPE position (``rot``) and rotates the held keys to it, in fp32, when it
  attends, so a key is rounded once however often it is renumbered. Notebook 09 measures both;
- streaming: a long call (a prompt) is processed in ``chunk``-token steps inside every layer, with
  an eviction after each step, so a prompt token never attends to a position already evicted. H2O,
  SnapKV and PyramidKV instead treat a cache's first call as the prefill, as their reference code (and
  kvpress) does: it attends fully over itself, and only the kept rows are stored (no buffer ever holds the
  whole prompt). After it H2O evicts one position per decoded token (``prefill="stream"``, ours, streams
  the prompt too); SnapKV and PyramidKV keep every later token, the buffers growing by ``chunk`` rows
  when full (``decode_evict=True``, ours, evicts again at every later step);
- ``PagedWindowCache``: on chapter 05's paged cache, a window (+ sink blocks) frees whole blocks
  back to the pool as a sequence grows.

Contract: every budgeted cache has ``for_model(model, batch, budget, **options)`` (``budget`` in
positions per sequence), works as ``generate(model, ids, n, cache=cache)`` and in
``model(ids, positions=..., cache=cache)``, and ``held(b)`` is the number of positions it stores for
sequence b: never more than ``budget`` after a call (during a call, one chunk more), except in the
default SnapKV / PyramidKV, which hold the budget + every token after the prefill. Every cache works at
batch B > 1 when the rows have equal lengths (each row keeps its own positions, as B batch-1 runs would);
ragged prompts are prefilled one at a time through ``cache.sequence(b)`` (``generate`` does).

Shapes: buffers (B, H_KV, N_slots, D) with N_slots = budget + chunk (grown by whole chunks in the default
SnapKV / PyramidKV); index (B, H_KV, N_slots) int64 slot ids in position order, the first ``n_held[b]``
valid; q (B, H, T, D) as everywhere. ``nbytes()`` counts every tensor a cache holds.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

from . import runtime
from ._triton import check_kernel_dtype, tl, triton
from .cache import KVCache, check_attend_args, check_int
from .model import rope_cos_sin, rotate
from .paged import PagedKVCache, _PagedBatch

__all__ = ["keep_highest", "sink_window_priority", "h2o_accumulate", "pool_votes", "window_votes", "snapkv_select",
           "pyramid_budgets",
           "index_decode_attention", "index_decode_attention_ref", "BudgetCache", "SlidingWindowCache", "SinkCache",
           "H2OCache", "SnapKVCache", "PyramidKVCache", "KnormCache", "TOVACache", "ExpectedAttentionCache",
           "PagedWindowCache"]


# --------------------------------------------------------------------------------------------
# The pieces every method shares: a priority per held position, keep the highest
# --------------------------------------------------------------------------------------------


def sink_window_priority(n: int, n_sink: int) -> torch.Tensor:
    """(n,) priority of held positions 0..n-1 (in position order) for sinks + window.

    The first ``n_sink`` get +inf (always kept); the others their rank, so the most recent win.
    With n_sink = 0 this is the plain sliding window.

    >>> keep_highest(sink_window_priority(8, 2)[None, None], torch.tensor([8]), budget=5)
    tensor([[[0, 1, 5, 6, 7]]])
    """
    pri = torch.arange(n, dtype=torch.float32)
    pri[: min(n_sink, n)] = float("inf")
    return pri


def keep_highest(priority: torch.Tensor, n_held: torch.Tensor, budget: int) -> torch.Tensor:
    """Which held entries to keep: the ``budget`` highest priorities, returned in position order.

    priority (B, H_KV, N) over held entries in position order (entries at or past ``n_held[b]`` are
    ignored); returns (B, H_KV, min(budget, N)) entry indices, ascending. Where a sequence holds fewer
    than ``budget`` entries all of them are kept (the surplus indices, past its n_held, come last).

    >>> keep_highest(torch.tensor([[[5., 1., 9., 3.]]]), torch.tensor([4]), budget=2)  # 5 and 9
    tensor([[[0, 2]]])
    """
    B, H_KV, N = priority.shape
    valid = torch.arange(N, device=priority.device)[None] < n_held[:, None]  # (B, N)
    pri = priority.float().masked_fill(~valid[:, None], float("-inf"))
    # equal priorities (two +inf sinks, a max-pool's plateau) go to the later entry: a stable sort of the
    # entries in reverse order, so the comparison itself is exact (no tie-breaking term added to the scores)
    order = torch.sort(pri.flip(-1), dim=-1, descending=True, stable=True).indices[..., :min(budget, N)]
    return (N - 1 - order).sort(dim=-1).values


def h2o_accumulate(scores: torch.Tensor, probs: torch.Tensor, n_rep: int) -> torch.Tensor:
    """H2O's score update: add the attention each held position just received.

    scores (B, H_KV, N): accumulated so far; probs (B, H, T, N): the new queries' attention
    probabilities over the same N entries. A K/V head's score sums over its n_rep query heads and
    the T queries. Returns the new scores.

    >>> probs = torch.tensor([[[[0.5, 0.5]], [[0.9, 0.1]]]])  # (B=1, H=2, T=1, N=2)
    >>> h2o_accumulate(torch.zeros(1, 1, 2), probs, n_rep=2)  # both query heads read K/V head 0
    tensor([[[1.4000, 0.6000]]])
    """
    B, H, T, N = probs.shape
    return scores + probs.float().view(B, H // n_rep, n_rep, T, N).sum(dim=(2, 3))


# --------------------------------------------------------------------------------------------
# Decode attention through an index: reference, kernel, wrapper
# --------------------------------------------------------------------------------------------


def _check_index_args(q, k_buf, v_buf, index, n_held):
    for name, t in (("q", q), ("k_buf", k_buf), ("v_buf", v_buf), ("index", index), ("n_held", n_held)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"q must be a floating-point (B, H, D) tensor, got {tuple(q.shape)} {q.dtype}")
    B, H, D = q.shape
    if k_buf.dim() != 4 or k_buf.shape[0] != B or k_buf.shape[3] != D or v_buf.shape != k_buf.shape:
        raise ValueError(f"k_buf and v_buf must be (B={B}, H_KV, N_slots, D={D}), got {tuple(k_buf.shape)} "
                         f"and {tuple(v_buf.shape)}")
    H_KV = k_buf.shape[1]
    if H % H_KV:
        raise ValueError(f"k_buf has H_KV={H_KV} heads, which must divide q's H={H} heads")
    if not (k_buf.dtype == v_buf.dtype == q.dtype):
        raise TypeError(f"k_buf and v_buf must be {q.dtype} like q, got {k_buf.dtype} and {v_buf.dtype}")
    if index.dim() != 3 or tuple(index.shape[:2]) != (B, H_KV) or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index must be a (B={B}, H_KV={H_KV}, N) int32/int64 tensor of slot ids, got "
                         f"{tuple(index.shape)} {index.dtype}")
    if n_held.shape != (B,) or n_held.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"n_held must be a (B={B},) int32/int64 tensor, got {tuple(n_held.shape)} {n_held.dtype}")
    if len({t.device for t in (q, k_buf, v_buf, index, n_held)}) != 1:
        raise ValueError("q, k_buf, v_buf, index and n_held must be on one device")
    used = torch.arange(index.shape[2], device=index.device)[None, None] < n_held[:, None, None]  # (B, 1, N)
    slots = index.long()
    lo, hi, s_lo, s_hi = torch.stack([n_held.min().long(), n_held.max().long(),  # one host read for all four
                                      slots.masked_fill(~used, 0).min(), slots.masked_fill(~used, 0).max()]).tolist()
    if lo < 1 or hi > index.shape[2]:
        raise ValueError(f"n_held must lie in 1..{index.shape[2]} (the index width), got values in {lo}..{hi}")
    if s_lo < 0 or s_hi >= k_buf.shape[2]:
        raise ValueError(f"index must hold slot ids in 0..{k_buf.shape[2] - 1} in its first n_held entries, "
                         f"got values in {s_lo}..{s_hi}")


def index_decode_attention_ref(q, k_buf, v_buf, index, n_held, return_probs=False):
    """One query per sequence over the K/V rows its index lists: softmax(q . k / sqrt(D)) v.

    Entry j < n_held[b] of ``index[b, g]`` is the slot of sequence b's j-th held position for K/V
    head g. With ``return_probs``, also the attention probabilities (B, H, N) per entry (0 past n_held).

    >>> k = torch.zeros(1, 1, 4, 8); v = torch.arange(4.0).view(1, 1, 4, 1).expand(1, 1, 4, 8)
    >>> index = torch.tensor([[[3, 1, 0, 0]]])  # held: slot 3, then slot 1
    >>> out, p = index_decode_attention_ref(torch.zeros(1, 2, 8), k, v, index, torch.tensor([2]), True)
    >>> out[0, :, 0], p[0, 0]  # equal scores: the mean of values 3 and 1
    (tensor([2., 2.]), tensor([0.5000, 0.5000, 0.0000, 0.0000]))
    """
    _check_index_args(q, k_buf, v_buf, index, n_held)
    B, H, D = q.shape
    n_rep = H // k_buf.shape[1]
    out = torch.empty_like(q)
    probs = torch.zeros(B, H, index.shape[2], device=q.device)
    for b in range(B):  # ragged: each sequence holds its own number of positions
        n = int(n_held[b])
        rows = index[b, :, :n].long().repeat_interleave(n_rep, 0)  # (H, n) slot of each held entry
        kv_of = torch.arange(H, device=q.device) // n_rep  # query head h reads K/V head h // n_rep
        k = k_buf[b][kv_of[:, None], rows].float()  # (H, n, D)
        v = v_buf[b][kv_of[:, None], rows].float()
        p = torch.softmax((k @ q[b].float()[:, :, None])[..., 0] / math.sqrt(D), dim=-1)  # (H, n)
        out[b] = (p[:, None, :] @ v)[:, 0].to(q.dtype)
        probs[b, :, :n] = p
    return (out, probs) if return_probs else out


@triton.jit
def _attend_gathered_rows(k_ptr, v_ptr, rows, ok, dims, dim_ok, q, qk_scale, m_i, l_i, acc):
    """One online-softmax step over gathered rows (chapter 03's decode step, rows from anywhere): K and V at
    element offsets ``rows`` (only where ``ok``), q (TILE_D,) fp32 -> the new (m_i, l_i, acc)."""
    mask = ok[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + rows[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)  # (rows, TILE_D)
    s = tl.where(ok, tl.sum(k * q[None, :], axis=1) * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    v = tl.load(v_ptr + rows[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    return m_new, l_i * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p[:, None] * v, axis=0)


@triton.jit
def _index_decode_kernel(
    q_ptr, k_ptr, v_ptr,  # q (B, H, D); buffers (B, H_KV, N_slots, D)
    o_ptr,  # output (B, H, D) in q's dtype
    p_ptr,  # (B, H, N) fp32 attention probability of each index entry (PROBS only)
    index_ptr,  # (B, H_KV, N) slot of each held entry, in position order
    n_held_ptr,  # (B,) held entries per sequence
    stride_qb, stride_qh,  # q strides (the D stride is 1)
    stride_kb, stride_kh, stride_ks,  # buffer strides per sequence, head, slot (v has the same)
    stride_ib, stride_ih,  # index strides per sequence and head (the entry stride is 1)
    H, D, N, n_rep,  # query heads, head dim, index width, query heads per K/V head
    qk_scale,  # 1/sqrt(D) * log2(e)
    PROBS: tl.constexpr,  # also write the probabilities (a second pass over the scores)
    TILE_N: tl.constexpr,  # held entries per inner step
    TILE_D: tl.constexpr,  # head dim padded to a power of two
):
    pid = tl.program_id(0).to(tl.int64)  # one program per (sequence, query head); 64-bit offsets below
    b = pid // H
    h = pid % H
    kv_h = h // n_rep
    n = tl.load(n_held_ptr + b)
    dims = tl.arange(0, TILE_D)
    dim_ok = dims < D
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + dims, mask=dim_ok, other=0.0).to(tl.float32)
    idx_row = index_ptr + b * stride_ib + kv_h * stride_ih
    buf = b * stride_kb + kv_h * stride_kh  # int64 (b is): B x H_KV x N_slots x D can pass 2**31
    m_i = -1.0e30
    l_i = 0.0
    acc = tl.zeros((TILE_D,), dtype=tl.float32)
    for j0 in range(0, n, TILE_N):
        j = j0 + tl.arange(0, TILE_N)  # (TILE_N,) entries of the index
        ok = j < n
        slot = tl.load(idx_row + j, mask=ok, other=0).to(tl.int64)  # the only new line: where entry j lives
        rows = buf + slot * stride_ks
        m_i, l_i, acc = _attend_gathered_rows(k_ptr, v_ptr, rows, ok, dims, dim_ok, q, qk_scale, m_i, l_i, acc)
    tl.store(o_ptr + pid * D + dims, (acc / l_i).to(o_ptr.dtype.element_ty), mask=dim_ok)
    if PROBS:  # second pass: now that the row's max and sum are known, p_j = exp2(s_j - m) / l
        for j0 in range(0, N, TILE_N):
            j = j0 + tl.arange(0, TILE_N)
            ok = j < n
            slot = tl.load(idx_row + j, mask=ok, other=0).to(tl.int64)
            rows = buf + slot * stride_ks
            k = tl.load(k_ptr + rows[:, None] + dims[None, :], mask=ok[:, None] & dim_ok[None, :],
                        other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * qk_scale
            p = tl.where(ok, tl.exp2(s - m_i) / l_i, 0.0)
            tl.store(p_ptr + pid * N + j, p, mask=j < N)


def index_decode_attention(q, k_buf, v_buf, index, n_held, return_probs=False):
    """``index_decode_attention_ref`` as one Triton program per (sequence, query head).

    >>> from kvlib.runtime import DEVICE
    >>> g = torch.Generator().manual_seed(0)
    >>> q = torch.randn(2, 4, 16, generator=g).to(DEVICE)  # (B, H, D)
    >>> k, v = (torch.randn(2, 2, 8, 16, generator=g).to(DEVICE) for _ in range(2))  # (B, H_KV, N_slots, D)
    >>> index = torch.randperm(8, generator=g).repeat(2, 2, 1).to(DEVICE)  # (B, H_KV, N)
    >>> n = torch.tensor([5, 8], device=DEVICE)
    >>> ours, p = index_decode_attention(q, k, v, index, n, return_probs=True)
    >>> ref, p_ref = index_decode_attention_ref(q, k, v, index, n, return_probs=True)
    >>> torch.allclose(ours, ref, atol=1e-5), torch.allclose(p, p_ref, atol=1e-6)
    (True, True)
    """
    _check_index_args(q, k_buf, v_buf, index, n_held)
    check_kernel_dtype("evict.index_decode_attention", "q", q)
    if k_buf.stride(3) != 1 or v_buf.stride() != k_buf.stride() or q.stride(2) != 1:
        raise ValueError("q, k_buf and v_buf must be contiguous along D, and k_buf and v_buf alike")
    if not runtime.require_triton("evict.index_decode_attention", q=q, k_buf=k_buf, v_buf=v_buf, index=index,
                                  n_held=n_held):
        return index_decode_attention_ref(q, k_buf, v_buf, index, n_held, return_probs)
    B, H, D = q.shape
    N = index.shape[2]
    index, n_held = index.contiguous(), n_held.contiguous()
    out = torch.empty(B, H, D, device=q.device, dtype=q.dtype)  # contiguous: the kernel writes row pid at pid * D
    probs = torch.empty(B, H, N, device=q.device, dtype=torch.float32) if return_probs else out
    TILE_D = max(16, triton.next_power_of_2(D))
    TILE_N = 64 if runtime.INTERPRETER else max(16, 4096 // TILE_D)
    _index_decode_kernel[(B * H,)](
        q, k_buf, v_buf, out, probs, index, n_held, q.stride(0), q.stride(1),
        k_buf.stride(0), k_buf.stride(1), k_buf.stride(2), index.stride(0), index.stride(1),
        H, D, N, H // k_buf.shape[1], (1.0 / math.sqrt(D)) * 1.4426950408889634,
        PROBS=return_probs, TILE_N=TILE_N, TILE_D=TILE_D)
    return (out, probs) if return_probs else out


# --------------------------------------------------------------------------------------------
# The budgeted cache
# --------------------------------------------------------------------------------------------


def _rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE by ``delta`` positions (any shape broadcasting to x's leading dims): x (..., D)."""
    return rotate(x, *rope_cos_sin(delta, inv_freq, x.dtype))


class BudgetCache(KVCache):
    """At most ``budget`` positions per sequence; the subclass's ``priority`` decides which.

    Not used directly: ``SlidingWindowCache``, ``SinkCache``, ``H2OCache``, ``SnapKVCache``, ... Lengths:
    ``seq_lens`` counts every token a sequence has seen (its next position), ``held(b)`` what is stored.

    Options every method takes: ``chunk`` (tokens per streaming step of a long call; one extra chunk
    of buffer; the default SnapKV's growth step), ``positions`` ("kept": each key keeps its RoPE
    position; "reassign": held positions are renumbered 0..n-1 inside the cache, StreamingLLM's rule), ``rope`` ("after": the model rotates
    keys before the cache stores them, and "reassign" re-rotates stored keys in place, rounding them
    again each time; "before": ``keys_before_rope`` is set, keys are stored unrotated and rotated to
    their slot's ``rot`` position in fp32 when attended, as in StreamingLLM's code), ``kernels``
    ("triton"/"torch"/None). ``rot`` holds, per slot, the RoPE position its key is attended at (the
    true position with "kept", the rank with "reassign"); ``rotated_keys(layer)`` returns the keys
    as attention reads them. The index kernel does not rotate yet; rope='before' decodes through
    PyTorch (also with ``kernels="triton"``).

    >>> g = torch.Generator().manual_seed(0)
    >>> inv = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    >>> cache = SinkCache(1, 1, 1, 4, 8, n_sink=1, chunk=1, positions="reassign", rope="before", inv_freq=inv)
    >>> for t in range(6):
    ...     _ = cache.attend(0, *(torch.randn(1, 1, 1, 8, generator=g) for _ in range(3)))
    >>> cache.keys_before_rope, cache.held_positions(0)[0].tolist(), tuple(cache.rotated_keys(0).shape)
    (True, [0, 3, 4, 5], (1, 1, 4, 8))
    """

    needs_probs = False  # H2O and SnapKV read each step's attention probabilities
    needs_queries = False  # TOVA and ExpectedAttention read each step's queries (observe_queries)
    shared_attrs = ("inv_freq", "budgets")

    def __init__(self, n_layers, batch, n_kv_heads, budget, head_dim, dtype=torch.float32, device="cpu",
                 kernels=None, *, chunk=32, positions="kept", rope="after", inv_freq=None, layer_budgets=None):
        budget, chunk = check_int("budget", budget), check_int("chunk", chunk)
        if layer_budgets is None:
            layer_budgets = [budget] * check_int("n_layers", n_layers)
        elif len(layer_budgets) != n_layers:
            raise ValueError(f"layer_budgets must give one budget per layer ({n_layers}), got {len(layer_budgets)}")
        layer_budgets = [check_int("layer_budgets[i]", b) for b in layer_budgets]
        if positions not in ("kept", "reassign"):
            raise ValueError(f"positions must be 'kept' or 'reassign', got {positions!r}")
        if rope not in ("before", "after"):
            raise ValueError(f"rope must be 'before' or 'after', got {rope!r}")
        if positions == "reassign" and inv_freq is None:
            raise ValueError("positions='reassign' re-rotates keys: pass inv_freq (for_model does)")
        if rope == "before" and inv_freq is None:
            raise ValueError("rope='before' rotates the stored keys when it attends: pass inv_freq (for_model does)")
        super().__init__(n_layers, batch, n_kv_heads, max(layer_budgets) + chunk, head_dim, dtype, device, kernels)
        self.budget, self.chunk, self.positions, self.rope = budget, chunk, positions, rope
        self.budgets = layer_budgets  # per layer (PyramidKV's differ); shared by sequence(b)
        self.keys_before_rope = rope == "before"  # the model's seam then hands us k before RoPE
        self.inv_freq = inv_freq  # RoPE frequencies (D / 2,) or None; shared by sequence(b) (shared_attrs)
        slots = [(batch, n_kv_heads, b + chunk) for b in layer_budgets]  # (B, H_KV, N_slots) per layer
        if len(set(layer_budgets)) > 1:  # each layer's buffers hold its own budget + one chunk
            self.k = [torch.zeros(*s, head_dim, dtype=dtype, device=device) for s in slots]
            self.v = [torch.zeros(*s, head_dim, dtype=dtype, device=device) for s in slots]
        self.index = [torch.zeros(s, dtype=torch.int64, device=device) for s in slots]
        self.pos = [torch.full(s, -1, dtype=torch.int64, device=device) for s in slots]  # -1: free
        self.rot = [torch.zeros(s, dtype=torch.int64, device=device) for s in slots]  # RoPE position
        self.score = [torch.zeros(s, dtype=torch.float32, device=device) for s in slots]
        self.n_held = [torch.zeros(batch, dtype=torch.int64, device=device) for _ in range(n_layers)]
        self.evicted = torch.zeros(batch, dtype=torch.int64, device=device)  # positions dropped so far (layer 0)
        if self.prefill_whole:  # SnapKV's rules: the length of each sequence's first call (its compressed prompt)
            self.prefill_len = torch.zeros(batch, dtype=torch.int64, device=device)

    @classmethod
    def for_model(cls, model, batch, budget, kernels=None, **options):
        c = model.config
        return cls(c.n_layers, batch, c.n_kv_heads, budget, c.head_dim, model.dtype, model.device, kernels,
                   inv_freq=model.inv_freq.float(), **options)

    def held(self, b: int, layer: int = 0) -> int:
        """Positions stored for sequence b in ``layer`` (the same in every K/V head; in every layer too,
        unless the layers have their own budgets)."""
        return int(self.n_held[check_int("layer", layer, minimum=0)][check_int("b", b, minimum=0)])

    def held_positions(self, b: int, layer: int = 0) -> torch.Tensor:
        """(H_KV, held) original positions stored for sequence b in ``layer``, per K/V head, ascending."""
        n = self.held(b, layer)
        return self.pos[layer][b].gather(1, self.index[layer][b, :, :n])

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds: the K/V buffers and the bookkeeping (index, positions,
        scores, a rule's statistics), the total ``kvlib.footprint.held_bytes`` counts."""
        from .footprint import held_bytes

        return held_bytes(self).total

    # ---- buffers that grow (SnapKV's default keeps every decoded token) ------------------------------

    #: per-slot tensors of a layer and the dimension along the slots: what growing a layer reallocates
    slot_tensors = (("k", 2), ("v", 2), ("index", 2), ("pos", 2), ("rot", 2), ("score", 2))

    def sequence(self, b: int) -> "BudgetCache":
        """A batch-1 view of sequence b sharing this cache's buffers (``KVCache.sequence``); a view that must
        grow its buffers grows this cache's (every sequence's rows) and takes the new ones."""
        view = super().sequence(b)
        view._parent, view._row = weakref.ref(self), int(b)  # a weakref: callable, so footprint skips it
        return view

    def _slots(self, layer_idx: int) -> int:
        return self.index[layer_idx].shape[2]

    def _resize(self, layer_idx: int, n_slots: int, keep: bool = True):
        """Reallocate layer ``layer_idx``'s per-slot tensors with ``n_slots`` slots (the first slots keep their
        contents when ``keep``; new slots are free). A view resizes its parent and takes its rows."""
        parent = getattr(self, "_parent", None)
        if parent is not None:
            owner = parent()
            owner._resize(layer_idx, n_slots, keep)
            for name, _ in self.slot_tensors:
                getattr(self, name)[layer_idx] = getattr(owner, name)[layer_idx][self._row: self._row + 1]
            self.max_len = owner.max_len
            return
        for name, dim in self.slot_tensors:
            t = getattr(self, name)[layer_idx]
            if t.shape[dim] == 0:  # a per-slot tensor the rule does not use stays empty
                continue
            shape = list(t.shape)
            old, shape[dim] = shape[dim], n_slots
            new = torch.full(shape, -1 if name == "pos" else 0, dtype=t.dtype, device=t.device)
            if keep:
                m = min(old, n_slots)
                new.narrow(dim, 0, m).copy_(t.narrow(dim, 0, m))
            getattr(self, name)[layer_idx] = new
        self.max_len = max(self._slots(layer) for layer in range(len(self.k)))

    def _make_slots(self, layer_idx: int, T: int):
        """Room for T more positions in every sequence of ``layer_idx``: grow by whole chunks when needed."""
        need = int(self.n_held[layer_idx].max()) + T
        have = self._slots(layer_idx)
        if need > have:  # the old slots are copied whole: held rows stay where they are
            self._resize(layer_idx, have + -(-(need - have) // self.chunk) * self.chunk)

    def reset(self, batch: int | None = None, length: int | None = None):
        """Empty the cache. A budgeted cache accepts any ``length``: it never holds more than its budget (the
        paper's SnapKV grows with the tokens it keeps; ``reset`` gives back what it grew: budget + chunk)."""
        B = self.seq_lens.shape[0]
        if batch is not None and batch != B:
            raise ValueError(f"the cache holds batch={B} sequence(s), got {batch} prompt(s): build it with batch={batch}")
        self.seq_lens.zero_()
        self.evicted.zero_()
        if self.prefill_whole:
            self.prefill_len.zero_()
        for layer in range(len(self.k)):
            if self._slots(layer) != self.budgets[layer] + self.chunk and getattr(self, "_parent", None) is None:
                self._resize(layer, self.budgets[layer] + self.chunk, keep=False)  # (a view keeps its cache's rows)
            self.n_held[layer].zero_()
            self.pos[layer].fill_(-1)
            self.score[layer].zero_()

    def truncate(self, b: int, length: int) -> bool:
        """Forget every position >= ``length`` of sequence b (rejected draft tokens, chapter 11); returns
        whether the result is *known* to be exact: the cache that only ever saw the first ``length`` tokens.

        ``length`` counts positions seen (``seq_lens``, the next position), not positions held. The held
        entries of the cut positions are freed in every layer; what an eviction already threw away cannot
        come back. So the rollback is exact only if nothing was evicted while the cut tokens were held, and
        the priorities never saw them. This method returns False (not exact) when a layer is full after the
        last call (it holds its budget: an eviction may have happened in that call, evictions always leave
        exactly the budget), when a cut position had already been evicted, or when the rule keeps
        statistics the cut tokens' queries changed (H2O's and SnapKV's attention sums, TOVA's and
        ExpectedAttention's queries: ``needs_probs`` / ``needs_queries``). If evictions left the K/V heads of
        a layer holding different numbers of the kept positions, each head keeps only its newest ones, down
        to the smallest count (the layer's length is one number).

        Speculative decoding with eviction is therefore decoding with a different cache: once the budget is
        reached every verification call evicts with the drafted tokens present, and the rejected tokens
        decide what was dropped. Greedy output then differs in general from ``generate`` with the same cache.

        >>> cache = SlidingWindowCache(1, 1, 1, 4, 8, chunk=8)  # budget 4
        >>> _ = cache.attend(0, *(torch.randn(1, 1, 3, 8) for _ in range(3)))  # 3 held
        >>> cache.truncate(0, 2), cache.held(0)  # nothing was evicted: exact
        (True, 2)
        >>> _ = cache.attend(0, *(torch.randn(1, 1, 4, 8) for _ in range(3)))  # 6 seen, 2 evicted
        >>> cache.truncate(0, 5), cache.held(0), cache.held_positions(0)[0].tolist()
        (False, 3, [2, 3, 4])
        """
        b, length = self._check_truncate(b, length)
        cut = int(self.seq_lens[b]) - length
        exact = not (cut and (self.needs_probs or self.needs_queries))
        prefill = int(self.prefill_len[b]) if self.prefill_whole else 0
        for layer in range(len(self.k)):
            n = int(self.n_held[layer][b])
            if self.keeps_decoded:  # compressed once: exact unless the cut reaches into a compressed prompt
                if prefill > self.budgets[layer] and length < prefill:
                    exact = False
            elif n >= self.budgets[layer]:
                exact = exact and cut == 0
            index, pos = self.index[layer][b, :, :n], self.pos[layer][b]  # index: held slots in position order
            kept = (pos.gather(1, index) < length).sum(1)  # (H_KV,) kept entries: a prefix of each row
            m = int(kept.min()) if n else 0
            if bool((n - kept != cut).any()):  # a cut position was evicted (or the heads differ)
                exact = exact and cut == 0
            if m == n:
                continue
            drop = torch.zeros_like(self.pos[layer], dtype=torch.bool)  # (B, H_KV, N_slots)
            for h in range(index.shape[0]):  # keep the newest m of each head's kept entries
                drop[b, h, index[h, :int(kept[h]) - m]] = True
                drop[b, h, index[h, int(kept[h]):]] = True
                index[h, :m] = index[h, int(kept[h]) - m: int(kept[h])].clone()
            self.pos[layer].masked_fill_(drop, -1)
            self.score[layer].masked_fill_(drop, 0.0)
            self.on_drop(layer, drop)
            self.n_held[layer][b] = m
            if self.positions == "reassign" and int(kept.max()) > m:  # ranks moved: renumber what is held
                self._renumber(layer, int(self.n_held[layer].max()))
        self.seq_lens[b] = length
        if self.prefill_whole:
            self.prefill_len[b] = min(prefill, length)
        return exact

    def rotated_keys(self, layer_idx: int) -> torch.Tensor:
        """(B, H_KV, N, D) fp32 keys of ``layer_idx`` as attention reads them, held entries in position
        order (N = the most any sequence holds; entries past a sequence's ``n_held`` are unused slots)."""
        return self._gather_keys(layer_idx, int(self.n_held[check_int("layer_idx", layer_idx, minimum=0)].max()))

    def _gather_keys(self, layer_idx, N):
        kb, index = self.k[layer_idx], self.index[layer_idx]
        B, H_KV, _, D = kb.shape
        rows = index[:, :, :N]  # (B, H_KV, N)
        keys = kb.gather(2, rows[..., None].expand(B, H_KV, N, D)).float()
        if self.keys_before_rope:  # one rotation, in fp32, from the raw key to the slot's RoPE position
            keys = rotate(keys, *rope_cos_sin(self.rot[layer_idx].gather(2, rows), self.inv_freq, torch.float32))
        return keys

    # ---- what a method defines ---------------------------------------------------------------

    def priority(self, layer_idx: int, N: int) -> torch.Tensor:
        """(B, H_KV, N) priority of the first N held entries (position order); the highest are kept."""
        raise NotImplementedError

    def observe(self, layer_idx: int, probs: torch.Tensor, N: int):
        """Called with each step's probabilities (B, H, T, N) over the first N held entries (needs_probs)."""

    def observe_queries(self, layer_idx: int, q: torch.Tensor, rope_pos: torch.Tensor, true_pos: torch.Tensor, N: int):
        """Called after each step's attention (needs_queries) with its queries q (B, H, T, D) as attended
        (rotated to ``rope_pos`` (B, T)), their true positions (B, T) and the first N held entries."""

    # ---- one layer's call -------------------------------------------------------------------------

    def attend(self, layer_idx, q, k, v):
        """q (B, H, T, D), k/v (B, H_KV, T, D) -> (B, H, T, D); T > chunk runs in chunk-token steps."""
        B, H_KV, _, D = self.k[0].shape
        check_attend_args(layer_idx, q, k, v, n_layers=len(self.k), batch=B, n_kv_heads=H_KV, head_dim=D,
                          kv_dtype=self.k[0].dtype, batch_is=f"the cache holds B={B} sequence(s)")
        T = q.shape[2]
        if T > 1 and B > 1 and int(self.seq_lens.min()) != int(self.seq_lens.max()):
            raise ValueError("a multi-token call must extend sequences of equal length; "
                             "prefill ragged prompts one at a time with cache.sequence(b)")
        prefill = self.prefill_whole and not bool(self.seq_lens.any())  # the first call of every sequence
        if prefill and T > self.budgets[layer_idx]:
            out = self._compress_prefill(layer_idx, q, k, v)  # attend fully, keep the budget (SnapKV)
        elif prefill or self.keeps_decoded:  # the whole call in one step: nothing is evicted in it
            self._make_slots(layer_idx, T)
            out = self._step(layer_idx, q, k, v, 0, evict=not self.keeps_decoded)
        else:
            outs = []
            for t0 in range(0, T, self.chunk):
                t1 = min(T, t0 + self.chunk)
                outs.append(self._step(layer_idx, q[:, :, t0:t1], k[:, :, t0:t1], v[:, :, t0:t1], t0))
            out = torch.cat(outs, dim=2)
        if layer_idx == len(self.k) - 1:
            if prefill:
                self.prefill_len.fill_(T)
            self.seq_lens += T
        return out

    # ---- SnapKV's prefill: attend over the prompt itself, store only what is kept -------------------

    #: the first call on an empty cache attends fully over itself and is compressed once afterwards
    prefill_whole = False
    #: after the prefill every token is kept (nothing is evicted): the buffers grow instead
    keeps_decoded = False
    #: the prefill also sums the attention each prompt position received from every prompt query (H2O), into
    #: ``self._received`` (B, H_KV, T) before ``prefill_priority`` is asked
    prefill_received = False

    def prefill_priority(self, layer_idx: int, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """(B, H_KV, T) priority of a prompt's positions from its queries q (B, H, T, D) and keys (B, H_KV, T, D)
        fp32 as attention reads them (rotated); the budget highest are kept (prefill_whole rules)."""
        raise NotImplementedError

    def after_prefill(self, layer_idx: int, keep: torch.Tensor):
        """Hook after the prefill stored the kept positions ``keep`` (B, H_KV, n) in slots 0..n-1."""

    def _compress_prefill(self, layer_idx, q, k, v):
        """The prompt (T > budget positions, every sequence empty) attends fully over itself, as without a cache;
        then the budget highest ``prefill_priority`` positions are written to slots 0..budget-1 in position
        order. Only the kept rows are ever stored: no buffer holds the whole prompt."""
        B, H, T, D = q.shape
        H_KV = k.shape[1]
        n_rep = H // H_KV
        budget = self.budgets[layer_idx]
        p = torch.arange(T, device=q.device)  # the prompt's true positions (and ranks): the cache is empty
        keys = k.float()
        if self.keys_before_rope:  # the model handed unrotated keys: rotate them to their positions, in fp32
            keys = rotate(keys, *rope_cos_sin(p.expand(B, H_KV, T), self.inv_freq, torch.float32))
        k_all, v_all = keys.repeat_interleave(n_rep, 1), v.float().repeat_interleave(n_rep, 1)
        outs = []
        received = torch.zeros(B, H_KV, T, device=q.device) if self.prefill_received else None
        for t0 in range(0, T, 256):  # causal attention over the call itself, 256 query rows at a time
            t1 = min(T, t0 + 256)
            scores = q[:, :, t0:t1].float() @ k_all.transpose(-1, -2) / math.sqrt(D)  # (B, H, t1 - t0, T)
            future = p[None] > p[t0:t1, None]
            probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            outs.append(probs @ v_all)
            if received is not None:  # H2O: the attention each position received, summed over these query rows
                received = h2o_accumulate(received, probs, n_rep)
        out = torch.cat(outs, dim=2).to(q.dtype)
        if received is not None:
            self._received = received

        keep = keep_highest(self.prefill_priority(layer_idx, q, keys), torch.full((B,), T, device=q.device), budget)
        self._make_slots(layer_idx, budget)  # a view or a reset cache may need its budget's rows back
        kb, vb, index, pos, rot = (self.k[layer_idx], self.v[layer_idx], self.index[layer_idx],
                                   self.pos[layer_idx], self.rot[layer_idx])
        rows = keep[..., None].expand(B, H_KV, budget, D)
        kb[:, :, :budget] = k.gather(2, rows)
        vb[:, :, :budget] = v.gather(2, rows)
        pos.fill_(-1)
        pos[:, :, :budget] = keep
        rot[:, :, :budget] = keep
        self.score[layer_idx].zero_()
        index[:, :, :budget] = torch.arange(budget, device=q.device)
        self.n_held[layer_idx].fill_(budget)
        if layer_idx == 0:
            self.evicted += T - budget
        if self.positions == "reassign":  # held entry j sits at rank j
            self._renumber(layer_idx, budget)
        self.after_prefill(layer_idx, keep)
        return out

    def _step(self, layer_idx, q, k, v, t0, evict=True):
        """Append T tokens (T <= chunk, or fewer than the free slots), attend, then evict down to the budget."""
        B, H, T, D = q.shape
        H_KV = k.shape[1]
        n_rep = H // H_KV
        kb, vb, index, pos, rot = (self.k[layer_idx], self.v[layer_idx], self.index[layer_idx],
                                   self.pos[layer_idx], self.rot[layer_idx])
        n_old = self.n_held[layer_idx].clone()  # (B,)
        p_new = (self.seq_lens.long() + t0)[:, None] + torch.arange(T, device=q.device)  # (B, T) true positions
        r_new = n_old[:, None] + torch.arange(T, device=q.device)  # (B, T) ranks inside the cache
        if self.positions == "reassign":  # rotate q (and a rotated k) from their true positions to their ranks
            delta = (r_new - p_new)[:, None]  # (B, 1, T)
            q = _rotate(q, delta, self.inv_freq)
            if not self.keys_before_rope:  # an unrotated k is rotated to its slot's rot when attended
                k = _rotate(k, delta, self.inv_freq)

        # append: the first T free slots of each (sequence, K/V head) take the new rows
        free = pos < 0  # (B, H_KV, N_slots)
        slots = torch.sort((~free).to(torch.int8), dim=-1, stable=True).indices[..., :T]  # (B, H_KV, T)
        kb.scatter_(2, slots[..., None].expand(B, H_KV, T, D), k)
        vb.scatter_(2, slots[..., None].expand(B, H_KV, T, D), v)
        pos.scatter_(2, slots, p_new[:, None].expand(B, H_KV, T))
        rot.scatter_(2, slots, (r_new if self.positions == "reassign" else p_new)[:, None].expand(B, H_KV, T))
        self.score[layer_idx].scatter_(2, slots, 0.0)
        index.scatter_(2, r_new[:, None].expand(B, H_KV, T), slots)
        n_new = n_old + T
        self.n_held[layer_idx].copy_(n_new)  # copy_: a view made by sequence(b) shares these lengths
        N = int(n_new.max())

        # attend over every held entry (index order) and the new ones, causal among the new
        # the index kernel does not rotate yet: rope='before' decodes through PyTorch
        if T == 1 and self.kernels == "triton" and not self.keys_before_rope:  # probabilities: H2O and SnapKV
            res = index_decode_attention(q[:, :, 0], kb, vb, index, n_new, return_probs=self.needs_probs)
            out, probs = res if self.needs_probs else (res, None)
            out = out[:, :, None]  # (B, H, 1, D)
            probs = None if probs is None else probs[:, :, None, :N]  # (B, H, 1, N)
        else:
            rows = index[:, :, :N]  # (B, H_KV, N)
            k_all = self._gather_keys(layer_idx, N).repeat_interleave(n_rep, 1)  # (B, H, N, D) fp32
            v_all = vb.gather(2, rows[..., None].expand(B, H_KV, N, D)).repeat_interleave(n_rep, 1)
            scores = (q.float() @ k_all.float().transpose(-1, -2)) / math.sqrt(D)  # (B, H, T, N)
            visible = torch.arange(N, device=q.device)[None, None] <= r_new[:, :, None]  # (B, T, N)
            probs = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1)
            out = (probs @ v_all.float()).to(q.dtype)  # (B, H, T, D)
        if self.needs_probs:
            self.observe(layer_idx, probs, N)
        if self.needs_queries:
            self.observe_queries(layer_idx, q, r_new if self.positions == "reassign" else p_new, p_new, N)

        # evict: keep the budget highest priorities; free the other slots
        budget = self.budgets[layer_idx]
        if evict and N > budget:
            keep = keep_highest(self.priority(layer_idx, N), n_new, budget)  # (B, H_KV, budget)
            rows = index[:, :, :N]
            kept = torch.zeros_like(rows, dtype=torch.bool).scatter_(2, keep, True)
            held = torch.arange(N, device=q.device)[None, None] < n_new[:, None, None]
            drop_mask = torch.zeros_like(pos, dtype=torch.bool)
            drop_mask.scatter_(2, rows, held & ~kept)
            pos.masked_fill_(drop_mask, -1)
            self.score[layer_idx].masked_fill_(drop_mask, 0.0)
            self.on_drop(layer_idx, drop_mask)
            index[:, :, : keep.shape[2]] = rows.gather(2, keep)
            n_kept = n_new.clamp(max=budget)
            self.n_held[layer_idx].copy_(n_kept)
            if layer_idx == 0:
                self.evicted += n_new - n_kept
            if self.positions == "reassign":  # renumber: held entry j now sits at rank j
                self._renumber(layer_idx, int(n_kept.max()))
        return out

    def on_drop(self, layer_idx, drop_mask):
        """Hook for methods that keep per-slot state besides the score (SnapKV's observation rows)."""

    def _renumber(self, layer_idx, N):
        kb, index, rot = self.k[layer_idx], self.index[layer_idx], self.rot[layer_idx]
        B, H_KV, _, D = kb.shape
        rows = index[:, :, :N]  # (B, H_KV, N)
        target = torch.arange(N, device=kb.device).expand(B, H_KV, N)
        if self.keys_before_rope:  # stored keys are unrotated: only their RoPE position changes
            rot.scatter_(2, rows, target)
            return
        delta = target - rot.gather(2, rows)  # (B, H_KV, N): 0 for entries that did not move
        keys = kb.gather(2, rows[..., None].expand(B, H_KV, N, D))
        kb.scatter_(2, rows[..., None].expand(B, H_KV, N, D), _rotate(keys, delta, self.inv_freq))
        rot.scatter_(2, rows, target)


class SinkCache(BudgetCache):
    """Attention sinks + window (StreamingLLM): the first ``n_sink`` positions and the most recent.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = SinkCache.for_model(model, batch=1, budget=4, n_sink=2, chunk=1)
    >>> with torch.no_grad():
    ...     _ = model(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache=cache)
    >>> cache.held_positions(0)[0].tolist()
    [0, 1, 5, 6]
    """

    def __init__(self, *args, n_sink: int = 4, **kw):
        super().__init__(*args, **kw)
        self.n_sink = check_int("n_sink", n_sink, minimum=0)
        if self.n_sink >= self.budget:
            raise ValueError(f"n_sink must be below the budget ({self.budget}), got {n_sink}")

    def priority(self, layer_idx, N):
        B, H_KV = self.index[layer_idx].shape[:2]
        return sink_window_priority(N, self.n_sink).to(self.seq_lens.device).expand(B, H_KV, N)


class SlidingWindowCache(SinkCache):
    """Keep the ``budget`` most recent positions: sinks + window without the sinks.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = SlidingWindowCache.for_model(model, batch=1, budget=4, chunk=2)
    >>> with torch.no_grad():
    ...     _ = model(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache=cache)
    >>> cache.held(0), cache.held_positions(0)[0].tolist(), cache.next_positions().tolist()
    (4, [3, 4, 5, 6], [[7]])
    """

    def __init__(self, *args, **kw):
        super().__init__(*args, n_sink=0, **kw)


def _recent(N: int, n_held: torch.Tensor, recent: int) -> torch.Tensor:
    """(B, 1, N) True for the ``recent`` latest held entries of each sequence."""
    j = torch.arange(N, device=n_held.device)[None, None]
    return j >= (n_held[:, None, None] - recent)


class H2OCache(BudgetCache):
    """Heavy hitters (H2O, Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
    Language Models", arXiv:2306.14048): the ``recent`` latest positions + those with the most accumulated attention.

    Default (``prefill="whole"``), as H2O's reference code runs it (github.com/FMInference/H2O,
    ``h2o_hf/utils_real_drop/modify_llama.py``, ``H2OKVCache_LayerWise``): the first call on an empty cache (the
    prefill) attends fully over the prompt; each prompt position's score is the attention it received from *every*
    prompt query (the question's included); if the prompt is longer than the budget it is compressed *once* to the
    ``recent`` latest positions + the ``budget - recent`` highest scores, and the kept positions carry their scores
    on. Every later step adds each held position's attention probability to its score (``h2o_accumulate``) and
    evicts back to the budget: one position per decoded token. Only the kept rows are stored (as SnapKV's prefill:
    no buffer holds the whole prompt); the buffers hold budget + ``chunk`` rows and never grow.

    ``prefill="stream"`` is *ours*, not the reference's: the prompt runs in ``chunk``-token steps with an eviction
    after each, so a position is scored only by the queries that arrived while it was held, and the prompt's first
    positions are chosen before its end (the question) has been read.

    A score sums over the T queries of a step and over the K/V head's query heads (the reference code has one
    K/V head per query head; with grouped heads a K/V head keeps one set of positions for all of its query heads,
    the course's choice, as for SnapKV). Default ``recent = budget // 2`` (the paper splits its budget evenly
    between heavy hitters and recent tokens).

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = H2OCache.for_model(model, batch=1, budget=4)
    >>> with torch.no_grad():
    ...     _ = model(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache=cache)  # the prefill: 7 -> 4, once
    ...     _ = model(torch.tensor([[8]]), positions=cache.next_positions(), cache=cache)  # one in, one out
    >>> cache.held(0), cache.held_positions(0)[0, -2:].tolist()  # the 2 most recent are always held
    (4, [6, 7])
    >>> ours = H2OCache.for_model(model, batch=1, budget=4, chunk=1, prefill="stream")
    >>> with torch.no_grad():
    ...     _ = model(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache=ours)  # evicts after every token
    >>> ours.prefill, ours.held(0), int(ours.evicted[0])
    ('stream', 4, 3)
    """

    needs_probs = True
    prefill_whole = True  # the reference's prefill; prefill="stream" (ours) turns it off for one cache
    prefill_received = True  # _compress_prefill sums the attention each prompt position received

    def __init__(self, *args, recent: int | None = None, prefill: str = "whole", **kw):
        if prefill not in ("whole", "stream"):
            raise ValueError(f"prefill must be 'whole' (H2O's reference code) or 'stream' (ours), got {prefill!r}")
        self.prefill = prefill
        self.prefill_whole = prefill == "whole"  # read by BudgetCache.__init__ (prefill_len) and attend
        super().__init__(*args, **kw)
        self.recent = self.budget // 2 if recent is None else check_int("recent", recent, minimum=0)
        if self.recent > self.budget:
            raise ValueError(f"recent must be at most the budget ({self.budget}), got {recent}")

    def observe(self, layer_idx, probs, N):
        B, H_KV = self.index[layer_idx].shape[:2]
        rows = self.index[layer_idx][:, :, :N]
        held = torch.arange(N, device=rows.device)[None, None] < self.n_held[layer_idx][:, None, None]
        gained = h2o_accumulate(torch.zeros(B, H_KV, N, device=rows.device), probs, probs.shape[1] // H_KV)
        self.score[layer_idx].scatter_add_(2, rows, gained * held)

    def priority(self, layer_idx, N):
        rows = self.index[layer_idx][:, :, :N]
        score = self.score[layer_idx].gather(2, rows)
        return score.masked_fill(_recent(N, self.n_held[layer_idx], self.recent), float("inf"))

    def prefill_priority(self, layer_idx, q, keys):
        received = self._received  # (B, H_KV, T): what _compress_prefill summed over every prompt query
        T = received.shape[2]
        recent = torch.arange(T, device=received.device) >= T - self.recent
        return received.masked_fill(recent[None, None], float("inf"))

    def after_prefill(self, layer_idx, keep):
        received, self._received = self._received, None  # (not held past the call: a temporary of the prefill)
        n = keep.shape[2]
        self.score[layer_idx][:, :, :n] = received.gather(2, keep)  # kept slot j holds position keep[j]


def pool_votes(votes: torch.Tensor, window: torch.Tensor, kernel: int, pooling: str = "max") -> torch.Tensor:
    """SnapKV's smoothing: pool the votes of the positions before the observation window, keep the window.

    votes (B, H_KV, N) in position order; window (B, 1 or H_KV, N) True for the observation window's
    entries (and for entries past a sequence's end, which hold no votes). As in SnapKV's reference code
    (github.com/FasterDecoding/SnapKV, ``snapkv_utils.py``), only the positions before the window are
    pooled (the window's own votes are cut off before pooling, so they do not leak into their
    neighbours), with a centred max- or average-pool of width ``kernel`` and zero padding; the window
    gets +inf (always kept).

    >>> pool_votes(torch.tensor([[[0., 1., 0., 0., 5., 9.]]]), torch.tensor([[[0, 0, 0, 0, 1, 1]]]).bool(), 3)
    tensor([[[1., 1., 1., 0., inf, inf]]])
    """
    if pooling not in ("max", "avg"):
        raise ValueError(f"pooling must be 'max' or 'avg', got {pooling!r}")
    B, H_KV, N = votes.shape
    flat = votes.masked_fill(window, 0.0).reshape(B * H_KV, 1, N)
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    pooled = pool(flat, kernel, stride=1, padding=kernel // 2).view(B, H_KV, N)
    return pooled.masked_fill(window, float("inf"))


def check_snapkv_options(window, budget, kernel, pooling):
    """SnapKV's options checked once for every cache that votes like it: (window, kernel, pooling)."""
    window, kernel = check_int("window", window), check_int("kernel", kernel)
    if window >= budget:
        raise ValueError(f"window must be below the budget ({budget}), got {window}")
    if kernel % 2 == 0:
        raise ValueError(f"kernel must be odd (a centred pooling window), got {kernel}")
    if pooling not in ("max", "avg"):
        raise ValueError(f"pooling must be 'max' or 'avg', got {pooling!r}")
    return window, kernel, pooling


class SnapKVCache(BudgetCache):
    """SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation",
    arXiv:2404.14469): the prompt's last ``window`` queries vote; keep the window + the positions with the
    most votes.

    Default (``decode_evict=False``), as in the paper, its reference code (github.com/FasterDecoding/SnapKV,
    ``snapkv_utils.py``) and kvpress's ``SnapKVPress``: the first call on an empty cache (the prefill)
    attends fully over the prompt; if the prompt is longer than the budget it is compressed *once* to
    ``budget`` positions, and every later token is kept: ``held(b) = min(prompt, budget) + tokens fed
    since``. Only the kept rows are stored (the prompt attends over its own K/V); the buffers start at
    budget + ``chunk`` rows and grow by ``chunk`` rows when the kept tokens fill them (``reset`` gives the
    growth back). ``prefill_len`` records each sequence's prefill.

    ``decode_evict=True`` is *ours*, not the paper's: the same prefill, then every later call runs in
    ``chunk``-token steps, each followed by an eviction back to the budget, with the latest ``window``
    queries as voters (``obs``: their attention per slot, (B, H_KV, window, budget + chunk) per layer).

    Votes are the observation window's attention probabilities summed over its queries and the K/V
    head's query heads (kvpress's averaging for grouped heads, the same ranking), smoothed by a
    max-pool of width ``kernel`` over the positions before the window (``pool_votes``; the defaults
    window 32, kernel 7, max-pool are the configuration of SnapKV's LongBench runs, ``pooling="avg"``
    and kernel 5 the reference code's defaults). The prefill's choice is ``snapkv_select`` on the
    prompt's queries and keys.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = SnapKVCache.for_model(model, batch=1, budget=4, window=2)
    >>> with torch.no_grad():
    ...     _ = model(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache=cache)  # the prefill: 7 -> 4
    ...     _ = model(torch.tensor([[8]]), positions=cache.next_positions(), cache=cache)  # kept
    >>> cache.held(0), cache.held_positions(0)[0, -3:].tolist()  # the observation window + the new token
    (5, [5, 6, 7])
    >>> ours = SnapKVCache.for_model(model, batch=1, budget=4, window=2, decode_evict=True)
    >>> with torch.no_grad():
    ...     _ = model(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache=ours)
    ...     _ = model(torch.tensor([[8]]), positions=ours.next_positions(), cache=ours)
    >>> ours.held(0)  # evicted back to the budget
    4
    """

    prefill_whole = True

    def __init__(self, *args, window: int = 32, kernel: int = 7, pooling: str = "max", decode_evict: bool = False,
                 **kw):
        if not isinstance(decode_evict, bool):
            raise TypeError(f"decode_evict must be a bool, got {type(decode_evict).__name__} {decode_evict!r}")
        super().__init__(*args, **kw)
        self.window, self.kernel, self.pooling = check_snapkv_options(window, min(self.budgets), kernel, pooling)
        self.decode_evict = decode_evict
        self.keeps_decoded = not decode_evict  # the paper's rule: compress once, then keep every token
        self.needs_probs = decode_evict  # votes after the prefill only when evicting while decoding
        # the latest `window` queries' attention per physical slot: (B, H_KV, window, N_slots) per layer; only
        # decode_evict votes after the prefill (allocated on first use otherwise)
        self.obs = [self._new_obs(index, decode_evict) for index in self.index]

    slot_tensors = BudgetCache.slot_tensors + (("obs", 3),)

    def _new_obs(self, index, used=True):
        """(B, H_KV, window, N_slots) zeros; with N_slots = 0 when unused (an empty per-slot tensor never grows)."""
        return torch.zeros(*index.shape[:2], self.window, index.shape[2] if used else 0, device=index.device)

    def reset(self, batch=None, length=None):
        super().reset(batch, length)
        for o in self.obs:
            o.zero_()

    def prefill_priority(self, layer_idx, q, keys):
        votes = window_votes(q, keys, self.window)  # (B, H_KV, window, T)
        self._prefill_votes = votes if self.decode_evict else None
        T = keys.shape[2]
        in_window = (torch.arange(T, device=q.device) >= T - self.window)[None, None]
        return pool_votes(votes.sum(2), in_window.expand(q.shape[0], 1, T), self.kernel, self.pooling)

    def after_prefill(self, layer_idx, keep):
        votes, self._prefill_votes = self._prefill_votes, None
        if votes is None:
            return
        obs = self.obs[layer_idx]
        B, H_KV, n = keep.shape
        obs.zero_()  # the window's votes on the kept positions: the voters of the first eviction
        obs[:, :, :, :n] = votes.gather(3, keep[:, :, None].expand(B, H_KV, self.window, n))

    def observe(self, layer_idx, probs, N):
        B, H, T, _ = probs.shape
        H_KV = self.index[layer_idx].shape[1]
        if self.obs[layer_idx].shape[3] != self.index[layer_idx].shape[2]:  # unused so far: allocate it now
            self.obs[layer_idx] = self._new_obs(self.index[layer_idx])
        rows = self.index[layer_idx][:, :, :N]
        voted = probs.float().view(B, H_KV, H // H_KV, T, N).sum(2)[:, :, -self.window:]  # (B, H_KV, <=w, N)
        w = voted.shape[2]
        new = torch.zeros(B, H_KV, w, self.obs[layer_idx].shape[3], device=probs.device)
        new.scatter_(3, rows[:, :, None].expand(B, H_KV, w, N), voted)
        obs = self.obs[layer_idx]
        obs.copy_(torch.cat([obs[:, :, w:], new], dim=2))  # a shift register of the latest voters

    def on_drop(self, layer_idx, drop_mask):
        if self.obs[layer_idx].shape[3] == drop_mask.shape[2]:
            self.obs[layer_idx].masked_fill_(drop_mask[:, :, None], 0.0)

    def priority(self, layer_idx, N):
        rows = self.index[layer_idx][:, :, :N]
        votes = self.obs[layer_idx].sum(2).gather(2, rows)  # (B, H_KV, N) in position order
        n = self.n_held[layer_idx][:, None, None]
        j = torch.arange(N, device=rows.device)[None, None]
        return pool_votes(votes, j >= n - self.window, self.kernel, self.pooling)  # the window and past the end


def window_votes(q: torch.Tensor, k: torch.Tensor, window: int) -> torch.Tensor:
    """The last ``window`` queries' causal attention over the prompt, summed over each K/V head's query heads:
    (B, H_KV, window, T) fp32. q (B, H, T, D), k (B, H_KV, T, D) as attention reads them (rotated).

    Recomputed from q and k (softmax in fp32), as SnapKV's and kvpress's code do beside a fused attention
    kernel that returns no probabilities.

    >>> votes = window_votes(torch.zeros(1, 2, 5, 4), torch.zeros(1, 1, 5, 4), window=2)  # equal scores
    >>> votes[0, 0]  # query 3 sees 4 positions, query 4 sees 5; two query heads each
    tensor([[0.5000, 0.5000, 0.5000, 0.5000, 0.0000],
            [0.4000, 0.4000, 0.4000, 0.4000, 0.4000]])
    """
    B, H, T, D = q.shape
    H_KV = k.shape[1]
    w = q[:, :, -window:].float().view(B, H_KV, H // H_KV, window, D)
    logits = w @ k.float()[:, :, None].transpose(-1, -2) / math.sqrt(D)  # (B, H_KV, n_rep, window, T)
    causal = torch.arange(T, device=q.device) <= torch.arange(T - window, T, device=q.device)[:, None]
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1).sum(2)


def snapkv_select(q: torch.Tensor, k: torch.Tensor, budget: int, window: int, kernel: int = 7,
                  pooling: str = "max") -> torch.Tensor:
    """SnapKV's choice over one prompt, from its queries and keys alone: (B, H_KV, budget) positions to keep,
    ascending. q (B, H, T, D) and k (B, H_KV, T, D), both as attention reads them (rotated).

    The last ``window`` queries' attention over the prompt is recomputed here (causal, softmax in fp32), as
    SnapKV's and kvpress's code do beside a fused attention kernel (``window_votes``); its votes over the
    positions before the window are summed over the K/V head's query heads and the window's queries, pooled
    (``pool_votes``), and the ``budget - window`` best join the window. ``SnapKVCache``'s prefill keeps
    these positions; ``kvlib.kivi.SnapKiviCache`` uses it too.

    >>> g = torch.Generator().manual_seed(0)
    >>> q, k = torch.randn(1, 2, 10, 4, generator=g), torch.randn(1, 1, 10, 4, generator=g)
    >>> snapkv_select(q, k, budget=5, window=2, kernel=3).tolist()[0][0][-2:]  # the window is always kept
    [8, 9]
    """
    B, H, T, D = q.shape
    budget, window = check_int("budget", budget), check_int("window", window)
    if not window < budget <= T:
        raise ValueError(f"need window < budget <= the prompt's length, got window={window}, budget={budget}, T={T}")
    votes = window_votes(q, k, window).sum(2)  # (B, H_KV, T): summed over the window's queries
    in_window = (torch.arange(T, device=q.device) >= T - window)[None, None]
    pooled = pool_votes(votes, in_window.expand(B, 1, T), kernel, pooling)
    return keep_highest(pooled, torch.full((B,), T, device=q.device), budget)  # ties as the budgeted caches break them


def pyramid_budgets(budget: int, n_layers: int, window: int, beta: float = 20) -> list[int]:
    """PyramidKV's budget per layer (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on
    Pyramidal Information Funneling", arXiv:2406.02069): beyond the ``window`` every layer keeps, the
    selected positions fall linearly from the first layer to the last, the last keeping 1 / ``beta`` of
    the mean, the first the rest up to twice the mean, so that the layers hold ``budget`` on average (the
    formula of the reference code, github.com/Zefan-Cai/KVCache-Factory, ``pyramidkv_utils.py``; rounded
    here so that the total is exact when the budget allows it).

    >>> b = pyramid_budgets(100, 4, window=20)
    >>> b, sum(b) / len(b)
    ([176, 125, 75, 24], 100.0)
    """
    budget, n_layers, window = check_int("budget", budget), check_int("n_layers", n_layers), check_int("window", window, 0)
    if window >= budget:
        raise ValueError(f"window must be below the budget ({budget}), got {window}")
    if beta < 1:
        raise ValueError(f"beta must be >= 1, got {beta}")
    base = budget - window  # selected positions per layer, on average
    low = base / beta
    high = 2 * base - low
    step = (high - low) / max(1, n_layers - 1)
    raw = [high - layer * step for layer in range(n_layers)] if n_layers > 1 else [float(base)]
    out = [max(1, math.floor(x)) for x in raw]
    for layer in sorted(range(n_layers), key=lambda i: out[i] - raw[i])[:max(0, base * n_layers - sum(out))]:
        out[layer] += 1  # largest remainders first: the total is base * n_layers
    return [window + x for x in out]


class PyramidKVCache(SnapKVCache):
    """PyramidKV: SnapKV's vote with a budget per layer, large in the first layers and small in the last.

    PyramidKV's observation is that attention is spread widely in the lower layers and concentrated on
    a few positions in the upper ones ("pyramidal information funneling"), so the same total budget is
    better spent unevenly. ``budget`` is the mean over layers; ``pyramid_budgets`` gives each layer its
    own (``beta`` sets the slope: the last layer selects budget / beta positions beyond the window).
    Each layer's buffers hold its budget + one chunk, so the total is what a uniform budget costs.
    ``held(b, layer)`` differs by layer. As in the reference code (and kvpress's ``PyramidKVPress``) the
    prompt is compressed once, with SnapKV's rule, and every later token is kept (``decode_evict=False``,
    the default); ``decode_evict=True`` goes on evicting while decoding, as ``SnapKVCache``'s option (ours).

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=4, n_heads=2, hidden_dim=64)).eval()
    >>> cache = PyramidKVCache.for_model(model, batch=1, budget=6, window=2, chunk=16)
    >>> with torch.no_grad():
    ...     _ = model(torch.arange(12)[None], cache=cache)
    >>> [cache.held(0, layer) for layer in range(4)], cache.budgets
    ([10, 7, 4, 3], [10, 7, 4, 3])
    """

    def __init__(self, n_layers, batch, n_kv_heads, budget, head_dim, *args, window: int = 32, beta: float = 20,
                 **kw):
        if "layer_budgets" in kw:
            raise TypeError("PyramidKVCache computes its layer budgets: pass budget (the mean) and beta")
        layer_budgets = pyramid_budgets(budget, n_layers, window, beta)
        super().__init__(n_layers, batch, n_kv_heads, budget, head_dim, *args, window=window,
                         layer_budgets=layer_budgets, **kw)
        self.beta = beta


# ---- rules that need no attention probabilities ---------------------------------------------------
# A fused attention kernel (FlashAttention, FlashInfer, index_decode_attention without return_probs)
# never writes the probabilities to memory: H2O's and SnapKV's scores need them (or a second pass that
# recomputes them). These rules score from what is at hand: the keys, one query row, or query statistics.


class _RecentRule(BudgetCache):
    """A rule that protects only the ``recent`` latest positions (at least the newest: a streaming cache
    must keep the token it just wrote) and ranks the rest by ``score`` (B, H_KV, N), highest kept."""

    def __init__(self, *args, recent: int = 1, **kw):
        super().__init__(*args, **kw)
        self.recent = check_int("recent", recent)
        if self.recent >= min(self.budgets):
            raise ValueError(f"recent must be below the budget ({min(self.budgets)}), got {recent}")

    def score_held(self, layer_idx: int, N: int) -> torch.Tensor:
        raise NotImplementedError

    def priority(self, layer_idx, N):
        return self.score_held(layer_idx, N).masked_fill(_recent(N, self.n_held[layer_idx], self.recent), float("inf"))


class KnormCache(_RecentRule):
    """Keep the keys with the smallest L2 norm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based
    Strategy for KV Cache Compression", arXiv:2406.11430; kvpress's KnormPress: score = -||k||).

    The paper finds that keys with a low norm receive high attention (the sinks among them), so the
    norm stands in for attention without computing any. The norm is taken of the key as stored (RoPE
    does not change it). kvpress compresses once after the prompt; this cache evicts as it streams, so
    the ``recent`` newest positions (default 1, the token just written) are always kept.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = KnormCache.for_model(model, batch=1, budget=4, chunk=1)
    >>> with torch.no_grad():
    ...     _ = model(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache=cache)
    >>> k = cache.rotated_keys(0)[0, 0, :3]  # the three kept besides the newest: the smallest norms seen
    >>> cache.held(0), bool(k.norm(dim=-1).max() <= cache.k[0][0, 0].float().norm(dim=-1).max())
    (4, True)
    """

    def score_held(self, layer_idx, N):
        kb, rows = self.k[layer_idx], self.index[layer_idx][:, :, :N]
        B, H_KV, _, D = kb.shape
        return -kb.gather(2, rows[..., None].expand(B, H_KV, N, D)).float().norm(dim=-1)


class TOVACache(_RecentRule):
    """TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs", arXiv:2401.06104): after each step,
    keep the positions the step's *last* query attends to most, averaged over the layer's query heads
    (one choice per layer, shared by its K/V heads, as in the paper and kvpress's TOVAPress).

    That one attention row is computed here from the query and the held keys (q . k / sqrt(D), softmax):
    one decode step's worth of work, so the attention itself can stay a fused kernel that returns no
    probabilities (kvpress recomputes it the same way). The row's scores are the ``score`` per slot;
    ``recent`` (default 1) protects the newest.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = TOVACache.for_model(model, batch=1, budget=4, chunk=1)
    >>> with torch.no_grad():
    ...     _ = model(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache=cache)
    >>> cache.held(0), bool((cache.held_positions(0)[0] == cache.held_positions(0)[1]).all())  # shared by heads
    (4, True)
    """

    needs_queries = True

    def observe_queries(self, layer_idx, q, rope_pos, true_pos, N):
        B, H, _, D = q.shape
        H_KV = self.index[layer_idx].shape[1]
        keys = self._gather_keys(layer_idx, N)  # (B, H_KV, N, D) fp32, as attention reads them
        last = q[:, :, -1].float().view(B, H_KV, H // H_KV, 1, D)
        logits = (last @ keys[:, :, None].transpose(-1, -2)).squeeze(-2) / math.sqrt(D)  # (B, H_KV, n_rep, N)
        held = torch.arange(N, device=q.device)[None, None, None] < self.n_held[layer_idx][:, None, None, None]
        row = torch.softmax(logits.masked_fill(~held, float("-inf")), dim=-1).mean(dim=(1, 2))  # (B, N)
        self.score[layer_idx].scatter_(2, self.index[layer_idx][:, :, :N], row[:, None].expand(B, H_KV, N).contiguous())

    def score_held(self, layer_idx, N):
        return self.score[layer_idx].gather(2, self.index[layer_idx][:, :, :N])


class ExpectedAttentionCache(_RecentRule):
    """Expected attention (Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating
    Attention from Future Queries Distribution", arXiv:2510.00636; kvpress's ExpectedAttentionPress):
    score each key by the attention that *future* queries are expected to give it.

    Queries before RoPE are modelled as a Gaussian (mean mu, covariance Sigma, per query head, from the
    queries seen, without the first ``n_sink`` positions); RoPE's rotation is averaged over the next
    ``n_future`` positions (R̄); then E[exp(q . k / sqrt(d))] = exp(mū . k / sqrt(d) + k^T Σ̄ k / (2d)) with
    mū = R̄ mu, Σ̄ = R̄ Sigma R̄^T. Those exponents are softmaxed over the held keys, averaged over the K/V
    head's query heads and multiplied by ||v|| (how much a position can change the output). The first
    ``n_sink`` positions are left out of the softmax and always kept (+inf), as are the ``recent`` newest
    (default 1).

    kvpress takes the statistics of the queries of the call it compresses (the prompt); a streaming
    cache keeps running sums of every query it has seen instead (``q_stat_sum``, ``q_stat_outer``,
    ``q_stat_n``: per layer (B, H, D), (B, H, D, D), (B,), counted as scores by ``kvlib.footprint``).

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = ExpectedAttentionCache.for_model(model, batch=1, budget=6, n_sink=2, chunk=2)
    >>> with torch.no_grad():
    ...     _ = model(torch.arange(12)[None], cache=cache)
    >>> cache.held_positions(0)[0, :2].tolist(), cache.held_positions(0)[0, -1].item(), int(cache.q_stat_n[0][0])
    ([0, 1], 11, 10)
    """

    needs_queries = True

    def __init__(self, n_layers, batch, n_kv_heads, budget, head_dim, *args, n_sink: int = 4, n_future: int = 512,
                 use_covariance: bool = True, use_vnorm: bool = True, n_heads: int | None = None, **kw):
        super().__init__(n_layers, batch, n_kv_heads, budget, head_dim, *args, **kw)
        if self.inv_freq is None:
            raise ValueError("ExpectedAttentionCache averages RoPE over future positions: pass inv_freq (for_model does)")
        self.n_sink, self.n_future = check_int("n_sink", n_sink, minimum=0), check_int("n_future", n_future)
        if self.n_sink + self.recent >= min(self.budgets):
            raise ValueError(f"n_sink + recent must be below the budget ({min(self.budgets)}), got {n_sink} + {self.recent}")
        self.use_covariance, self.use_vnorm = bool(use_covariance), bool(use_vnorm)
        H = n_kv_heads if n_heads is None else check_int("n_heads", n_heads)
        dev = self.seq_lens.device
        self.q_stat_sum = [torch.zeros(batch, H, head_dim, device=dev) for _ in range(n_layers)]
        self.q_stat_outer = [torch.zeros(batch, H, head_dim, head_dim, device=dev) for _ in range(n_layers)]
        self.q_stat_n = [torch.zeros(batch, device=dev) for _ in range(n_layers)]
        self.next_rope = [torch.zeros(batch, dtype=torch.int64, device=dev) for _ in range(n_layers)]

    @classmethod
    def for_model(cls, model, batch, budget, kernels=None, **options):
        return super().for_model(model, batch, budget, kernels, n_heads=model.config.n_heads, **options)

    def reset(self, batch=None, length=None):
        super().reset(batch, length)
        for t in self.q_stat_sum + self.q_stat_outer + self.q_stat_n + self.next_rope:
            t.zero_()

    def observe_queries(self, layer_idx, q, rope_pos, true_pos, N):
        if q.shape[1] != self.q_stat_sum[layer_idx].shape[1]:
            raise ValueError(f"q has {q.shape[1]} heads, the statistics {self.q_stat_sum[layer_idx].shape[1]}: "
                             "build the cache with n_heads (for_model does)")
        pre = _rotate(q.float(), -rope_pos[:, None], self.inv_freq.float())  # (B, H, T, D) before RoPE
        w = (true_pos >= self.n_sink).float()[:, None, :, None]  # (B, 1, T, 1): sinks' queries are outliers
        self.q_stat_sum[layer_idx] += (pre * w).sum(2)
        self.q_stat_outer[layer_idx] += torch.einsum("bhti,bhtj->bhij", pre * w, pre)
        self.q_stat_n[layer_idx] += w[:, 0, :, 0].sum(1)
        self.next_rope[layer_idx].copy_(rope_pos[:, -1] + 1)

    def expected_query(self, layer_idx):
        """(mū (B, H, D), Σ̄ (B, H, D, D)): the query statistics with RoPE averaged over the next n_future
        positions (Σ̄ is zero without use_covariance)."""
        n = self.q_stat_n[layer_idx].clamp(min=1)[:, None, None]
        mu = self.q_stat_sum[layer_idx] / n
        cov = self.q_stat_outer[layer_idx] / n[..., None] - mu[..., :, None] * mu[..., None, :]
        future = self.next_rope[layer_idx][:, None] + torch.arange(self.n_future, device=mu.device)  # (B, F)
        cos, sin = rope_cos_sin(future, self.inv_freq.float(), torch.float32)  # (B, F, D)
        cos, sin = cos.mean(1)[:, None], sin.mean(1)[:, None]  # (B, 1, D): R̄ x = rotate(x, cos̄, sin̄)
        mu_r = rotate(mu, cos, sin)
        if not self.use_covariance:
            return mu_r, torch.zeros_like(cov)
        half = rotate(cov, cos[:, :, None], sin[:, :, None])  # rows rotated: Σ R̄^T
        return mu_r, rotate(half.transpose(-1, -2), cos[:, :, None], sin[:, :, None]).transpose(-1, -2)  # R̄ Σ R̄^T

    def score_held(self, layer_idx, N):
        keys = self._gather_keys(layer_idx, N)  # (B, H_KV, N, D) fp32 as attention reads them
        B, H_KV, _, D = keys.shape
        mu, cov = self.expected_query(layer_idx)  # (B, H, D), (B, H, D, D)
        n_rep = mu.shape[1] // H_KV
        k = keys.repeat_interleave(n_rep, 1)  # (B, H, N, D)
        logits = (k @ mu[..., None]).squeeze(-1) / math.sqrt(D)
        if self.use_covariance:
            logits = logits + ((k @ cov) * k).sum(-1) / (2 * D)
        rows = self.index[layer_idx][:, :, :N]
        held = torch.arange(N, device=keys.device)[None, None] < self.n_held[layer_idx][:, None, None]
        sink = (self.pos[layer_idx].gather(2, rows) < self.n_sink) & held  # (B, H_KV, N)
        ranked = (held & ~sink).repeat_interleave(n_rep, 1)  # kvpress softmaxes over the keys after the sinks
        probs = torch.softmax(logits.masked_fill(~ranked, float("-inf")), dim=-1)  # (B, H, N)
        score = probs.view(B, H_KV, n_rep, N).mean(2)
        if self.use_vnorm:
            v = self.v[layer_idx].gather(2, rows[..., None].expand(B, H_KV, N, D)).float()
            score = score * v.norm(dim=-1)
        return score.masked_fill(sink, float("inf"))


# --------------------------------------------------------------------------------------------
# Eviction on the paged cache: whole blocks go back to the pool
# --------------------------------------------------------------------------------------------


class PagedWindowCache(PagedKVCache):
    """Chapter 05's paged cache with a window: after each call, whole blocks that fell out of the
    last ``budget`` positions go back to the pool (the first ``sink_blocks`` blocks stay: sinks).

    A sequence holds between budget - block_size + 1 and budget positions once it is longer than the
    budget. Positions are kept (a key keeps its RoPE position; ``next_positions`` counts every token
    seen). Prefix caching is off (dropped blocks would break the hash chain). A prompt is prefilled
    whole, so the pool must hold it at once: ``num_blocks`` defaults to batch x (blocks of the budget
    + 1) and a longer prompt raises ``OutOfBlocksError``.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> from kvlib.generate import generate
    >>> cache = PagedWindowCache.for_model(model, batch=1, budget=8, block_size=4)
    >>> _ = generate(model, [[1, 2, 3]], 20, cache=cache)
    >>> cache.held(0), cache.dropped[0], len(cache.tables[0]), cache.allocator.num_free  # 22 seen, 8 held
    (6, 16, 2, 1)
    """

    def __init__(self, n_layers, num_blocks, block_size, n_kv_heads, head_dim, dtype=torch.float32, device="cpu",
                 kernels=None, *, budget, sink_blocks=0):
        super().__init__(n_layers, num_blocks, block_size, n_kv_heads, head_dim, dtype, device, kernels,
                         prefix_caching=False)
        self.budget = check_int("budget", budget)
        self.sink_blocks = check_int("sink_blocks", sink_blocks, minimum=0)
        if (self.sink_blocks + 1) * block_size > self.budget:
            raise ValueError(f"budget ({budget}) must cover the sink blocks and one more block of {block_size}")
        self.dropped: dict = {}  # seq id -> positions dropped from the front so far
        self.pool_trace: list[int] = []  # blocks in use after every call (what notebook 09 plots)

    @classmethod
    def for_model(cls, model, batch, budget, block_size=16, num_blocks=None, sink_blocks=0, kernels=None):
        c = model.config
        if num_blocks is None:
            num_blocks = check_int("batch", batch) * (-(-check_int("budget", budget) // block_size) + 1)
        return cls(c.n_layers, num_blocks, block_size, c.n_kv_heads, c.head_dim, model.dtype, model.device,
                   kernels, budget=budget, sink_blocks=sink_blocks)

    def held(self, b) -> int:
        return self.lens[self._known(b, "held")]

    def add_sequence(self, seq_id, prompt_tokens=()) -> int:
        self.dropped[seq_id] = 0
        return super().add_sequence(seq_id, prompt_tokens)

    def free_sequence(self, seq_id):
        super().free_sequence(seq_id)
        self.dropped.pop(seq_id, None)

    def reset(self, batch=None, length=None):
        """Free every sequence. Any length is accepted: the window bounds what is held."""
        for s in list(self.tables):
            self.free_sequence(s)
        self.pool_trace = []

    def next_positions(self) -> torch.Tensor:
        return torch.tensor([[self.lens[b] + self.dropped[b]] for b in range(len(self.lens))], device=self.device)

    def batch(self, seq_ids, new_tokens=None):
        return _WindowBatch(self, self._distinct(seq_ids, "batch"), new_tokens)

    def _evict(self, seq_id):
        bs, table = self.block_size, self.tables[seq_id]
        while self.lens[seq_id] > self.budget and len(table) > self.sink_blocks + 1:
            self.release_block(table.pop(self.sink_blocks))  # a full block: only the last one is partial
            self.lens[seq_id] -= bs
            self.dropped[seq_id] += bs
            del self.tokens[seq_id][self.sink_blocks * bs: (self.sink_blocks + 1) * bs]


class _WindowBatch(_PagedBatch):
    def attend(self, layer_idx, q, k, v):
        out = super().attend(layer_idx, q, k, v)
        c = self.cache
        if layer_idx == len(c.k) - 1:
            for s in self.seq_ids:
                c._evict(s)
            c.pool_trace.append(c.allocator.num_blocks - c.allocator.num_free)
        return out


# How kvlib.course.compile_check builds the index decode kernel: the wrapper's launch for 32 query heads over 8 K/V
# heads, D = 128, fp16, 1024 slots of which 600 / 317 are held, with and without the probabilities.
def _compile_launch(probs: bool):
    g = torch.Generator().manual_seed(0)
    B, H, H_KV, N_slots, D = 2, 32, 8, 1024, 128
    q = torch.randn(B, H, D, generator=g).half()
    k, v = (torch.randn(B, H_KV, N_slots, D, generator=g).half() for _ in range(2))
    index = torch.randperm(N_slots, generator=g)[:640].sort().values.repeat(B, H_KV, 1)
    return index_decode_attention(q, k, v, index, torch.tensor([600, 317]), return_probs=probs)


COMPILE_SPECS = [
    dict(name=f"index decode fp16 32/8{' + probabilities' if probs else ''}", launch=lambda probs=probs: _compile_launch(probs),
         loops={"_index_decode_kernel": lambda a: dict(bytes=2 * a["TILE_N"] * a["TILE_D"] * a["k_ptr"].element_size()
                                                       + a["TILE_N"] * a["index_ptr"].element_size(),
                                                       reread=a["n_rep"], loop=0)})
    for probs in (False, True)
]
