"""Ragged paged attention (chapter 08): prefill chunks and decode tokens of many sequences in one call.

What you will learn:
- why a serving engine wants *one* forward per step: with chunked prefill (Sarathi-Serve) and continuous
  batching, a step carries a chunk of some prompt's tokens and one new token of every decoding sequence.
  vLLM V1 lays them all end to end in one "ragged" batch of N tokens, and attention is the only layer
  that has to know where one sequence ends and the next begins;
- ``cu_seqlens_q``, the cumulative query lengths (as in FlashAttention's varlen API): sequence i's n_i new
  tokens are rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of q, and query row j of it sits at the absolute
  position ``seq_lens[i] - n_i + j``: it sees its own sequence's keys 0 .. that position (causal), which
  covers a decode (n_i = 1, every cached key), a first chunk (n_i = seq_lens[i], the usual triangle) and a
  later chunk after a cached prefix (a full rectangle, then the triangle);
- ``ragged_paged_attention_ref``: the answer in plain PyTorch without a Python loop over tokens: sequences
  with the same n_i form one batch (all decodes are one), their K/V gathered through the block tables, one
  batched fp32 softmax attention with the causal mask built from absolute positions;
- ``ragged_paged_attention``: one Triton program per (tile of TILE_Q query tokens of one sequence, K/V head)
  as in vLLM's ``triton_unified_attention``. Its TILE_M rows are the tile's tokens times the n_rep query
  heads sharing the K/V head, so each K/V tile it loads serves all of them (chapter 07's grouping); the
  K/V tiles are found through the block table (``gqa._kv_offsets``, chapter 05) and folded in with
  chapter 01's online softmax (``attention._online_softmax_step``), unmasked below the tile's first query
  position, masked on its diagonal. Which sequence and which first query each program serves comes from a
  small tile table built on the host from ``cu_seqlens_q``.

Shapes: q (N, H, D) the new tokens of B sequences end to end; k_blocks, v_blocks (num_blocks, block_size,
H_KV, D), the new tokens' K/V already stored; block_tables (B, max_blocks) int32, -1 where unused;
cu_seqlens_q (B + 1,); seq_lens (B,) each sequence's length *including* its new tokens. Output (N, H, D).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import runtime
from ._triton import check_kernel_dtype, tl, triton
from .attention import _online_softmax_step, dot_on_tensor_cores
from .cache import _DTYPES
from .gqa import _kv_offsets

__all__ = ["ragged_paged_attention", "ragged_paged_attention_ref", "RaggedPlan"]

_INTS = (torch.int32, torch.int64)


def _check_ragged_args(q, k_blocks, v_blocks, block_tables, cu_seqlens_q, seq_lens):
    """Raise a clear TypeError/ValueError unless the arguments describe a ragged batch; return the host
    copies (cu_seqlens_q as a list, seq_lens as a list), read from the device in one transfer."""
    args = (("q", q), ("k_blocks", k_blocks), ("v_blocks", v_blocks), ("block_tables", block_tables),
            ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens))
    for name, t in args:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or q.numel() == 0:
        raise ValueError(f"q must be a non-empty (N, H, D) tensor (the new tokens end to end), got shape "
                         f"{tuple(q.shape)}")
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating-point tensor, got {q.dtype}")
    if k_blocks.dim() != 4 or k_blocks.numel() == 0:
        raise ValueError(f"k_blocks must be a non-empty (num_blocks, block_size, H_KV, D) pool, got shape "
                         f"{tuple(k_blocks.shape)}")
    if v_blocks.shape != k_blocks.shape:
        raise ValueError(f"v_blocks must have k_blocks' shape {tuple(k_blocks.shape)} (num_blocks, block_size, "
                         f"H_KV, D), got {tuple(v_blocks.shape)}")
    N, H, D = q.shape
    num_blocks, block_size, H_KV, Dk = k_blocks.shape
    if Dk != D:
        raise ValueError(f"k_blocks must be (num_blocks, block_size, H_KV, D={D}) with q's head dim, got "
                         f"{tuple(k_blocks.shape)}")
    if H % H_KV:
        raise ValueError(f"k_blocks has H_KV={H_KV} heads, which must divide q's H={H} heads")
    if not (q.dtype == k_blocks.dtype == v_blocks.dtype):
        raise TypeError(f"k_blocks and v_blocks must have q's dtype {q.dtype}, got {k_blocks.dtype} and "
                        f"{v_blocks.dtype}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] < 1:
        raise ValueError(f"seq_lens must be a (B,) tensor with B >= 1 sequences, got shape {tuple(seq_lens.shape)}")
    B = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must be (B={B}, max_blocks), one row per sequence of seq_lens, got shape "
                         f"{tuple(block_tables.shape)}")
    if cu_seqlens_q.shape != (B + 1,):
        raise ValueError(f"cu_seqlens_q must be (B+1={B + 1},): 0, then where each sequence's tokens end in q, "
                         f"got shape {tuple(cu_seqlens_q.shape)}")
    for name, t in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        if t.dtype not in _INTS:
            raise TypeError(f"{name} must be an int32 or int64 tensor, got {t.dtype}")
    devices = {name: t.device for name, t in args}
    if len(set(devices.values())) != 1:
        raise ValueError("q, k_blocks, v_blocks, block_tables, cu_seqlens_q and seq_lens must be on one device, "
                         f"got {', '.join(f'{n} on {d}' for n, d in devices.items())}")
    # the values: one host read for all of them (a GPU sync costs as much as a small decode step)
    max_blocks = block_tables.shape[1]
    blocks_used = (seq_lens.long() + block_size - 1) // block_size  # (B,)
    used = torch.arange(max_blocks, device=block_tables.device)[None, :] < blocks_used[:, None]  # (B, max_blocks)
    outside = (used & ((block_tables < 0) | (block_tables >= num_blocks))).any(1)  # (B,)
    host = torch.cat([cu_seqlens_q.long(), seq_lens.long(), outside.long()]).tolist()
    cu, lens, bad = host[:B + 1], host[B + 1:2 * B + 1], host[2 * B + 1:]
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens_q must start at 0, got {cu[0]}")
    steps = [cu[i + 1] - cu[i] for i in range(B)]
    if min(steps) < 1:
        i = next(i for i, n in enumerate(steps) if n < 1)
        raise ValueError(f"cu_seqlens_q must increase by >= 1 per sequence (every sequence has a new token), "
                         f"got {cu[i]} then {cu[i + 1]} at sequence {i}")
    if cu[-1] != N:
        raise ValueError(f"cu_seqlens_q must end at N={N}, q's number of rows, got {cu[-1]}")
    for i, (n, L) in enumerate(zip(steps, lens)):
        if n > L:
            raise ValueError(f"seq_lens[{i}]={L} is shorter than its {n} new tokens: seq_lens counts the cached "
                             f"positions plus the new ones")
        if L > max_blocks * block_size:
            raise ValueError(f"seq_lens[{i}]={L} is past max_blocks*block_size={max_blocks * block_size}, what "
                             f"block_tables can address")
    if any(bad):
        i = bad.index(1)
        raise ValueError(f"block_tables[{i}] points outside the pool 0..{num_blocks - 1} within its first "
                         f"{-(-lens[i] // block_size)} block(s) ({lens[i]} positions)")
    return cu, lens


class RaggedPlan:
    """What every layer of one forward shares, worked out once per step instead of once per layer.

    A model with L layers calls ragged attention L times per step with the same block tables, cu_seqlens_q
    and seq_lens; only q and the layer's pools change. The plan checks the arguments once (with their one
    host read), and builds on first use the reference's index tensors and masks and the kernel's tile table.
    Pass it as ``plan=`` to either function; each call still checks that q and the pools have the shapes,
    dtype and device the plan was made for and that the index tensors are the very same objects.
    """

    def __init__(self, q, k_blocks, v_blocks, block_tables, cu_seqlens_q, seq_lens):
        self.cu, self.lens = _check_ragged_args(q, k_blocks, v_blocks, block_tables, cu_seqlens_q, seq_lens)
        self.index = (block_tables, cu_seqlens_q, seq_lens)
        self.layout = (q.shape, k_blocks.shape, q.dtype, q.device)
        self.groups = None  # the reference's, built on its first call
        self.tiles = None  # the kernel's (config, tile table), built on its first call

    def check(self, q, k_blocks, v_blocks, block_tables, cu_seqlens_q, seq_lens):
        """Raise a ValueError unless this call is one the plan was made for (cheap: no host read)."""
        if not all(a is b for a, b in zip((block_tables, cu_seqlens_q, seq_lens), self.index)):
            raise ValueError("plan: block_tables, cu_seqlens_q and seq_lens must be the tensors the plan was made "
                             "from (make one RaggedPlan per forward)")
        for name, t in (("q", q), ("k_blocks", k_blocks), ("v_blocks", v_blocks)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        shapes = (q.shape, k_blocks.shape, q.dtype, q.device)
        if shapes != self.layout or v_blocks.shape != k_blocks.shape or not (
                q.dtype == k_blocks.dtype == v_blocks.dtype) or not (q.device == k_blocks.device == v_blocks.device):
            raise ValueError(f"plan: q {tuple(q.shape)} {q.dtype} and the pools {tuple(k_blocks.shape)}, "
                             f"{tuple(v_blocks.shape)} must match what the plan was made for: q "
                             f"{tuple(self.layout[0])} {self.layout[2]}, pools {tuple(self.layout[1])}, one device")


def _plan_for(plan, q, k_blocks, v_blocks, block_tables, cu_seqlens_q, seq_lens) -> RaggedPlan:
    if plan is None:
        return RaggedPlan(q, k_blocks, v_blocks, block_tables, cu_seqlens_q, seq_lens)
    if not isinstance(plan, RaggedPlan):
        raise TypeError(f"plan must be a kvlib.ragged.RaggedPlan or None, got {type(plan).__name__}")
    plan.check(q, k_blocks, v_blocks, block_tables, cu_seqlens_q, seq_lens)
    return plan


# --------------------------------------------------------------------------------------------
# the reference: one batched attention per group of sequences with the same number of new tokens
# --------------------------------------------------------------------------------------------


def ragged_paged_attention_ref(q, k_blocks, v_blocks, block_tables, cu_seqlens_q, seq_lens, *, plan=None):
    """Each new token attends its own sequence's positions up to itself (fp32 softmax), via the block tables.

    Sequences with the same number of new tokens T are computed together: all decodes (T = 1) in one
    batched attention, a prefill chunk in another. The loop runs over these groups, never over tokens.
    Each group's attention is ``torch.nn.functional.scaled_dot_product_attention`` in fp32 with an additive
    mask of -inf (chapter 01's ``attention.attention_ref`` writes the same steps out; on a CPU, SDPA's fused
    kernel takes the K/V views as gathered, where explicit matmuls would first copy them contiguous).

    >>> k_blocks = torch.zeros(3, 2, 1, 4)  # (num_blocks, block_size, H_KV, D): equal scores everywhere
    >>> v_blocks = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 2, 1, 4)  # block i holds the value i
    >>> tables = torch.tensor([[2, 0], [1, -1]], dtype=torch.int32)  # seq 0: blocks 2, 0; seq 1: block 1
    >>> q = torch.zeros(3, 1, 4)  # (N, H, D): seq 0 decodes 1 token, seq 1 prefills 2 tokens
    >>> cu, lens = torch.tensor([0, 1, 3]), torch.tensor([3, 2])
    >>> ragged_paged_attention_ref(q, k_blocks, v_blocks, tables, cu, lens)[:, 0, 0].tolist()  # a mean each
    [1.3333333730697632, 1.0, 1.0]
    """
    plan = _plan_for(plan, q, k_blocks, v_blocks, block_tables, cu_seqlens_q, seq_lens)
    if plan.groups is None:
        plan.groups = _ref_groups(plan, q, k_blocks, block_tables)
    N, H, D = q.shape
    H_KV = k_blocks.shape[2]
    n_rep = H // H_KV
    out = torch.empty(N, H, D, dtype=q.dtype, device=q.device)
    for T, G, S, blocks, pad, rows, mask in plan.groups:
        k = k_blocks[blocks].reshape(G, S, H_KV, D).float().masked_fill(pad, 0).transpose(1, 2)
        v = v_blocks[blocks].reshape(G, S, H_KV, D).float().masked_fill(pad, 0).transpose(1, 2)
        # the n_rep query heads of a K/V head one above the other: (G, T, H, D) -> (G, H_KV, n_rep * T, D)
        qg = q[rows].float().view(G, T, H_KV, n_rep, D).permute(0, 2, 3, 1, 4).reshape(G, H_KV, n_rep * T, D)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=1.0 / math.sqrt(D))  # (G, H_KV, n_rep*T, D)
        out[rows] = o.view(G, H_KV, n_rep, T, D).permute(0, 3, 1, 2, 4).reshape(G, T, H, D).to(q.dtype)
    return out


def _ref_groups(plan: RaggedPlan, q, k_blocks, block_tables) -> list:
    """The reference's layout, the same for every layer: per group of sequences with T new tokens, the blocks to
    gather, the padding to zero, the rows of q and the additive causal mask."""
    cu, lens = plan.cu, plan.lens
    H, block_size, H_KV = q.shape[1], k_blocks.shape[1], k_blocks.shape[2]
    n_rep, dev = H // H_KV, q.device
    by_T: dict[int, list[int]] = {}  # new tokens T -> the sequences with T new tokens
    for i in range(len(lens)):
        by_T.setdefault(cu[i + 1] - cu[i], []).append(i)
    groups = []
    for T, seqs in by_T.items():
        G, n_blocks = len(seqs), -(-max(lens[i] for i in seqs) // block_size)  # the longest one's blocks
        S = n_blocks * block_size  # key positions, padded to whole blocks of the longest sequence
        idx = torch.tensor(seqs, device=dev)
        # whole blocks at a time (a copy of contiguous rows, not one lookup per position). An entry past a sequence's
        # own blocks (-1 from the engine, or any number a learner's table leaves there: the validator and the kernel
        # never read it) becomes block 0, whose positions lie past the sequence's end and are masked below
        own = torch.tensor([-(-lens[i] // block_size) for i in seqs], device=dev)  # (G,) blocks each one uses
        unused = torch.arange(n_blocks, device=dev)[None, :] >= own[:, None]
        blocks = block_tables[idx, :n_blocks].long().masked_fill(unused, 0).clamp_min(0)  # (G, n_blocks)
        # positions past each sequence's end (its last block's tail, stand-in block 0) may hold anything, even
        # NaN left by a failed step: zeroed, since a masked score of NaN, or 0 x NaN in P V, would still be NaN
        seq_len = torch.tensor([lens[i] for i in seqs], device=dev)
        pad = (torch.arange(S, device=dev)[None, :] >= seq_len[:, None])[:, :, None, None]  # (G, S, 1, 1)
        rows = torch.tensor([cu[i] for i in seqs], device=dev)[:, None] + torch.arange(T, device=dev)  # (G, T)
        q_pos = seq_len[:, None] - T + torch.arange(T, device=dev)  # (G, T)
        # causal by absolute position, which also hides the padding past each sequence's end
        hidden = torch.arange(S, device=dev)[None, None, :] > q_pos[:, :, None]  # (G, T, S)
        # -inf added to the hidden scores; rows r * T + t of every K/V head are token t (for each head r)
        mask = torch.zeros(G, T, S, device=dev).masked_fill_(hidden, float("-inf")).repeat(1, n_rep, 1)[:, None]
        groups.append((T, G, S, blocks, pad, rows, mask))
    return groups


# --------------------------------------------------------------------------------------------
# the kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _ragged_paged_attention_kernel(
    q_ptr,  # (N, H, D) the new tokens of all sequences end to end (D stride 1)
    k_ptr, v_ptr,  # block pools (num_blocks, BLOCK_SIZE, H_KV, D) (D stride 1)
    o_ptr,  # (N, H, D) output, q's dtype
    tiles_ptr,  # (2, num_tiles) int32: the sequence of each program, and its first query token in it
    cu_seqlens_ptr,  # (B + 1,) sequence i's new tokens are rows cu[i] .. cu[i+1] - 1 of q
    seq_lens_ptr,  # (B,) length of each sequence, its new tokens included
    block_table_ptr,  # (B, max_blocks) physical block of each logical block (column stride 1)
    stride_qn, stride_qh,  # q strides per token, per head
    stride_kb, stride_kh, stride_ks,  # K pool strides per block, per head, per slot
    stride_vb, stride_vh, stride_vs,  # V pool strides, the same way
    stride_on, stride_oh,  # output strides per token, per head
    stride_tiles,  # row stride of the tile table (num_tiles)
    stride_bt,  # block table row stride
    D,  # head dim
    qk_scale,  # 1/sqrt(D) * log2(e)
    N_REP: tl.constexpr,  # query heads per K/V head
    BLOCK_SIZE: tl.constexpr,  # positions per block of the cache
    TILE_Q: tl.constexpr,  # query tokens per program (TILE_M // N_REP)
    TILE_M: tl.constexpr,  # rows per program: TILE_Q tokens x N_REP heads, padded to a power of two >= 16
    TILE_N: tl.constexpr,  # key positions per step
    TILE_D: tl.constexpr,  # head dim padded to a power of two
):
    tile = tl.program_id(0)  # which (sequence, tile of its new tokens)
    # 64-bit: every index that meets a stride (sequence, head, token row, block id) is an int64 first
    kv_h = tl.program_id(1).to(tl.int64)  # which K/V head
    seq = tl.load(tiles_ptr + tile).to(tl.int64)
    q_start = tl.load(tiles_ptr + stride_tiles + tile).to(tl.int32)  # first token of this tile, within the sequence
    row0 = tl.load(cu_seqlens_ptr + seq)  # the sequence's first row of q
    n_new = (tl.load(cu_seqlens_ptr + seq + 1) - row0).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    past = seq_len - n_new + q_start  # the absolute position of this tile's first query token

    r = tl.arange(0, TILE_M)
    tok = r // N_REP  # (TILE_M,) the row's query token in the tile (>= TILE_Q: a padding row)
    heads = kv_h * N_REP + r % N_REP  # (TILE_M,) int64: the row's query head
    row_ok = (tok < TILE_Q) & (q_start + tok < n_new)
    dims = tl.arange(0, TILE_D)
    dim_ok = dims < D
    q_rows = (row0 + q_start + tok).to(tl.int64)  # (TILE_M,) the row's token in q
    q = tl.load(q_ptr + q_rows[:, None] * stride_qn + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # (TILE_M, TILE_D)

    k_head = k_ptr + kv_h * stride_kh  # this K/V head's first element in the pool
    v_head = v_ptr + kv_h * stride_vh
    table_row = block_table_ptr + seq * stride_bt
    cols = tl.arange(0, TILE_N)
    m_i = tl.full((TILE_M,), -1.0e30, dtype=tl.float32)  # as in attention._flash_attention_kernel
    l_i = tl.zeros((TILE_M,), dtype=tl.float32)
    acc = tl.zeros((TILE_M, TILE_D), dtype=tl.float32)
    # Keys [0, lo): whole tiles at or before the first token's position: every row sees every key, no mask.
    # Keys [lo, hi): the tiles on the diagonal, up to the tile's last token (its own position included).
    lo = (past + 1) // TILE_N * TILE_N
    hi = tl.minimum(seq_len, past + TILE_Q)
    for start_n in range(0, lo, TILE_N):
        k_off, v_off = _kv_offsets(start_n, cols, cols < TILE_N, dims, table_row, stride_kb, stride_ks,
                                   stride_vb, stride_vs, True, BLOCK_SIZE, TILE_N)
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, q, k_head + k_off, v_head + v_off, start_n, tok, dim_ok,
                                             seq_len, past, qk_scale, MASK=False, CAUSAL=True, TILE_N=TILE_N)
    for start_n in range(lo, hi, TILE_N):
        k_off, v_off = _kv_offsets(start_n, cols, start_n + cols < seq_len, dims, table_row, stride_kb, stride_ks,
                                   stride_vb, stride_vs, True, BLOCK_SIZE, TILE_N)
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, q, k_head + k_off, v_head + v_off, start_n, tok, dim_ok,
                                             seq_len, past, qk_scale, MASK=True, CAUSAL=True, TILE_N=TILE_N)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a guard only: every real row sees key 0
    tl.store(o_ptr + q_rows[:, None] * stride_on + heads[:, None] * stride_oh + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _ragged_config(TILE_D: int, n_rep: int, longest_q: int, tensor_cores: bool, interpreter: bool = False,
                   hopper: bool = False):
    """(TILE_M, TILE_N, num_warps, num_stages) of _ragged_paged_attention_kernel for a padded head dim TILE_D,
    n_rep query heads per K/V head and the longest run of new tokens of one sequence in the batch.

    Two shapes of program, as the batch needs them:

    - decode tiles, when every sequence's new tokens fit in one token's padded group (all decodes, or a few
      speculative tokens): TILE_M = n_rep padded to 16 rows (the tensor cores' 16-row tile, as gqa's grouped decode), and the key tiles of
      gqa's grouped decode (``gqa._grouped_config``). Tensor cores, D = 128: 64 positions, 4 warps, 2 stages:
      143 / 142 registers on sm_80 / sm_90 and 37 SASS instructions per KB of K/V in the main loop (gqa's
      paged decode: 53 at block size 16). FMA units (fp32; a T4): 16 positions at D = 128, 8 warps (4 spill
      8 B in fp32 on sm_75): 64 registers in fp32, 218-225 per KB; 122 registers and 447 per KB in fp16 on a T4.
    - prefill tiles otherwise: on tensor cores 128 rows (128 // n_rep tokens: 32 for 32/8 heads, 42 for
      SmolLM2's 9/3) x 8 warps x 2 stages. sm_90: 64 positions, 186 registers, 0.78 warp instructions per
      1,000 FLOPs at D = 128 (flash attention: 0.71); 125 and 1.25 at D = 64. sm_80: 64 positions at D = 64
      (184 registers, 1.37), 32 at D = 128 (198, 1.23; flash attention: 1.18), where 64 positions spill 80 B
      at block size 128 and 56 B at block size 1. 64-row tiles took 1.5 / 1.15 at best; 4 warps spill. On
      FMA units flash attention's tiles: 64 x 32 x 8 warps at D <= 64 (21.0-21.3 per 1,000 FLOPs); at
      D <= 128 32 x 16, with 8 warps (23.1-23.6), as 4 spill 336 B in fp32 on sm_90. D = 256: 64 x 32 x 8
      warps x 3 stages on tensor cores, 16 x 16 x 4 warps on FMA units.

    Measured with ``python -m kvlib.course.compile_check --module ragged`` (Triton 3.9; 32/8 heads and block size 16
    unless said): nothing spills in any of COMPILE_SPECS. A decode in a batch with a prefill chunk runs in
    a prefill tile: its padded rows are wasted products, but on paper the loop still issues fast enough to
    stream K/V at the datasheet bandwidth (162 / 103 instructions per KB on sm_80 / sm_90).
    """
    group = max(16, triton.next_power_of_2(n_rep))  # one token's query heads, padded for tl.dot
    decode = longest_q * n_rep <= group
    if interpreter:  # NumPy: fewer, larger programs and steps run faster
        return (group if decode else max(group, 64)), 32, 4, 1
    if decode and tensor_cores:
        return group, max(16, 8192 // TILE_D), 4 if group <= 32 else 8, 2
    if decode:
        return group, max(16, 2048 // TILE_D), 8, 2
    if tensor_cores and TILE_D <= 64 or (tensor_cores and TILE_D <= 128 and hopper):
        return max(group, 128), 64, 8, 2
    if tensor_cores:
        return (max(group, 128), 32, 8, 2) if TILE_D <= 128 else (max(group, 64), 32, 8, 3)
    if TILE_D <= 64:
        return max(group, 64), 32, 8, 2
    return (max(group, 32), 16, 8, 2) if TILE_D <= 128 else (max(group, 16), 16, 4, 2)


def ragged_paged_attention(q, k_blocks, v_blocks, block_tables, cu_seqlens_q, seq_lens, *, plan=None):
    """Ragged paged attention with the Triton kernel; same arguments and result as the reference.

    q, k_blocks, v_blocks: fp32, fp16 or bf16 (bf16 needs a GPU of compute capability >= 8.0).

    >>> from kvlib.runtime import DEVICE
    >>> g = torch.Generator().manual_seed(0)
    >>> k, v = (torch.randn(6, 4, 1, 16, generator=g).to(DEVICE) for _ in range(2))  # 6 blocks of 4 positions
    >>> tables = torch.tensor([[3, 0, -1], [5, 1, 2]], dtype=torch.int32, device=DEVICE)  # -1: unused
    >>> cu = torch.tensor([0, 1, 6], device=DEVICE)  # seq 0 decodes 1 token, seq 1 a chunk of 5 tokens
    >>> lens = torch.tensor([7, 9], device=DEVICE)  # after 6 and 4 cached positions
    >>> q = torch.randn(6, 2, 16, generator=g).to(DEVICE)  # (N, H, D): 2 query heads share one K/V head
    >>> out = ragged_paged_attention(q, k, v, tables, cu, lens)
    >>> torch.allclose(out, ragged_paged_attention_ref(q, k, v, tables, cu, lens), atol=1e-5)
    True
    """
    plan = _plan_for(plan, q, k_blocks, v_blocks, block_tables, cu_seqlens_q, seq_lens)
    cu, lens = plan.cu, plan.lens
    check_kernel_dtype("ragged.ragged_paged_attention", "q", q, dot=True)
    if q.stride(2) != 1 or k_blocks.stride(3) != 1 or v_blocks.stride(3) != 1:
        raise ValueError("q, k_blocks and v_blocks must be contiguous along the head dim D (stride 1)")
    if q.shape[2] > 256:
        raise ValueError(f"head dim D={q.shape[2]} is outside the kernel's range 1..256 (the _ref takes any D)")
    if not runtime.require_triton("ragged.ragged_paged_attention", q=q, k_blocks=k_blocks, v_blocks=v_blocks,
                                  block_tables=block_tables, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens):
        return ragged_paged_attention_ref(q, k_blocks, v_blocks, block_tables, cu_seqlens_q, seq_lens, plan=plan)
    N, H, D = q.shape
    block_size, H_KV = k_blocks.shape[1], k_blocks.shape[2]
    n_rep = H // H_KV
    if plan.tiles is None:
        counts = [cu[i + 1] - cu[i] for i in range(len(lens))]
        TILE_D = max(16, triton.next_power_of_2(D))
        cap = runtime.capability(q.device)
        TILE_M, TILE_N, num_warps, num_stages = _ragged_config(TILE_D, n_rep, max(counts),
                                                               dot_on_tensor_cores(q.dtype, q.device), runtime.INTERPRETER,
                                                               hopper=cap is not None and cap >= (9, 0))
        TILE_Q = TILE_M // n_rep
        # the tile table, as vLLM builds it: program t serves tokens tile_q[t] .. + TILE_Q - 1 of sequence tile_seq[t]
        tile_seq = [i for i, n in enumerate(counts) for _ in range(0, n, TILE_Q)]
        tile_q = [j for n in counts for j in range(0, n, TILE_Q)]
        tiles = torch.tensor([tile_seq, tile_q], dtype=torch.int32, device=q.device)  # (2, num_tiles): one small copy
        plan.tiles = (TILE_D, TILE_M, TILE_N, TILE_Q, num_warps, num_stages, tiles)
    TILE_D, TILE_M, TILE_N, TILE_Q, num_warps, num_stages, tiles = plan.tiles
    out = torch.empty(N, H, D, dtype=q.dtype, device=q.device)
    bt, cu_t, lens_t = block_tables.contiguous(), cu_seqlens_q.contiguous(), seq_lens.contiguous()
    _ragged_paged_attention_kernel[(tiles.shape[1], H_KV)](
        q, k_blocks, v_blocks, out, tiles, cu_t, lens_t, bt,
        q.stride(0), q.stride(1), k_blocks.stride(0), k_blocks.stride(2), k_blocks.stride(1),
        v_blocks.stride(0), v_blocks.stride(2), v_blocks.stride(1), out.stride(0), out.stride(1),
        tiles.stride(0), bt.stride(0), D, (1.0 / math.sqrt(D)) * 1.4426950408889634,
        N_REP=n_rep, BLOCK_SIZE=block_size, TILE_Q=TILE_Q, TILE_M=TILE_M, TILE_N=TILE_N, TILE_D=TILE_D,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


# --------------------------------------------------------------------------------------------
# How kvlib.course.compile_check builds the kernel: the wrapper's own launches at realistic shapes
# --------------------------------------------------------------------------------------------


def _ragged_inputs(dtype="fp16", H=32, H_KV=8, D=128, block_size=16, decodes=8, chunk=512, context=1000,
                   chunk_past=300):
    """A step of a serving engine on the CPU: ``decodes`` sequences decoding one token each after ``context``
    cached positions (a little more each), then one prefill chunk of ``chunk`` tokens after ``chunk_past``
    cached ones (none: chunk=0); blocks handed out in reverse order."""
    dt = _DTYPES.get(dtype, dtype)
    counts = [1] * decodes + ([chunk] if chunk else [])
    lens = [context + 7 * i for i in range(decodes)] + ([chunk_past + chunk] if chunk else [])
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks
    tables = torch.arange(num_blocks, dtype=torch.int32).flip(0).view(len(lens), max_blocks).contiguous()
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.zeros(sum(counts), H, D, dtype=dt)
    pools = [torch.zeros(num_blocks, block_size, H_KV, D, dtype=dt) for _ in range(2)]
    return q, pools[0], pools[1], tables, cu, torch.tensor(lens, dtype=torch.int32)


def _loop(a):
    """One step of the unmasked key loop: a K and a V tile (read once for all the rows, every query head of the
    group), and two TILE_M x TILE_N x TILE_D products (Q K^T and P V)."""
    return dict(bytes=2 * a["TILE_N"] * a["TILE_D"] * a["k_ptr"].element_size(), reread=1, loop=0,
                flops=4 * a["TILE_M"] * a["TILE_N"] * a["TILE_D"])


def _decode_loop(a):
    """Decodes only: the K/V bytes are what counts (the padded rows' products are no useful work)."""
    return dict(bytes=2 * a["TILE_N"] * a["TILE_D"] * a["k_ptr"].element_size(), reread=1, loop=0)


RAGGED_LOOPS = {"_ragged_paged_attention_kernel": _loop}

COMPILE_SPECS = [
    *(dict(name=f"ragged {dt} {H}/{H_KV} D={D} bs={bs} {decodes} decodes + {chunk}-token chunk",
           archs=(80, 90) if dt == "bf16" else (75, 80, 90), loops=RAGGED_LOOPS,
           launch=lambda dt=dt, H=H, H_KV=H_KV, D=D, bs=bs, decodes=decodes, chunk=chunk: ragged_paged_attention(
               *_ragged_inputs(dt, H=H, H_KV=H_KV, D=D, block_size=bs, decodes=decodes, chunk=chunk)))
      for dt, H, H_KV, D, bs, decodes, chunk in (
          ("fp16", 32, 8, 128, 16, 8, 512), ("fp16", 32, 8, 128, 128, 8, 512), ("fp16", 9, 3, 64, 16, 16, 100),
          ("bf16", 32, 8, 128, 16, 8, 512), ("fp32", 32, 8, 128, 16, 8, 512), ("fp32", 9, 3, 64, 16, 16, 100),
          ("fp16", 9, 3, 64, 128, 16, 100), ("fp16", 8, 1, 256, 16, 4, 256), ("fp16", 32, 32, 128, 1, 4, 256))),
    *(dict(name=f"ragged {dt} {H}/{H_KV} D={D} bs=16 {decodes} decodes", archs=(75, 80, 90),
           loops={"_ragged_paged_attention_kernel": _decode_loop},
           launch=lambda dt=dt, H=H, H_KV=H_KV, D=D, decodes=decodes: ragged_paged_attention(
               *_ragged_inputs(dt, H=H, H_KV=H_KV, D=D, decodes=decodes, chunk=0)))
      for dt, H, H_KV, D, decodes in (("fp16", 32, 8, 128, 8), ("fp16", 9, 3, 64, 16), ("fp32", 32, 8, 128, 8))),
]
