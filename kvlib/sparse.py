"""Reading only part of the cache (chapter 11): Quest's query-aware block selection.

Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
arXiv:2406.10774; reference code github.com/mit-han-lab/Quest, followed here).

What you will learn:
- chapter 09's budgeted caches *throw away* positions, and a position thrown away cannot come back when
  a later query needs it. Quest keeps everything and instead *reads* only the blocks (pages) that can
  matter to the current query: memory stays the full cache, the bytes read per decode step shrink;
- per block of ``block_size`` positions and per K/V head, a *summary*: the element-wise minimum and
  maximum of the block's keys (as cached, i.e. after RoPE), over its filled rows only
  (``block_summaries``; ``update_block_summaries`` keeps it current as tokens are appended);
- an upper bound of q . k over a block without reading its keys: for every dimension i,
  q_i k_i <= max(q_i * max_i, q_i * min_i), so sum_i max(q_i max_i, q_i min_i) >= q . k for every key
  of the block (``block_upper_bound``);
- ``select_blocks``: per *query* head (with GQA the heads of one K/V group may pick different blocks)
  the current, partly filled last block plus the ``n_select - 1`` other blocks with the highest bounds,
  as Quest's kernels do (its ``page_budget`` counts the last page);
- ``sparse_decode_attention``: exact attention (softmax over the selected blocks' positions only) by a
  Triton kernel that loads only the selected blocks, through chapter 05's block table or from a
  contiguous buffer viewed as blocks; ``sparse_decode_attention_ref`` is the PyTorch reference;
- ``QuestCache``: chapter 03's cache with summaries, dense prefill and dense first layers (Quest's
  rule), top-b decode, and counters of the bytes it *reads* per step next to the bytes it *keeps*.

Shapes: q (B, H, D); contiguous caches (B, H_KV, S_max, D) or paged pools (num_blocks, block_size,
H_KV, D) with block_tables (B, max_blocks); summaries kmin, kmax (B, H_KV, n_blocks, D); selection
(B, H, n_sel) logical block ids, ascending, -1 as padding at the end.
"""

from __future__ import annotations

import math

import torch

from . import runtime
from ._triton import check_kernel_dtype, tl, triton
from .attention import attention_ref, flash_attention
from .cache import (KVCache, _check_cache_args, check_int, decode_attention, decode_attention_ref,
                    store_kv, store_kv_ref)
from .evict import _attend_gathered_rows
from .paged import _check_paged_args, _paged_inputs

__all__ = ["block_summaries", "update_block_summaries", "block_upper_bound", "select_blocks",
           "sparse_decode_attention", "sparse_decode_attention_ref", "QuestCache"]


# --------------------------------------------------------------------------------------------
# Block summaries, the bound, the selection
# --------------------------------------------------------------------------------------------


def _check_keys(name, k):
    if not isinstance(k, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(k).__name__}")
    if k.dim() != 4 or not k.is_floating_point() or k.numel() == 0:
        raise ValueError(f"{name} must be a non-empty floating-point (B, H_KV, S, D) tensor, got "
                         f"{tuple(k.shape)} {k.dtype}")


def block_summaries(k: torch.Tensor, seq_lens: torch.Tensor, block_size: int):
    """(kmin, kmax), each (B, H_KV, n_blocks, D) in k's dtype: the element-wise min and max of each block's
    keys over its filled rows (positions < seq_lens[b]); n_blocks = ceil(S_max / block_size). Blocks past
    a sequence's end hold zeros (``select_blocks`` never looks at them).

    k: (B, H_KV, S_max, D) keys as cached (after RoPE); seq_lens (B,) integer.

    >>> k = torch.tensor([1., 5., -2., 7., 9.]).view(1, 1, 5, 1)  # 5 positions, D = 1
    >>> kmin, kmax = block_summaries(k, torch.tensor([4]), block_size=2)  # position 4 is not filled
    >>> kmin.flatten().tolist(), kmax.flatten().tolist()
    ([1.0, -2.0, 0.0], [5.0, 7.0, 0.0])
    """
    _check_keys("k", k)
    bs = check_int("block_size", block_size)
    B, H_KV, S, D = k.shape
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.shape != (B,) or seq_lens.is_floating_point():
        raise ValueError(f"seq_lens must be a (B={B},) integer tensor, got {getattr(seq_lens, 'shape', seq_lens)}")
    n_blocks = -(-S // bs)
    filled = torch.arange(n_blocks * bs, device=k.device)[None] < seq_lens.to(k.device)[:, None]  # (B, n_blocks*bs)
    filled = filled[:, None, :, None]
    pad = torch.zeros(B, H_KV, n_blocks * bs - S, D, dtype=k.dtype, device=k.device)
    rows = torch.cat([k, pad], 2)  # (B, H_KV, n_blocks*bs, D)
    kmin = rows.masked_fill(~filled, float("inf")).view(B, H_KV, n_blocks, bs, D).amin(3)
    kmax = rows.masked_fill(~filled, float("-inf")).view(B, H_KV, n_blocks, bs, D).amax(3)
    empty = ~filled.view(B, 1, n_blocks, bs, 1).any(3)  # (B, 1, n_blocks, 1)
    return kmin.masked_fill(empty, 0), kmax.masked_fill(empty, 0)


def update_block_summaries(kmin, kmax, k_new, start, block_size: int):
    """Fold T new keys per sequence into the summaries, in place: k_new (B, H_KV, T, D) lands at positions
    start[b] .. start[b] + T - 1. Only the blocks those positions touch change: a block the call starts
    (offset 0) gets the new rows' min/max, a partly filled one combines them with what it held.

    >>> kmin, kmax = torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1)  # 2 blocks of 2, D = 1
    >>> update_block_summaries(kmin, kmax, torch.tensor([3., -1., 4.]).view(1, 1, 3, 1), torch.tensor([0]), 2)
    >>> update_block_summaries(kmin, kmax, torch.tensor([8.]).view(1, 1, 1, 1), torch.tensor([3]), 2)
    >>> kmin.flatten().tolist(), kmax.flatten().tolist()  # block 0: {3, -1}; block 1: {4, 8}
    ([-1.0, 4.0], [3.0, 8.0])
    """
    _check_keys("k_new", k_new)
    bs = check_int("block_size", block_size)
    B, H_KV, T, D = k_new.shape
    n_blocks = kmin.shape[2] if isinstance(kmin, torch.Tensor) else 0
    for name, s in (("kmin", kmin), ("kmax", kmax)):
        if not isinstance(s, torch.Tensor) or s.dim() != 4 or tuple(s.shape[:2]) != (B, H_KV) or s.shape[3] != D \
                or s.shape[2] != n_blocks or s.dtype != k_new.dtype or s.device != k_new.device:
            raise ValueError(f"{name} must be a (B={B}, H_KV={H_KV}, n_blocks, D={D}) {k_new.dtype} tensor on "
                             f"{k_new.device} like k_new, got {getattr(s, 'shape', s)}")
    starts = [check_int("start[b]", int(s), minimum=0) for s in start.tolist()] if isinstance(start, torch.Tensor) \
        else None
    if starts is None or len(starts) != B:
        raise ValueError(f"start must be a (B={B},) integer tensor")
    for b, s in enumerate(starts):
        first, last = s // bs, (s + T - 1) // bs  # the blocks this call touches
        if last >= n_blocks:
            raise ValueError(f"positions {s}..{s + T - 1} run past the summaries' {n_blocks} blocks of {bs}")
        off = s - first * bs  # rows of the first block filled before this call
        width = (last - first + 1) * bs
        rows = k_new[b].new_empty(H_KV, width, D)  # the touched blocks, new rows placed at their offsets
        lo = rows.fill_(float("inf")).clone()
        lo[:, off: off + T] = k_new[b]
        hi = rows.fill_(float("-inf"))
        hi[:, off: off + T] = k_new[b]
        lo = lo.view(H_KV, last - first + 1, bs, D).amin(2)
        hi = hi.view(H_KV, last - first + 1, bs, D).amax(2)
        if off:  # the first block already held rows 0..off-1: combine
            lo[:, 0] = torch.minimum(lo[:, 0], kmin[b, :, first])
            hi[:, 0] = torch.maximum(hi[:, 0], kmax[b, :, first])
        kmin[b, :, first: last + 1] = lo
        kmax[b, :, first: last + 1] = hi


def block_upper_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's bound: sum_i max(q_i * kmax_i, q_i * kmin_i) >= q . k for every key k of the block, fp32.

    q (B, H, D) -> (B, H, n_blocks); or q (B, H, T, D) (several queries) -> (B, H, T, n_blocks). kmin,
    kmax (B, H_KV, n_blocks, D); query head h reads K/V head h // (H // H_KV). Not scaled by 1/sqrt(D):
    only the order matters.

    >>> kmin, kmax = torch.tensor([[[[-1., 0.]]]]), torch.tensor([[[[2., 3.]]]])  # one block, D = 2
    >>> block_upper_bound(torch.tensor([[[1., -1.]]]), kmin, kmax)  # 1*2 + (-1)*0: the key (2, 0)
    tensor([[[2.]]])
    """
    if not isinstance(q, torch.Tensor) or q.dim() not in (3, 4) or not q.is_floating_point():
        raise ValueError(f"q must be a floating-point (B, H, D) or (B, H, T, D) tensor, got {getattr(q, 'shape', q)}")
    for name, s in (("kmin", kmin), ("kmax", kmax)):
        if not isinstance(s, torch.Tensor) or s.dim() != 4 or s.shape[0] != q.shape[0] or s.shape[3] != q.shape[-1] \
                or s.shape != kmin.shape or q.shape[1] % s.shape[1]:
            raise ValueError(f"{name} must be (B={q.shape[0]}, H_KV, n_blocks, D={q.shape[-1]}) with H_KV dividing "
                             f"H={q.shape[1]}, both alike, got {getattr(s, 'shape', s)}")
    if q.device != kmin.device or q.device != kmax.device:
        raise ValueError("q, kmin and kmax must be on one device")
    single = q.dim() == 3
    q4 = q.float()[:, :, None] if single else q.float()  # (B, H, T, D)
    n_rep = q.shape[1] // kmin.shape[1]
    lo = kmin.float().repeat_interleave(n_rep, 1)[:, :, None]  # (B, H, 1, N, D)
    hi = kmax.float().repeat_interleave(n_rep, 1)[:, :, None]
    qe = q4[:, :, :, None]  # (B, H, T, 1, D)
    bound = torch.maximum(qe * hi, qe * lo).sum(-1)  # (B, H, T, N)
    return bound[:, :, 0] if single else bound


def select_blocks(bound: torch.Tensor, lengths: torch.Tensor, block_size: int, n_select: int) -> torch.Tensor:
    """Quest's top-b: per query head, the block the query's own position is in (always kept: it is the
    current, partly filled block) and the ``n_select - 1`` earlier blocks with the highest ``bound``.

    bound (B, H, N) with lengths (B,) (each sequence's length, the query's position + 1), or bound
    (B, H, T, N) with lengths (B, T) (one length per query). Returns int64 block ids (B, H, n_sel) or
    (B, H, T, n_sel), n_sel = min(n_select, N), ascending, padded with -1 where a sequence has fewer blocks.

    >>> bound = torch.tensor([[[5., 1., 9., 3., 0.]]])  # (B=1, H=1, 5 blocks)
    >>> select_blocks(bound, torch.tensor([9]), block_size=2, n_select=3)  # block 4 is current, + 2 and 0
    tensor([[[0, 2, 4]]])
    >>> select_blocks(bound, torch.tensor([3]), block_size=2, n_select=3)  # 2 blocks only: both, then -1
    tensor([[[ 0,  1, -1]]])
    """
    if not isinstance(bound, torch.Tensor) or bound.dim() not in (3, 4) or not bound.is_floating_point():
        raise ValueError(f"bound must be a floating-point (B, H, N) or (B, H, T, N) tensor, got "
                         f"{getattr(bound, 'shape', bound)}")
    bs, n_select = check_int("block_size", block_size), check_int("n_select", n_select)
    single = bound.dim() == 3
    want = (bound.shape[0],) if single else (bound.shape[0], bound.shape[2])
    if not isinstance(lengths, torch.Tensor) or tuple(lengths.shape) != want or lengths.is_floating_point():
        raise ValueError(f"lengths must be an integer tensor of shape {want}, got {getattr(lengths, 'shape', lengths)}")
    b4 = bound.float()[:, :, None] if single else bound.float()  # (B, H, T, N)
    N = b4.shape[-1]
    lens = (lengths if not single else lengths[:, None]).to(bound.device).long()  # (B, T)
    lo, hi = torch.stack([lens.min(), lens.max()]).tolist()
    if lo < 1 or hi > N * bs:
        raise ValueError(f"lengths must lie in 1..{N * bs} (N={N} blocks of {bs}), got values in {lo}..{hi}")
    current = ((lens - 1) // bs)[:, None, :, None]  # (B, 1, T, 1) the block holding the query's position
    ids = torch.arange(N, device=bound.device)
    earlier = b4.masked_fill(ids >= current, float("-inf"))  # only blocks before the current one compete
    n_top = min(n_select - 1, N)
    top = earlier.topk(n_top, dim=-1)  # ties: torch's order (deterministic on one machine)
    picked = top.indices.masked_fill(top.values == float("-inf"), N)  # N: no block (fewer candidates)
    picked = torch.cat([picked, current.expand(*b4.shape[:3], 1)], -1).sort(-1).values  # -1 padding goes last
    picked = picked[..., :min(n_select, N)]
    picked = picked.masked_fill(picked == N, -1)
    return picked[:, :, 0] if single else picked


# --------------------------------------------------------------------------------------------
# Attention over the selected blocks: reference, kernel, wrapper
# --------------------------------------------------------------------------------------------


def _check_sparse_args(q, k_cache, v_cache, selection, seq_lens, block_size, block_tables):
    """Shapes, dtypes and devices of a sparse decode, and a selection that names real blocks of each
    sequence (ascending, -1 only as padding at the end, at least one block per head). Returns
    (block_size, the longest sequence)."""
    if block_tables is None:  # contiguous (B, H_KV, S_max, D)
        if block_size is None:
            raise ValueError("block_size is needed with a contiguous cache (B, H_KV, S_max, D) (no block_tables)")
        bs = check_int("block_size", block_size)
        longest = _check_cache_args(q, k_cache, v_cache, seq_lens)
    else:  # paged pools (num_blocks, block_size, H_KV, D), chapter 05
        longest = _check_paged_args(q, k_cache, v_cache, block_tables, seq_lens)
        bs = k_cache.shape[1]
        if block_size is not None and check_int("block_size", block_size) != bs:
            raise ValueError(f"block_size={block_size} differs from the pools' block size {bs}")
    B, H, _ = q.shape
    if not isinstance(selection, torch.Tensor):
        raise TypeError(f"selection must be a torch.Tensor, got {type(selection).__name__}")
    if selection.dim() != 3 or tuple(selection.shape[:2]) != (B, H) or selection.shape[2] < 1 \
            or selection.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"selection must be a (B={B}, H={H}, n_sel >= 1) int32/int64 tensor of block ids, got "
                         f"{tuple(selection.shape)} {selection.dtype}")
    if selection.device != q.device:
        raise ValueError(f"selection must be on q's device {q.device}, got {selection.device}")
    sel = selection.long()
    used = (seq_lens.long() + bs - 1) // bs  # (B,) blocks each sequence has
    past = (sel >= used[:, None, None]).any(-1).any(-1)  # (B,)
    below = (sel < -1).any()
    order = ((sel[..., 1:] >= 0) & ((sel[..., :-1] < 0) | (sel[..., 1:] <= sel[..., :-1]))).any()
    none = (sel[..., 0] < 0).any()
    flags = torch.cat([past.long(), torch.stack([below, order, none]).long()]).tolist()  # one host read
    if any(flags[:B]):
        b = flags.index(1)
        raise ValueError(f"selection[{b}] names a block past sequence {b}'s end: it has {int(used[b])} block(s) "
                         f"of {bs} (seq_lens[{b}] = {int(seq_lens[b])}), ids 0..{int(used[b]) - 1}")
    below, order, none = flags[B:]
    if below:
        raise ValueError("selection holds a block id below -1 (-1 is the only padding value)")
    if order:
        raise ValueError("selection must list each head's blocks in ascending order without repeats, -1 padding "
                         "only at the end (select_blocks returns it so)")
    if none:
        raise ValueError("selection must name at least one block for every (sequence, head)")
    return bs, longest


def _gather_blocks(k_cache, v_cache, block_tables, block_size, L):
    """k, v (B, H_KV, L, D) of each sequence's first L positions (the contiguous cache's own rows, or
    gathered through the block table; positions past a sequence's end hold whatever the pool holds)."""
    if block_tables is None:
        return k_cache[:, :, :L], v_cache[:, :, :L]
    pos = torch.arange(L, device=k_cache.device)
    blocks = block_tables.long()[:, pos // block_size].clamp(min=0)  # (B, L) physical block of each position
    return (c[blocks, pos % block_size].permute(0, 2, 1, 3) for c in (k_cache, v_cache))  # (B, H_KV, L, D)


def _attend_selected(q, k, v, selection, lengths, block_size):
    """Exact attention over the selected blocks only, fp32, one sequence at a time (as
    ``decode_attention_ref``, so that selecting every block gives its result bit for bit): q (B, H, T, D);
    k, v (B, H_KV, L, D); selection (B, H, T, n_sel) with -1 padding; lengths (B, T) positions each query
    may see (its own position + 1: causal inside the current block). Returns (B, H, T, D) in q's dtype."""
    B, H, T, D = q.shape
    n_rep = H // k.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        L = int(lengths[b].max())
        n_blocks = -(-L // block_size)
        chosen = torch.zeros(H, T, n_blocks + 1, dtype=torch.bool, device=q.device)
        chosen.scatter_(-1, selection[b].long().masked_fill(selection[b] < 0, n_blocks), True)  # -1: spare column
        pos = torch.arange(L, device=q.device)
        allowed = chosen[..., pos // block_size] & (pos < lengths[b][None, :, None])  # (H, T, L)
        kb = k[b, :, :L].float().repeat_interleave(n_rep, 0)  # (H, L, D)
        vb = v[b, :, :L].float().repeat_interleave(n_rep, 0)
        scores = (kb[:, None] @ q[b].float()[..., None])[..., 0] / math.sqrt(D)  # (H, T, L): one query at a time
        p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
        out[b] = (p @ vb).to(q.dtype)  # (H, T, D)
    return out


def sparse_decode_attention_ref(q, k_cache, v_cache, selection, seq_lens, block_size=None, block_tables=None):
    """One query per sequence and head over the positions of its selected blocks only (fp32 softmax).

    Two cache layouts, one selection of *logical* blocks (block j = positions j*bs .. j*bs + bs - 1):
    contiguous k_cache, v_cache (B, H_KV, S_max, D) with ``block_size``; or chapter 05's paged pools
    (num_blocks, block_size, H_KV, D) with ``block_tables`` (B, max_blocks). selection (B, H, n_sel):
    query head h's blocks (``select_blocks`` gives them), ascending, -1 as padding; seq_lens (B,).

    >>> k = torch.zeros(1, 1, 6, 4)  # (B, H_KV, S_max, D): equal scores everywhere
    >>> v = torch.arange(6.0).view(1, 1, 6, 1).expand(1, 1, 6, 4)  # position p holds the value p
    >>> sel = torch.tensor([[[0, 2], [1, -1]]])  # head 0: blocks 0 and 2; head 1: block 1
    >>> out = sparse_decode_attention_ref(torch.zeros(1, 2, 4), k, v, sel, torch.tensor([5]), block_size=2)
    >>> out[0, :, 0]  # head 0: mean of positions 0, 1, 4 (block 2 holds only position 4); head 1: of 2, 3
    tensor([1.6667, 2.5000])
    """
    bs, longest = _check_sparse_args(q, k_cache, v_cache, selection, seq_lens, block_size, block_tables)
    k, v = _gather_blocks(k_cache, v_cache, block_tables, bs, longest)
    out = _attend_selected(q[:, :, None], k, v, selection[:, :, None], seq_lens.long()[:, None], bs)
    return out[:, :, 0]


@triton.jit
def _sparse_decode_kernel(
    q_ptr, k_ptr, v_ptr,  # q (B, H, D); K/V: contiguous (B, H_KV, S_max, D) or pools (num_blocks, bs, H_KV, D)
    o_ptr,  # output (B, H, D) in q's dtype, contiguous
    sel_ptr,  # (B, H, n_sel) logical block ids of each query head, ascending, -1 = padding
    tables_ptr,  # (B, max_blocks) block tables (PAGED only)
    seq_lens_ptr,  # (B,) positions per sequence
    stride_qb, stride_qh,  # q strides (the D stride is 1)
    stride_kb, stride_kblk, stride_ks, stride_kh,  # K (and V) strides: per sequence (0 when paged), per
    #   physical block, per slot inside a block, per K/V head
    stride_sb, stride_sh,  # selection strides per sequence and head (the entry stride is 1)
    stride_tb,  # block table stride per sequence
    H, D, n_rep, n_sel, block_size,  # query heads, head dim, query heads per K/V head, entries, block size
    qk_scale,  # 1/sqrt(D) * log2(e)
    PAGED: tl.constexpr,  # physical block = block_tables[b, logical block]; else the logical block itself
    SEL_TILE: tl.constexpr,  # selected blocks per inner step
    BLOCK_TILE: tl.constexpr,  # block_size padded to a power of two
    TILE_D: tl.constexpr,  # head dim padded to a power of two
):
    pid = tl.program_id(0).to(tl.int64)  # one program per (sequence, query head); 64-bit offsets below
    b = pid // H
    h = pid % H
    kv_h = h // n_rep
    seq_len = tl.load(seq_lens_ptr + b)
    dims = tl.arange(0, TILE_D)
    dim_ok = dims < D
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + dims, mask=dim_ok, other=0.0).to(tl.float32)
    sel_row = sel_ptr + b * stride_sb + h * stride_sh
    head = b * stride_kb + kv_h * stride_kh  # this sequence's K/V head (paged: stride_kb = 0)
    r = tl.arange(0, SEL_TILE * BLOCK_TILE)  # rows of one step: SEL_TILE blocks x BLOCK_TILE slots
    slot = (r % BLOCK_TILE).to(tl.int64)
    m_i = -1.0e30
    l_i = 0.0
    acc = tl.zeros((TILE_D,), dtype=tl.float32)
    for e0 in range(0, n_sel, SEL_TILE):
        e = e0 + r // BLOCK_TILE  # which selection entry each row belongs to
        blk = tl.load(sel_row + e, mask=e < n_sel, other=-1).to(tl.int64)  # its logical block
        pos = blk * block_size + slot
        ok = (blk >= 0) & (slot < block_size) & (pos < seq_len)
        if PAGED:
            phys = tl.load(tables_ptr + b * stride_tb + blk, mask=ok, other=0).to(tl.int64)
        else:
            phys = blk
        rows = head + phys * stride_kblk + slot * stride_ks  # the only new lines: where a selected row lives
        m_i, l_i, acc = _attend_gathered_rows(k_ptr, v_ptr, rows, ok, dims, dim_ok, q, qk_scale, m_i, l_i, acc)
    tl.store(o_ptr + pid * D + dims, (acc / l_i).to(o_ptr.dtype.element_ty), mask=dim_ok)


def sparse_decode_attention(q, k_cache, v_cache, selection, seq_lens, block_size=None, block_tables=None):
    """``sparse_decode_attention_ref`` as a Triton kernel that loads only the selected blocks.

    One program per (sequence, query head), no split along the positions: the heads of one K/V group
    pick different blocks, so a program per K/V head (chapter 07's grouped kernel) would have to load the
    union of their blocks; and a program reads only its n_sel selected blocks, however long the sequence
    is, so its work is bounded by the budget (split-K pays for long sequences; here there are none). Each
    step gathers SEL_TILE whole blocks (their ids from the selection, through the block table when paged)
    and folds them into an online softmax as chapter 03's decode kernel does.

    >>> from kvlib.runtime import DEVICE
    >>> g = torch.Generator().manual_seed(0)
    >>> q = torch.randn(2, 4, 16, generator=g).to(DEVICE)  # (B, H, D)
    >>> k, v = (torch.randn(2, 2, 40, 16, generator=g).to(DEVICE) for _ in range(2))  # (B, H_KV, S_max, D)
    >>> lens = torch.tensor([37, 12], device=DEVICE)
    >>> kmin, kmax = block_summaries(k, lens, 8)
    >>> sel = select_blocks(block_upper_bound(q, kmin, kmax), lens, 8, n_select=2)  # 2 blocks of 8 per head
    >>> out = sparse_decode_attention(q, k, v, sel, lens, block_size=8)
    >>> torch.allclose(out, sparse_decode_attention_ref(q, k, v, sel, lens, block_size=8), atol=1e-5)
    True
    """
    bs, _ = _check_sparse_args(q, k_cache, v_cache, selection, seq_lens, block_size, block_tables)
    check_kernel_dtype("sparse.sparse_decode_attention", "q", q)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("q, k_cache and v_cache must be contiguous along D, and k_cache and v_cache alike")
    if not runtime.require_triton("sparse.sparse_decode_attention", q=q, k_cache=k_cache, v_cache=v_cache,
                                  selection=selection, seq_lens=seq_lens, block_tables=block_tables):
        return sparse_decode_attention_ref(q, k_cache, v_cache, selection, seq_lens, block_size, block_tables)
    B, H, D = q.shape
    paged = block_tables is not None
    if paged:  # pools (num_blocks, bs, H_KV, D)
        strides = (0, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        tables = block_tables.contiguous()
    else:  # (B, H_KV, S_max, D) viewed as blocks of bs consecutive rows
        strides = (k_cache.stride(0), bs * k_cache.stride(2), k_cache.stride(2), k_cache.stride(1))
        tables = seq_lens  # unused
    H_KV = k_cache.shape[2] if paged else k_cache.shape[1]
    selection, seq_lens = selection.contiguous(), seq_lens.contiguous()
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    TILE_D = max(16, triton.next_power_of_2(D))
    BLOCK_TILE = triton.next_power_of_2(bs)
    # rows per step on a GPU: chapter 09's index kernel's 4096 // TILE_D (32 rows of D = 128), for a gather
    # through an index; chapter 03's 64 fp16 rows spill on sm_75 once the block table is read too
    rows = 64 if runtime.INTERPRETER else max(16, 4096 // TILE_D)
    SEL_TILE = max(1, rows // BLOCK_TILE)
    _sparse_decode_kernel[(B * H,)](
        q, k_cache, v_cache, out, selection, tables, seq_lens, q.stride(0), q.stride(1), *strides,
        selection.stride(0), selection.stride(1), tables.stride(0), H, D, H // H_KV, selection.shape[2], bs,
        (1.0 / math.sqrt(D)) * 1.4426950408889634, PAGED=paged, SEL_TILE=SEL_TILE, BLOCK_TILE=BLOCK_TILE,
        TILE_D=TILE_D)
    return out


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------


class QuestCache(KVCache):
    """Chapter 03's contiguous cache read the Quest way: every position is kept, a decode step reads only
    the top ``n_select`` blocks per query head (in layers past the first ``dense_layers``).

    A subclass of ``KVCache`` whose (B, H_KV, S_max, D) buffers are *viewed* as blocks of ``block_size``
    consecutive positions (logical block = physical block: nothing is paged, the simplest layout; the
    kernel also reads chapter 05's pools through a block table). Per layer it keeps ``kmin``, ``kmax``
    (B, H_KV, n_blocks, D) summaries in the cache's dtype, updated as tokens are appended.

    The rules, as Quest's code has them (github.com/mit-han-lab/Quest):
    - the prefill (a call on an empty sequence, T > 1) attends densely;
    - the first ``dense_layers`` layers attend densely (Quest skips its first two layers: default 2);
    - ``n_select`` blocks per query head *including* the current last block (its ``page_budget``), or
      ``token_budget`` positions: n_select = token_budget // block_size. (Quest's accuracy scripts instead
      take the top max(3, budget // page) pages of all, the last page included; that floor of 3 is not used.)
    - several tokens in one call after the prefill (T > 1, e.g. a verification or a scored continuation):
      Quest's code attends densely whenever T > 1; here, by default, each query selects its own blocks
      among those before it (``dense_multi_token=False``), so such calls read what T decode steps
      would; ``dense_multi_token=True`` is Quest's rule. These calls run in PyTorch (the kernel is for
      one query per sequence).

    Counters (per sequence, over the decode queries since ``reset``; the prefill is not counted):
    ``read_bytes`` what attention read — per K/V head the distinct rows its query heads selected (K and V)
    plus the summaries of every block the bound scored (K only); the dense layers read every row —
    ``full_bytes`` what a full cache would have read for the same queries, ``read_steps`` the queries.
    ``bytes_read_per_step(b)``, ``read_fraction(b)`` and ``bytes_kept(b)`` (held K/V + summaries)
    summarize them. Two costs come before any block is read: a block's (kmin, kmax) are as large as one
    position's (K, V), so the bound alone reads 1/block_size of what the full cache reads, and a dense
    layer reads all of it. With SmolLM2's 30 layers, 2 dense, blocks of 16, a step reads at least
    2/30 + 28/30 x 1/16 = 12.5% of the full cache's bytes. And with GQA, the n_rep query heads of a K/V
    head may pick different blocks: their union, up to n_rep x n_select blocks, is what that head reads.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> from kvlib.generate import generate
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = QuestCache.for_model(model, batch=1, max_len=64, block_size=4, token_budget=8, dense_layers=0)
    >>> _ = generate(model, [list(range(1, 15))], 20, cache=cache)  # 14-token prompt, 20 new tokens
    >>> cache.held(0), cache.n_select, int(cache.read_steps[0])  # all 33 fed kept; 19 decode steps
    (33, 2, 19)
    >>> round(cache.read_fraction(0), 3)  # 2 blocks of 4 + the summaries, of what the full cache reads
    0.496
    """

    def __init__(self, n_layers, batch, n_kv_heads, max_len, head_dim, dtype=torch.float32, device="cpu",
                 kernels=None, *, block_size=16, n_select=None, token_budget=None, dense_layers=2,
                 dense_multi_token=False):
        super().__init__(n_layers, batch, n_kv_heads, max_len, head_dim, dtype, device, kernels)
        self.block_size = check_int("block_size", block_size)
        if (n_select is None) == (token_budget is None):
            raise ValueError("give exactly one of n_select (blocks per query head, the current one included) "
                             "and token_budget (positions: n_select = token_budget // block_size)")
        if token_budget is not None:
            token_budget = check_int("token_budget", token_budget)
            if token_budget < self.block_size:
                raise ValueError(f"token_budget must be at least one block (block_size={self.block_size}), "
                                 f"got {token_budget}")
            n_select = token_budget // self.block_size
        self.n_select = check_int("n_select", n_select)
        self.dense_layers = check_int("dense_layers", dense_layers, minimum=0)
        self.dense_multi_token = bool(dense_multi_token)
        n_blocks = -(-max_len // self.block_size)
        shape = (batch, n_kv_heads, n_blocks, head_dim)  # (B, H_KV, n_blocks, D)
        self.kmin = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.kmax = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.read_bytes = torch.zeros(batch, dtype=torch.float64, device=device)  # (B,) tensors: sequence(b)
        self.full_bytes = torch.zeros(batch, dtype=torch.float64, device=device)  # views share them
        self.read_steps = torch.zeros(batch, dtype=torch.int64, device=device)

    @classmethod
    def for_model(cls, model, batch, max_len, kernels=None, **options):
        """options: block_size (16), n_select or token_budget, dense_layers (2), dense_multi_token (False)."""
        c = model.config
        return cls(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, model.dtype, model.device, kernels,
                   **options)

    def nbytes(self) -> int:
        """Bytes of the K/V buffers and the summaries (all preallocated)."""
        return sum(t.nbytes for t in self.k + self.v + self.kmin + self.kmax)

    def reset(self, batch=None, length=None):
        super().reset(batch, length)
        for t in (self.read_bytes, self.full_bytes, self.read_steps):
            t.zero_()

    def truncate(self, b: int, length: int) -> bool:
        """Cut sequence b back to ``length`` positions (rejected draft tokens, chapter 11), summaries included:
        the block the cut lands in gets the min/max of the rows it keeps, the blocks after it zeros, so the
        cache equals one that never saw the cut tokens (min and max are exact, in any order). Returns True.

        >>> cache = QuestCache(1, 1, 1, 8, 2, block_size=4, n_select=1, dense_layers=0)
        >>> _ = cache.attend(0, *(torch.arange(12.).view(1, 1, 6, 2) for _ in range(3)))  # 6 tokens
        >>> cache.truncate(0, 3), cache.kmax[0][0, 0].tolist()  # block 0 keeps rows 0..2; block 1 is empty
        (True, [[4.0, 5.0], [0.0, 0.0]])
        """
        b, m = self._check_truncate(b, length)
        super().truncate(b, m)
        first, bs = m // self.block_size, self.block_size
        for layer, (kmin, kmax) in enumerate(zip(self.kmin, self.kmax)):
            kmin[b, :, first:] = 0
            kmax[b, :, first:] = 0
            if m % bs:
                kept = self.k[layer][b, :, first * bs: m]  # (H_KV, rows kept, D)
                kmin[b, :, first] = kept.amin(1)
                kmax[b, :, first] = kept.amax(1)
        return True

    def _row_bytes(self) -> int:
        """Bytes of one position's K and V in one layer, all K/V heads."""
        _, H_KV, _, D = self.k[0].shape
        return 2 * H_KV * D * self.k[0].element_size()

    def bytes_kept(self, b: int) -> int:
        """Bytes sequence b holds: its K/V rows in every layer plus its blocks' summaries (kmin, kmax)."""
        n = self.held(b)
        return len(self.k) * (n + -(-n // self.block_size)) * self._row_bytes()

    def bytes_read_per_step(self, b: int) -> float:
        """Mean bytes one decode query of sequence b read, all layers (0 before any decode step)."""
        return float(self.read_bytes[b]) / max(1, int(self.read_steps[b]))

    def read_fraction(self, b: int) -> float:
        """What sequence b's decode queries read, as a share of what the full cache reads for them."""
        return float(self.read_bytes[b]) / max(1.0, float(self.full_bytes[b]))

    def attend(self, layer_idx, q, k, v):
        """q (B, H, T, D), k/v (B, H_KV, T, D) -> (B, H, T, D): store, update the summaries, attend
        (densely, or over each query head's selected blocks)."""
        self._check_attend(layer_idx, q, k, v, self.k[0].dtype)
        T, start = q.shape[2], self.seq_lens.clone()
        L = self._make_room(T)
        triton_kernels = self.kernels == "triton"
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        (store_kv if triton_kernels else store_kv_ref)(kc, vc, k, v, start)
        update_block_summaries(self.kmin[layer_idx], self.kmax[layer_idx], k, start, self.block_size)
        prefill = T > 1 and int(start.max()) == 0
        lengths = start.long()[:, None] + torch.arange(1, T + 1, device=start.device)  # (B, T) visible positions
        if layer_idx < self.dense_layers or prefill or (T > 1 and self.dense_multi_token):
            if T == 1:
                out = (decode_attention if triton_kernels else decode_attention_ref)(q[:, :, 0], kc, vc, start + 1)
                out = out[:, :, None]
            else:
                out = (flash_attention if triton_kernels else attention_ref)(q, kc[:, :, :L], vc[:, :, :L], causal=True)
            selection = None
        else:
            n_blocks = -(-L // self.block_size)
            kmin, kmax = self.kmin[layer_idx][:, :, :n_blocks], self.kmax[layer_idx][:, :, :n_blocks]
            if T == 1:
                selection = select_blocks(block_upper_bound(q[:, :, 0], kmin, kmax), start + 1, self.block_size,
                                          self.n_select)[:, :, None]  # (B, H, 1, n_sel)
            else:
                selection = select_blocks(block_upper_bound(q, kmin, kmax), lengths, self.block_size, self.n_select)
            if T == 1 and triton_kernels:
                out = sparse_decode_attention(q[:, :, 0], kc, vc, selection[:, :, 0], start + 1,
                                              block_size=self.block_size)[:, :, None]
            else:
                out = _attend_selected(q, kc[:, :, :L], vc[:, :, :L], selection, lengths, self.block_size)
        if not prefill:
            self._count(selection, lengths, q.shape[1])
            if layer_idx == len(self.k) - 1:
                self.read_steps += T
        self._advance(layer_idx, T)
        return out

    def _count(self, selection, lengths, H):
        """Add one layer's bytes read for queries that may see ``lengths`` (B, T) positions."""
        _, H_KV, _, D = self.k[0].shape
        bs, row = self.block_size, self._row_bytes()  # row: K and V of one position, all K/V heads
        full = lengths.sum(1).double() * row  # (B,) every visible row
        self.full_bytes += full
        if selection is None:
            self.read_bytes += full
            return
        B, _, T, _ = selection.shape
        n_blocks = int((lengths.max() + bs - 1) // bs)
        chosen = torch.zeros(B, H, T, n_blocks + 1, dtype=torch.bool, device=selection.device)
        chosen.scatter_(-1, selection.masked_fill(selection < 0, n_blocks), True)
        per_kv = chosen[..., :n_blocks].view(B, H_KV, H // H_KV, T, n_blocks).any(2)  # (B, H_KV, T, N) union
        first = torch.arange(n_blocks, device=selection.device) * bs
        fill = (lengths[:, None, :, None] - first).clamp(0, bs)  # (B, 1, T, N) visible rows of each block
        rows = (per_kv * fill).sum((1, 2, 3)).double()  # (B,) distinct rows, summed over K/V heads
        scored = ((lengths - 1) // bs).sum(1).double()  # (B,) blocks whose bound was computed (all but the current)
        self.read_bytes += rows * (row // H_KV) + scored * row  # a block's kmin + kmax = one K + V row


# --------------------------------------------------------------------------------------------
# How kvlib.course.compile_check builds the kernel: the wrapper's launches at a realistic shape
# --------------------------------------------------------------------------------------------


def _compile_launch(dtype="fp16", block_size=16, n_sel=64, paged=False):
    """32 query heads over 8 K/V heads, D = 128, two ragged sequences in 1024 positions (chapter 05's and
    03's compile inputs), every head selecting the first n_sel blocks of its sequence."""
    q, k, v, tables, lens = _paged_inputs(dtype, block_size=block_size)
    B, H, _ = q.shape
    used = (lens.long() + block_size - 1) // block_size
    first = torch.arange(n_sel)[None]  # each sequence's first n_sel blocks, -1 past its end
    sel = torch.where(first < used[:, None], first, -1)[:, None].expand(B, H, n_sel).contiguous()
    if paged:
        return sparse_decode_attention(q, k, v, sel, lens, block_tables=tables)
    S_max = tables.shape[1] * block_size
    k, v = (torch.zeros(B, k.shape[2], S_max, k.shape[3], dtype=k.dtype) for _ in range(2))  # (B, H_KV, S_max, D)
    return sparse_decode_attention(q, k, v, sel, lens, block_size=block_size)


COMPILE_SPECS = [
    dict(name=f"sparse decode {dt} 32/8 bs={bs} n_sel={n}{' paged' if paged else ''}",
         archs=(80, 90) if dt == "bf16" else (75, 80, 90),
         launch=lambda dt=dt, bs=bs, n=n, paged=paged: _compile_launch(dt, bs, n, paged),
         loops={"_sparse_decode_kernel": lambda a: dict(
             bytes=2 * a["SEL_TILE"] * a["BLOCK_TILE"] * a["TILE_D"] * a["k_ptr"].element_size()
             + a["SEL_TILE"] * a["sel_ptr"].element_size(), reread=a["n_rep"], loop=0)})
    for dt, bs, n, paged in (("fp16", 16, 64, False), ("fp16", 16, 8, True), ("fp16", 32, 16, False),
                             ("fp16", 32, 16, True), ("bf16", 16, 64, False), ("fp32", 16, 64, True))
]
