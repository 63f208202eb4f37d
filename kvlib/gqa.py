"""Grouped-query attention (chapter 07): fewer K/V heads, and a kernel that reads each once.

What you will learn:
- GQA: H query heads share H_KV K/V heads in groups of n_rep = H / H_KV (query head h reads K/V
  head h // n_rep); MQA is H_KV = 1. The cache shrinks by the factor n_rep;
- ``repeat_kv``: the simplest way to run GQA with an MHA kernel — copy each K/V head n_rep times.
  It costs memory traffic: every copy is written and read again;
- ``grouped_decode_attention``: one program per (sequence, K/V head) loads each K/V tile *once*
  and computes all n_rep query heads of its group with ``tl.dot`` (the group padded to 16 rows, the
  height of the tensor cores' fp16 tile, PTX ``mma`` shape m16n8k16; Triton 2 refused a ``tl.dot`` under
  16 rows, Triton 3's NVIDIA backend pads a smaller one itself: ``min_dot_size``), so the bytes read
  per token drop by n_rep. Chapter 03's kernel runs one program per *query* head and reads each K/V
  element n_rep times. The paged (chapter 05) and int8
  (chapter 06) decodes use this kernel too (``PAGED``, ``INT8``): ``grouped_decode_launch``;
- ``mha_to_gqa``: converting a trained MHA model by mean-pooling the K/V projection heads of each
  group (as the GQA paper, Ainslie et al. 2023, does), optionally followed by a short fine-tune.

Shapes: q (B, H, D); caches (B, H_KV, S_max, D); seq_lens (B,).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from . import runtime
from ._triton import check_kernel_dtype, tl, triton
from .attention import dot_on_tensor_cores
from .cache import (_check_cache_args, _compile_inputs, check_num_splits, choose_splits, decode_attention_ref,
                    merge_splits)

__all__ = ["repeat_kv", "grouped_decode_attention", "grouped_decode_attention_ref", "mha_to_gqa", "finetune"]


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_KV, S, D) -> (B, H_KV * n_rep, S, D); K/V head j serves heads j*n_rep .. j*n_rep+n_rep-1.

    >>> x = torch.tensor([10.0, 20.0]).view(1, 2, 1, 1)  # H_KV = 2 heads
    >>> repeat_kv(x, 3).flatten().tolist()  # 6 query heads: 3 per K/V head
    [10.0, 10.0, 10.0, 20.0, 20.0, 20.0]
    """
    if isinstance(n_rep, bool) or not isinstance(n_rep, int) or n_rep < 1:
        raise ValueError(f"n_rep must be an int >= 1, got {n_rep!r}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"x must be (B, H_KV, S, D), got shape {tuple(x.shape)}")
    if n_rep == 1:
        return x
    B, H_KV, S, D = x.shape
    return x[:, :, None].expand(B, H_KV, n_rep, S, D).reshape(B, H_KV * n_rep, S, D)  # a real copy


def grouped_decode_attention_ref(q, k_cache, v_cache, seq_lens):
    """The same result as chapter 03's reference (grouping changes the work, not the answer).

    >>> q, k = torch.ones(1, 4, 8), torch.ones(1, 2, 5, 8)  # H = 4 query heads, H_KV = 2
    >>> grouped_decode_attention_ref(q, k, k, torch.tensor([5])).shape
    torch.Size([1, 4, 8])
    """
    return decode_attention_ref(q, k_cache, v_cache, seq_lens)


@triton.jit
def _kv_offsets(pos0, rows, pos_ok, dims, table_row, stride_kb, stride_ks, stride_vb, stride_vs,
                PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """Where the K and the V tile of positions pos0 + rows (rows = 0 .. TILE_N - 1) lie: int64 offsets
    (TILE_N, TILE_D) of its elements from this K/V head's base pointer (the sequence's own, for a
    contiguous cache). This is all that paging changes (chapter 05).

    Tiles start at multiples of TILE_N and BLOCK_SIZE is a compile-time constant (so pos // BLOCK_SIZE and
    pos % BLOCK_SIZE are a shift and a mask for a power of two), which leaves three cases, chosen when the
    kernel is compiled:
    - BLOCK_SIZE a multiple of TILE_N (128 with 64-row tiles): the tile lies inside one block, so one
      table entry per tile, and its rows are consecutive slots, as in a contiguous cache;
    - TILE_N a multiple of BLOCK_SIZE (1, 2, 16 with 64-row tiles): one table entry per row, and row r
      sits in slot r % BLOCK_SIZE of its block in every tile;
    - any other block size (5, 48): one table entry per row, and its slot pos % BLOCK_SIZE.
    What does not depend on pos0 the compiler computes once, before the kernel's loop.
    """
    pos = pos0 + rows
    if PAGED and BLOCK_SIZE % TILE_N != 0:  # one table entry per row
        blk = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)  # (TILE_N,)
        slots = rows % BLOCK_SIZE if TILE_N % BLOCK_SIZE == 0 else pos % BLOCK_SIZE  # (TILE_N,) each row's slot
        # (the parentheses keep what is the same in every tile apart, for the compiler to hoist)
        k_off = (blk * stride_kb)[:, None] + (slots.to(tl.int64)[:, None] * stride_ks + dims[None, :])
        v_off = (blk * stride_vb)[:, None] + (slots.to(tl.int64)[:, None] * stride_vs + dims[None, :])
    else:  # the tile's rows are consecutive positions (slots): one offset for the tile, then row * stride
        if PAGED:
            blk = tl.load(table_row + pos0 // BLOCK_SIZE).to(tl.int64)  # the tile's one block
            slot0 = tl.cast(pos0 % BLOCK_SIZE, tl.int64)  # the tile's first slot in it
            k0, v0 = blk * stride_kb + slot0 * stride_ks, blk * stride_vb + slot0 * stride_vs
        else:  # a contiguous cache: position p at p * stride
            k0, v0 = tl.cast(pos0, tl.int64) * stride_ks, tl.cast(pos0, tl.int64) * stride_vs
        k_off = k0 + (rows.to(tl.int64)[:, None] * stride_ks + dims[None, :])
        v_off = v0 + (rows.to(tl.int64)[:, None] * stride_vs + dims[None, :])
    return k_off, v_off


@triton.jit
def _grouped_decode_kernel(
    q_ptr, k_ptr, v_ptr,  # q (B, H, D); K/V: caches (B, H_KV, S_max, D), or block pools (num_blocks, BLOCK_SIZE,
    # H_KV, D) when PAGED; int8 when INT8
    o_ptr, lse_ptr,  # partials (B*H, SPLITS, D) fp32 and (B*H, SPLITS) log-sum-exp (log2 units), as _decode_kernel
    seq_lens_ptr,  # (B,)
    block_table_ptr,  # (B, max_blocks) physical block of each logical block (PAGED only; chapter 05)
    k_scale_ptr, v_scale_ptr,  # (B, H_KV, S_max) scale of each cached row (INT8 only; chapter 06)
    stride_qb, stride_qh,  # q strides (D stride 1)
    stride_kb, stride_kh, stride_ks,  # K strides: per sequence (per block when PAGED), per head, per position
    stride_vb, stride_vh, stride_vs,  # V strides, the same way
    stride_bt,  # block table row stride (PAGED only; the column stride is 1)
    stride_sb, stride_sh,  # scale strides per sequence and per head (INT8 only; the position stride is 1)
    H_KV, D, n_rep,  # K/V heads, head dim, query heads per K/V head
    qk_scale,  # 1/sqrt(D) * log2(e)
    PAGED: tl.constexpr,  # True: K/V found through the block table
    BLOCK_SIZE: tl.constexpr,  # positions per block (PAGED only): a constant, so pos // BLOCK_SIZE is a shift for 16
    INT8: tl.constexpr,  # True: K/V int8 with one scale per (sequence, K/V head, position)
    SPLITS: tl.constexpr,  # programs per (sequence, K/V head) along the positions
    GROUP: tl.constexpr,  # n_rep padded to a power of two >= 16 (the tensor cores' 16-row tile; Triton 2's tl.dot minimum)
    TILE_N: tl.constexpr,  # cached positions per step
    TILE_D: tl.constexpr,  # head dim padded to a power of two
    DOT_FP32: tl.constexpr,  # the dots in fp32: only for bf16 in the interpreter (see grouped_decode_partials)
):
    tl.static_assert(not (PAGED and INT8), "a paged int8 cache is not implemented")
    pid = tl.program_id(0)  # which (sequence, K/V head)
    split = tl.program_id(1)  # which slice of the sequence's positions
    # Offsets in 64 bits: Triton passes a stride below 2**31 as int32, and b * stride_kb is computed in the
    # type of its operands, so in 32 bits it wraps once (B-1) * H_KV * S_max * D passes 2**31 (or a block
    # pool holds 2**31 elements). With b, kv_h and block ids in int64, every product with a stride is 64-bit.
    b = (pid // H_KV).to(tl.int64)
    kv_h = (pid % H_KV).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    # Split-K sized by this sequence's own length (as vLLM and SGLang do): SPLITS equal slices, each a whole
    # number of tiles (so tiles start at multiples of TILE_N). Slices past a short sequence's end are empty.
    split_len = tl.cdiv(tl.cdiv(seq_len, SPLITS), TILE_N) * TILE_N
    start = split * split_len
    end = tl.minimum(seq_len, start + split_len)

    g = tl.arange(0, GROUP)  # rows: the query heads of this group (padding rows beyond n_rep)
    g_ok = g < n_rep
    heads = kv_h * n_rep + g  # (GROUP,) query head of each row
    dims = tl.arange(0, TILE_D)
    dim_ok = dims < D
    rows = tl.arange(0, TILE_N)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=g_ok[:, None] & dim_ok[None, :], other=0.0)  # (GROUP, TILE_D), the query's dtype
    if DOT_FP32:
        q = q.to(tl.float32)  # (and each tile below: q.dtype is what the dots multiply)
    k_head = k_ptr + kv_h * stride_kh  # this K/V head's first element (of this sequence, if not PAGED)
    v_head = v_ptr + kv_h * stride_vh
    if not PAGED:
        k_head += b * stride_kb
        v_head += b * stride_vb
    table_row = block_table_ptr + b * stride_bt
    scale_row = b * stride_sb + kv_h * stride_sh  # the scales of this sequence and K/V head (INT8)

    m_i = tl.full((GROUP,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((GROUP,), dtype=tl.float32)
    acc = tl.zeros((GROUP, TILE_D), dtype=tl.float32)
    for pos0 in range(start, end, TILE_N):
        pos = pos0 + rows  # (TILE_N,) the positions of this tile
        pos_ok = pos < end
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k_off, v_off = _kv_offsets(pos0, rows, pos_ok, dims, table_row, stride_kb, stride_ks, stride_vb, stride_vs,
                                   PAGED, BLOCK_SIZE, TILE_N)
        k = tl.load(k_head + k_off, mask=kv_mask, other=0.0)  # (TILE_N, TILE_D): read once for the whole group
        s = tl.dot(q, tl.trans(k).to(q.dtype))  # (GROUP, TILE_N) fp32; an int8 k (|k| <= 127) converts exactly
        if INT8:  # q . (scale * k_int8) = scale * (q . k_int8): one multiply per column (cached row)
            k_scale = tl.load(k_scale_ptr + scale_row + pos, mask=pos_ok, other=0.0).to(tl.float32)
            s = s * (k_scale * qk_scale)[None, :]
        else:
            s = s * qk_scale
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # (GROUP, TILE_N)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_head + v_off, mask=kv_mask, other=0.0)  # (TILE_N, TILE_D)
        if INT8:  # sum_j p_j * (scale_j * v_int8_j) = sum_j (p_j * scale_j) * v_int8_j: fold the scale into p
            p = p * tl.load(v_scale_ptr + scale_row + pos, mask=pos_ok, other=0.0).to(tl.float32)[None, :]
        p = p.to(q_ptr.dtype.element_ty)  # rounded to the query's dtype: fp16/bf16 dots run on tensor cores
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))  # (GROUP, TILE_D)
        m_i = m_new

    out_rows = (b * H_KV * n_rep + heads) * SPLITS + split  # (GROUP,) row of each query head's partial result
    empty = l_i == 0.0  # a split past the end of a short sequence saw no positions
    tl.store(o_ptr + out_rows[:, None] * D + dims[None, :], acc / tl.where(empty, 1.0, l_i)[:, None],
             mask=g_ok[:, None] & dim_ok[None, :])
    tl.store(lse_ptr + out_rows, tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i))),
             mask=g_ok)


def _grouped_config(TILE_D: int, GROUP: int, kv_size: int, tensor_cores: bool, interpreter: bool = False):
    """(TILE_N, num_warps, num_stages) of _grouped_decode_kernel for a padded head dim TILE_D, GROUP query
    rows and K/V elements of kv_size bytes (1: int8).

    Chosen with ``python -m kvlib.course.compile_check --module gqa paged quant`` (Triton 3.9; 32/8 heads, D = 128):
    nothing spills, and among those the fewest SASS instructions in the main loop per KB of K/V it reads.

    - Tensor cores (fp16/bf16 on sm_80 and sm_90): 64 positions, 4 warps, 2 stages: 96 / 128 registers,
      38 KB shared, 334 / 380 instructions per 32 KB step = 42 / 47 per KB (32 positions: 58 / 55 per KB;
      128 with 8 warps: 47 / 48). Through a block table: 53 per KB at block size 16 (16-row tiles, one table
      entry each, took 91 / 94), 43 / 44 at 128, 57 at 1. int8: 3 stages (its tiles are half the bytes):
      222 / 172 registers, 197 / 201 per KB; half of that loop converts the int8 operands of the dots to
      fp16 after their shared-memory loads (byte permutes and I2F), which the fp16 kernel does not do.
    - FMA units (fp32 anywhere; every dtype on a T4, sm_75): tl.dot keeps whole tiles in registers, so 16
      positions: 127 registers on sm_75 (32 take 226), 405 instructions per KB in fp16 there, 204 in fp32
      on sm_90 (where 32 positions spill 536 bytes). int8: 1 stage (with an fp32 query 2 spill 192 bytes).
    - 8 warps for 64 query rows (MQA, 64/1 heads) on tensor cores (4 warps take 255 registers on sm_80)
      and for 32 on FMA units (227 registers with 4 warps; 64 rows spill 528 bytes on sm_75).
    """
    if interpreter:  # NumPy: fewer, larger steps run faster
        return 32, 4, 1
    num_warps = 4 if GROUP <= (32 if tensor_cores else 16) else 8
    if not tensor_cores:
        return max(16, 2048 // TILE_D), num_warps, 1 if kv_size == 1 else 2
    return max(16, 8192 // TILE_D), num_warps, 3 if kv_size == 1 else 2


def grouped_decode_launch(q, k, v, seq_lens, kv_strides, H_KV, num_splits=None, longest=None, *,
                          block_table=None, block_size=1, k_scale=None, v_scale=None):
    """Run ``_grouped_decode_kernel`` and merge its splits: decode attention over a contiguous cache, or
    with a block table a paged one (chapter 05), or with scales an int8 one (chapter 06). ``kv_strides``:
    (K per sequence or block, per head, per position, then the same for V); ``longest``: the longest of
    seq_lens if the caller knows it (saves a GPU sync). Returns (B, H, D) in q's dtype."""
    return merge_splits(q, *grouped_decode_partials(q, k, v, seq_lens, kv_strides, H_KV, num_splits, longest,
                                                    block_table=block_table, block_size=block_size,
                                                    k_scale=k_scale, v_scale=v_scale))


def grouped_decode_partials(q, k, v, seq_lens, kv_strides, H_KV, num_splits=None, longest=None, *,
                            block_table=None, block_size=1, k_scale=None, v_scale=None):
    """``grouped_decode_launch`` before the merge: the kernel's per-split partial outputs (B*H, SPLITS, D)
    and log-sum-exps (B*H, SPLITS), -inf for a split that held no positions."""
    B, H, D = q.shape
    if num_splits is None:  # the grid launches B·H_KV programs per split
        num_splits = choose_splits(B * H_KV, int(seq_lens.max()) if longest is None else longest)
    check_num_splits(num_splits)
    seq_lens = seq_lens.contiguous()  # the kernel reads seq_lens[b] and block_table[b, i] with unit strides
    paged, int8 = block_table is not None, k_scale is not None
    bt = block_table.contiguous() if paged else seq_lens  # any int tensor: never read when not PAGED
    ks, vs = (k_scale, v_scale) if int8 else (q, q)  # any tensor: never read when not INT8
    TILE_D = max(16, triton.next_power_of_2(D))
    GROUP = max(16, triton.next_power_of_2(H // H_KV))
    TILE_N, num_warps, num_stages = _grouped_config(TILE_D, GROUP, k.element_size(),
                                                    dot_on_tensor_cores(q.dtype, q.device), runtime.INTERPRETER)
    part = torch.empty(B * H, num_splits, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(B * H, num_splits, device=q.device, dtype=torch.float32)
    _grouped_decode_kernel[(B * H_KV, num_splits)](
        q, k, v, part, lse, seq_lens, bt, ks, vs, q.stride(0), q.stride(1), *kv_strides,
        bt.stride(0) if paged else 0, ks.stride(0) if int8 else 0, ks.stride(1) if int8 else 0,
        H_KV, D, H // H_KV, (1.0 / math.sqrt(D)) * 1.4426950408889634,
        PAGED=paged, BLOCK_SIZE=block_size if paged else 1, INT8=int8, SPLITS=num_splits,
        GROUP=GROUP, TILE_N=TILE_N, TILE_D=TILE_D,
        # NumPy has no bf16: the interpreter keeps bf16 as raw 16-bit integers and its tl.dot multiplies
        # those, so there (only) the dot's operands go to fp32 first, after the same rounding as on a GPU.
        DOT_FP32=runtime.INTERPRETER and q.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages,
    )
    return part, lse


def grouped_decode_attention(q, k_cache, v_cache, seq_lens, num_splits=None):
    """Decode attention with one program per (sequence, K/V head) serving its whole query group.

    q (B, H, D); caches (B, H_KV, S_max, D), fp32 or fp16 (bf16 only on a GPU of compute capability
    >= 8.0); seq_lens (B,). num_splits: None chooses (``cache.choose_splits``), else a power of two.

    >>> from kvlib.runtime import DEVICE
    >>> g = torch.Generator().manual_seed(0)
    >>> q = torch.randn(2, 8, 16, generator=g).to(DEVICE)  # H = 8
    >>> k, v = (torch.randn(2, 2, 8, 16, generator=g).to(DEVICE) for _ in range(2))  # H_KV = 2: groups of 4
    >>> lens = torch.tensor([8, 5], device=DEVICE)
    >>> out = grouped_decode_attention(q, k, v, lens)
    >>> torch.allclose(out, grouped_decode_attention_ref(q, k, v, lens), atol=1e-5)
    True
    """
    longest = _check_cache_args(q, k_cache, v_cache, seq_lens)
    check_kernel_dtype("gqa.grouped_decode_attention", "q", q, dot=True)
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("q, k_cache and v_cache must be contiguous along the head dim D (stride 1)")
    if not runtime.require_triton("gqa.grouped_decode_attention", q=q, k_cache=k_cache,
                                  v_cache=v_cache, seq_lens=seq_lens):
        return grouped_decode_attention_ref(q, k_cache, v_cache, seq_lens)
    kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    return grouped_decode_launch(q, k_cache, v_cache, seq_lens, kv_strides, k_cache.shape[1], num_splits, longest)


# --------------------------------------------------------------------------------------------
# Converting a trained MHA model
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def mha_to_gqa(model, n_kv_heads: int):
    """A copy of ``model`` with ``n_kv_heads`` K/V heads: each group's K and V projection heads are
    averaged (mean-pooling, as in the GQA paper). Query and output projections are unchanged.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> mha = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=4, hidden_dim=64)).eval()
    >>> gqa = mha_to_gqa(mha, 2)
    >>> gqa.config.n_kv_heads, tuple(gqa.layers[0].attn.wk.weight.shape)  # (H_KV * D, C)
    (2, (16, 32))
    """
    cfg = model.config
    if not isinstance(n_kv_heads, int) or n_kv_heads < 1 or cfg.n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads must be a positive divisor of n_heads={cfg.n_heads}, got {n_kv_heads!r}")
    if cfg.n_kv_heads != cfg.n_heads:
        raise ValueError(f"mha_to_gqa converts an MHA model (n_kv_heads == n_heads); this one has {cfg.n_kv_heads}")
    from .model import Transformer

    new_cfg = copy.deepcopy(cfg)
    new_cfg.n_kv_heads = n_kv_heads
    new = Transformer(new_cfg).to(model.device, model.dtype)
    state = model.state_dict()
    group, D, C = cfg.n_heads // n_kv_heads, cfg.head_dim, cfg.dim
    for name, t in state.items():
        if name.endswith(("attn.wk.weight", "attn.wv.weight")):  # (H*D, C) -> (H_KV, group, D, C) -> mean
            state[name] = t.view(n_kv_heads, group, D, C).mean(dim=1).reshape(n_kv_heads * D, C)
        elif name.endswith(("attn.wk.bias", "attn.wv.bias")):
            state[name] = t.view(n_kv_heads, group, D).mean(dim=1).reshape(n_kv_heads * D)
    new.load_state_dict(state)
    return new.eval()


def finetune(model, train_ids: torch.Tensor, steps: int = 60, batch: int = 8, seq_len: int = 128,
             lr: float = 5e-4, seed: int = 0, progress: bool = False, lr_at=None) -> list[float]:
    """A short, seeded AdamW fine-tune on random windows of ``train_ids``; returns the batch losses.

    lr_at: optional schedule, a function of the step (0 .. steps - 1) giving that step's rate; without it every
    step uses ``lr``."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    steps_iter = range(steps)
    if progress:
        from tqdm.auto import tqdm

        steps_iter = tqdm(steps_iter, desc="fine-tune", leave=False)
    for step in steps_iter:
        if lr_at is not None:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
        starts = torch.randint(0, len(train_ids) - seq_len - 1, (batch,), generator=gen).tolist()
        x = torch.stack([train_ids[s: s + seq_len] for s in starts]).to(model.device)
        y = torch.stack([train_ids[s + 1: s + 1 + seq_len] for s in starts]).to(model.device)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


# --------------------------------------------------------------------------------------------
# How kvlib.course.compile_check builds the kernel (kvlib.paged and kvlib.quant use these helpers too)
# --------------------------------------------------------------------------------------------


def _decode_loop(a):
    """What one program of _grouped_decode_kernel loads per step: a K and a V tile (and their scales, INT8),
    once for its whole group of query heads."""
    scales = 2 * a["TILE_N"] * a["k_scale_ptr"].element_size() if a["INT8"] else 0
    return dict(bytes=2 * a["TILE_N"] * a["TILE_D"] * a["k_ptr"].element_size() + scales, reread=1)


DECODE_LOOPS = {"_grouped_decode_kernel": _decode_loop}

COMPILE_SPECS = [
    *(dict(name=f"grouped {dt} {H}/8 splits={n}", archs=(80, 90) if dt == "bf16" else (75, 80, 90), loops=DECODE_LOOPS,
           launch=lambda dt=dt, H=H, n=n: grouped_decode_attention(*_compile_inputs(dt, H=H), num_splits=n))
      for dt, H, n in (("fp16", 32, 1), ("fp16", 32, 8), ("fp16", 64, 1), ("fp16", 64, 8), ("bf16", 32, 8),
                       ("fp32", 32, 8))),
]
