"""Attention, first in plain PyTorch, then as a Triton flash-attention (prefill) kernel.

What you will learn (notebook 01):
- scaled dot-product attention step by step: scores, scale by 1/sqrt(D), causal mask, softmax,
  weighted sum of values;
- grouped K/V heads: query head h reads K/V head h // (H / H_KV);
- the online softmax: a running maximum and a running sum let one pass over K/V tiles produce
  exactly the softmax of the whole row, without ever holding the (T, S) score matrix;
- the idea in its smallest kernel, ``flash_attention_minimal``: one program per tile of query rows, one
  loop over every key tile, the online softmax in between (as in Triton's fused-attention tutorial);
- the full kernel, ``flash_attention``, in which one program owns TILE_M query rows of one head and streams K/V in
  tiles of TILE_N keys, accumulating in fp32. It never loads the tiles the causal mask hides
  entirely, and masks only the few that straddle the diagonal: one loop over the tiles below it
  with no mask at all, then one loop with the mask;
- why a kernel computes every offset into a tensor in 64 bits.

Shapes: q (B, H, T, D); k, v (B, H_KV, S, D) with H % H_KV == 0; output (B, H, T, D).
Causal masking is aligned to the end: query row i sits at position S - T + i (for the usual
prefill T == S this is the familiar lower triangle).
"""

import math

import torch

from . import runtime
from ._triton import check_kernel_dtype, tl, triton

__all__ = ["attention_ref", "flash_attention_minimal", "flash_attention", "check_attention_inputs"]


def check_attention_inputs(q, k, v, max_head_dim=None):
    """Raise a clear ValueError/TypeError unless q (B, H, T, D), k/v (B, H_KV, S, D) fit together.

    >>> check_attention_inputs(torch.zeros(1, 4, 3, 16), torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16))
    >>> check_attention_inputs(torch.zeros(1, 4, 3, 16), torch.zeros(1, 3, 5, 16), torch.zeros(1, 3, 5, 16))
    Traceback (most recent call last):
    ...
    ValueError: k has H_KV=3 heads, which must divide q's H=4 heads
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            want = "(B, H, T, D)" if name == "q" else "(B, H_KV, S, D)"
            raise ValueError(f"{name} must have 4 dims {want}, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}): every dim must be >= 1")
    B, H, T, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)} (B, H_KV, S, D), got {tuple(v.shape)}")
    if k.shape[0] != B:
        raise ValueError(f"k must have batch B={B} like q, got shape {tuple(k.shape)}")
    if k.shape[3] != D:
        raise ValueError(f"k must have head dim D={D} like q, got shape {tuple(k.shape)} (B, H_KV, S, D)")
    H_KV = k.shape[1]
    if H_KV < 1 or H % H_KV:
        raise ValueError(f"k has H_KV={H_KV} heads, which must divide q's H={H} heads")
    if T > k.shape[2]:
        raise ValueError(f"q has T={T} rows but k only S={k.shape[2]} positions; causal attention needs T <= S")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if max_head_dim is not None and not (1 <= D <= max_head_dim):
        raise ValueError(f"head dim D={D} is outside the kernel's range 1..{max_head_dim}")


def attention_ref(q, k, v, causal=True):
    """softmax(q k^T / sqrt(D) [+ causal mask]) v, one explicit step at a time, in fp32.

    >>> g = torch.Generator().manual_seed(0)
    >>> q = torch.randn(1, 2, 3, 8, generator=g)  # (B, H, T, D)
    >>> k, v = torch.randn(1, 1, 3, 8, generator=g), torch.randn(1, 1, 3, 8, generator=g)  # H_KV = 1
    >>> out = attention_ref(q, k, v)
    >>> out.shape
    torch.Size([1, 2, 3, 8])
    >>> torch.equal(out[:, :, 0], v[:, :, 0].expand(1, 2, 8))  # causal: the first row sees only key 0
    True
    """
    check_attention_inputs(q, k, v)
    B, H, T, D = q.shape
    S, n_rep = k.shape[2], H // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)  # (B, H, S, D): query head h reads K/V head h // n_rep
    v = v.repeat_interleave(n_rep, dim=1)  # (B, H, S, D)
    scores = q.float() @ k.float().transpose(-1, -2)  # (B, H, T, S): how well each query matches each key
    scores = scores / math.sqrt(D)  # keep the scores' spread independent of D (notebook 01 shows why)
    if causal:
        row_pos = torch.arange(T, device=q.device)[:, None] + (S - T)  # (T, 1): position of each query
        col_pos = torch.arange(S, device=q.device)[None, :]  # (1, S)
        scores = scores.masked_fill(col_pos > row_pos, float("-inf"))  # no looking at the future
    probs = torch.softmax(scores, dim=-1)  # (B, H, T, S): each row sums to 1
    return (probs @ v.float()).to(q.dtype)  # (B, H, T, D)


# --------------------------------------------------------------------------------------------
# The smallest flash-attention kernel: the idea and nothing else
# --------------------------------------------------------------------------------------------


@triton.jit
def _flash_attention_minimal_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # contiguous (B, H, S, D) tensors; the causal prefill: T == S
    S,  # sequence length
    qk_scale,  # 1/sqrt(D)
    D: tl.constexpr,  # head dim: a power of two, at least 16
    TILE_M: tl.constexpr,  # query rows per program
    TILE_N: tl.constexpr,  # keys per step of the loop
):
    rows = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)  # (TILE_M,) this program's query rows
    head = tl.program_id(1).to(tl.int64) * S * D  # where this (batch, head) starts; 64-bit: B*H*S*D may pass 2**31
    dims = tl.arange(0, D)  # (D,)
    q = tl.load(q_ptr + head + rows[:, None] * D + dims[None, :], mask=rows[:, None] < S, other=0.0)  # (TILE_M, D)
    m = tl.full((TILE_M,), float("-inf"), tl.float32)  # running max of each row's scores
    l = tl.zeros((TILE_M,), tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros((TILE_M, D), tl.float32)  # running sum of exp(score - m) * v
    for start_n in range(0, S, TILE_N):  # every key tile, even those the causal mask hides entirely
        cols = start_n + tl.arange(0, TILE_N)  # (TILE_N,) key positions of this tile
        kv = head + cols[:, None] * D + dims[None, :]  # (TILE_N, D) offsets of their K and V rows
        k = tl.load(k_ptr + kv, mask=cols[:, None] < S, other=0.0)  # (TILE_N, D)
        v = tl.load(v_ptr + kv, mask=cols[:, None] < S, other=0.0)  # (TILE_N, D)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # (TILE_M, TILE_N) scaled scores
        s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))  # causal mask (also hides keys past S)
        m_new = tl.maximum(m, tl.max(s, axis=1))  # (TILE_M,) key 0 is in the first tile: never -inf
        alpha = tl.exp(m - m_new)  # rescales what was summed under the old maximum
        p = tl.exp(s - m_new[:, None])  # (TILE_M, TILE_N) weights relative to the new maximum
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / l[:, None]  # (TILE_M, D)
    tl.store(o_ptr + head + rows[:, None] * D + dims[None, :], out.to(o_ptr.dtype.element_ty), mask=rows[:, None] < S)


def flash_attention_minimal(q, k, v):
    """Causal attention with the minimal kernel: the same result as ``attention_ref(q, k, v)``.

    The smallest version of the idea, for reading: q, k, v of one shape (B, H, S, D) (no grouped K/V
    heads, every query attends over the same S tokens), D a power of two from 16 to 256, fp32 or fp16
    (bf16 on a GPU). ``flash_attention`` lifts these limits, skips the tiles the mask hides and masks only
    the tiles on the diagonal.

    >>> from kvlib.runtime import DEVICE
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(1, 2, 21, 16, generator=g).to(DEVICE) for _ in range(3))
    >>> torch.allclose(flash_attention_minimal(q, k, v), attention_ref(q, k, v), atol=1e-5)
    True
    """
    check_attention_inputs(q, k, v)
    if k.shape != q.shape:
        raise ValueError(f"flash_attention_minimal takes q, k, v of one shape (B, H, S, D); got q {tuple(q.shape)} "
                         f"and k {tuple(k.shape)}: use flash_attention for grouped K/V heads or T < S")
    B, H, S, D = q.shape
    if D not in (16, 32, 64, 128, 256):
        raise ValueError(f"flash_attention_minimal needs a head dim D that is a power of two from 16 to 256, got {D}: "
                         "use flash_attention, which pads D")
    check_kernel_dtype("attention.flash_attention_minimal", "q", q, dot=True)
    if not runtime.require_triton("attention.flash_attention_minimal", q=q, k=k, v=v):
        return attention_ref(q, k, v)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    TILE_M, TILE_N, num_warps = _minimal_tiles(D, runtime.INTERPRETER, dot_on_tensor_cores(q.dtype, q.device))
    grid = (triton.cdiv(S, TILE_M), B * H)  # one program per (tile of query rows, batch x head)
    _flash_attention_minimal_kernel[grid](q, k, v, out, S, 1.0 / math.sqrt(D), D=D, TILE_M=TILE_M, TILE_N=TILE_N,
                                          num_warps=num_warps)
    return out


def _minimal_tiles(D: int, interpreter: bool, tensor_cores: bool):
    """(TILE_M, TILE_N, num_warps) for the minimal kernel: large tiles in the interpreter (fewer programs run
    faster there); on a GPU, tiles that build without spilling (``tests/test_compile.py``)."""
    if interpreter:
        return 32, 32, 4
    if tensor_cores:
        return (64, 64, 4) if D <= 64 else (64, 32, 4)  # 64 x 64 at D = 128 takes all 255 registers on sm_80
    return (32, 16, 4) if D <= 128 else (16, 16, 4)


# --------------------------------------------------------------------------------------------
# The full kernel: skips the hidden tiles, masks only the diagonal, 64-bit offsets, grouped K/V heads
# --------------------------------------------------------------------------------------------


@triton.jit
def _online_softmax_step(
    acc, l_i, m_i,  # this program's running sums and maximum (see the kernel)
    q,  # (TILE_M, TILE_D) the program's query tile
    k_ptrs, v_ptrs,  # (TILE_N, TILE_D) pointers to this key tile's K and V
    start_n,  # position of the tile's first key
    rows,  # (TILE_M,) the program's query rows
    dim_ok,  # (TILE_D,) False for the padding columns beyond D
    S, past, qk_scale,  # key positions, keys before the first query row (S - T), 1/sqrt(D) * log2(e)
    MASK: tl.constexpr,  # False: every key of this tile exists and every row may see it
    CAUSAL: tl.constexpr,
    TILE_N: tl.constexpr,
):
    """One step of the online softmax: fold keys start_n .. start_n + TILE_N - 1 into (acc, l_i, m_i).

    MASK is a compile-time flag, so the kernel gets two copies of this body: one with no masking at all
    for the tiles below the causal diagonal (nearly all of them), one with the masks for the few tiles on
    the diagonal or at the end of S."""
    if MASK:
        cols = start_n + tl.arange(0, TILE_N)  # (TILE_N,) key positions of this tile
        col_ok = cols < S  # False past the last key (only in the last tile of S)
        kv_ok = col_ok[:, None] & dim_ok[None, :]
    else:  # a full tile: only the padding columns beyond D are masked (none when D is a power of two)
        kv_ok = dim_ok[None, :]
    k = tl.load(k_ptrs, mask=kv_ok, other=0.0)  # (TILE_N, TILE_D)
    s = tl.dot(q, tl.trans(k))  # (TILE_M, TILE_N) raw scores q . k, fp32
    if MASK:
        keep = col_ok[None, :]
        if CAUSAL:  # row r sits at position past + r and may see keys 0 .. past + r
            keep = keep & (cols[None, :] <= rows[:, None] + past)
        s = tl.where(keep, s, float("-inf"))  # exp2(-inf) = 0: a left-out key gets no weight
    # qk_scale > 0 does not change which score is the largest, so only the row maxima are scaled here;
    # each score's scale goes into the exp2 below (one fused multiply-add per score, not two operations).
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # (TILE_M,) new running max, log2 units
    alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old maximum
    p = tl.exp2(s * qk_scale - m_new[:, None])  # (TILE_M, TILE_N) weights relative to the new maximum
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptrs, mask=kv_ok, other=0.0)  # (TILE_N, TILE_D)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # rescaled acc + P V, added inside the dot
    return acc, l_i, m_new


@triton.jit
def _flash_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # tensors as described in the module docstring
    stride_qb, stride_qh, stride_qt, stride_qd,  # q strides (elements) for B, H, T, D
    stride_kb, stride_kh, stride_ks, stride_kd,  # k strides for B, H_KV, S, D
    stride_vb, stride_vh, stride_vs, stride_vd,  # v strides for B, H_KV, S, D
    stride_ob, stride_oh, stride_ot, stride_od,  # output strides for B, H, T, D
    H, T, S, D,  # query heads, query rows, key positions, head dim
    n_rep,  # query heads per K/V head (H // H_KV)
    qk_scale,  # 1/sqrt(D) * log2(e): we use exp2, which is what the hardware computes natively
    CAUSAL: tl.constexpr,  # apply the causal mask (and skip the tiles it hides)
    TILE_M: tl.constexpr,  # query rows per program
    TILE_N: tl.constexpr,  # keys per step of the inner loops
    TILE_D: tl.constexpr,  # head dim padded to a power of two (masked beyond D)
):
    pid_m = tl.program_id(0)  # which tile of query rows
    pid_bh = tl.program_id(1)  # which (batch, query head)
    b = pid_bh // H  # batch
    h = pid_bh % H  # query head
    kv_h = h // n_rep  # GQA: the K/V head this query head reads
    start_m = pid_m * TILE_M  # first query row of this program

    # 64-bit offsets. An index times a stride is an offset (in elements) from the start of the tensor.
    # Triton computes it in its operands' type, and the JIT passes every int argument below 2**31 as a
    # 32-bit int: the product wraps around, and the kernel reads or writes the wrong memory, once a
    # tensor holds 2**31 elements (16 prompts of 32K tokens x 32 heads x 128 dims is exactly 2**31).
    # So every index is made 64-bit before it meets a stride.
    b = b.to(tl.int64)
    h = h.to(tl.int64)
    kv_h = kv_h.to(tl.int64)

    rows = start_m + tl.arange(0, TILE_M)  # (TILE_M,) query rows of this program (for the masks)
    dims = tl.arange(0, TILE_D)  # (TILE_D,)
    row_ok = rows < T
    dim_ok = dims < D
    # A tile's address = one 64-bit scalar for where the tile starts (computed once per program) + the
    # offsets inside the tile, also 64-bit.
    tile_rows = tl.arange(0, TILE_M).to(tl.int64)  # (TILE_M,) 0 .. TILE_M - 1
    dims64 = dims.to(tl.int64)
    q_tile = q_ptr + b * stride_qb + h * stride_qh + start_m.to(tl.int64) * stride_qt  # q[b, h, start_m, 0]
    q = tl.load(q_tile + tile_rows[:, None] * stride_qt + dims64[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # (TILE_M, TILE_D)

    m_i = tl.full((TILE_M,), -1.0e30, dtype=tl.float32)  # running max of each row's scores (log2 units)
    l_i = tl.zeros((TILE_M,), dtype=tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros((TILE_M, TILE_D), dtype=tl.float32)  # running sum of exp2(score - m_i) * v

    # Pointers to the first key tile (keys 0 .. TILE_N - 1) of K/V head kv_h, built once. After each step
    # the loops move them on by TILE_N keys, a 64-bit step: the loops add, they never multiply.
    tile_keys = tl.arange(0, TILE_N).to(tl.int64)  # (TILE_N,) 0 .. TILE_N - 1
    k_ptrs = k_ptr + b * stride_kb + kv_h * stride_kh + tile_keys[:, None] * stride_ks + dims64[None, :] * stride_kd
    v_ptrs = v_ptr + b * stride_vb + kv_h * stride_vh + tile_keys[:, None] * stride_vs + dims64[None, :] * stride_vd
    # tl.cast, not stride_ks.to(): the JIT passes an int equal to 1 as a plain constant, which has no .to()
    k_step = tl.cast(stride_ks, tl.int64) * TILE_N
    v_step = tl.cast(stride_vs, tl.int64) * TILE_N

    # Which key tiles need a mask? Query row r sits at position past + r (past = S - T keys cached before
    # the first query, 0 for a plain prefill) and, with the causal mask, sees keys 0 .. past + r.
    past = S - T
    if CAUSAL:
        # Keys [0, lo): whole tiles that end at or before the first row's position, so every row of this
        # program sees every key in them (and they lie inside S): no mask. Keys from `hi` on come after the
        # last row's position, hidden from every row: never loaded. Between the two lie the few tiles
        # that straddle the diagonal (at most TILE_M / TILE_N + 1 of them, rounded up).
        lo = (start_m + past + 1) // TILE_N * TILE_N
        hi = tl.minimum(S, start_m + TILE_M + past)
    else:  # every row sees every key: only a partial last tile of S needs a mask
        lo = S // TILE_N * TILE_N
        hi = S
    for start_n in range(0, lo, TILE_N):  # the steady state: no mask at all
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, rows, dim_ok,
                                             S, past, qk_scale, MASK=False, CAUSAL=CAUSAL, TILE_N=TILE_N)
        k_ptrs += k_step
        v_ptrs += v_step
    for start_n in range(lo, hi, TILE_N):  # the diagonal and the end of S: masked
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, rows, dim_ok,
                                             S, past, qk_scale, MASK=True, CAUSAL=CAUSAL, TILE_N=TILE_N)
        k_ptrs += k_step
        v_ptrs += v_step

    # A guard only: each row sees at least one key, and its largest score adds exp2(0) = 1 to l_i.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_tile = o_ptr + b * stride_ob + h * stride_oh + start_m.to(tl.int64) * stride_ot  # out[b, h, start_m, 0]
    tl.store(o_tile + tile_rows[:, None] * stride_ot + dims64[None, :] * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def dot_on_tensor_cores(dtype: torch.dtype, device) -> bool:
    """Whether ``tl.dot`` on ``dtype`` runs on tensor cores there: fp16/bf16 on a GPU of compute capability
    8.0 or newer. fp32 runs in IEEE precision (runtime sets TRITON_F32_DEFAULT=ieee) and every dtype on a
    T4 (sm_75) runs on plain FMA units, which keep the whole tile in registers: they need smaller tiles."""
    if dtype == torch.float32:
        return False
    cap = runtime.capability(device)
    return cap is None or cap >= (8, 0)


def _triton_at_least(major: int, minor: int) -> bool:
    version = getattr(triton, "__version__", "0.0")  # the stand-in (no Triton) has none
    try:
        return tuple(int(x) for x in version.split(".")[:2]) >= (major, minor)
    except ValueError:
        return False


_TRITON_39 = _triton_at_least(3, 9)


def _tiles(D: int, interpreter: bool, tensor_cores: bool = True, hopper: bool = False):
    """Default launch configuration for a padded head dim D: (TILE_M, TILE_N, num_warps, num_stages).

    Chosen with ``python -m kvlib.course.compile_check --module attention``, which builds the kernel as the JIT
    builds it at launch for sm_75 (T4), sm_80 (A100) and sm_90 (H100/H200) and reads its registers,
    spills, shared memory and the SASS of its steady-state loop (the unmasked one). Among the
    configurations that neither spill nor need more shared memory than a block may have, each default is
    the one whose loop issues the fewest warp instructions per FLOP: the loop's SASS instructions x
    num_warps / (4 TILE_M TILE_N TILE_D), given below per 1,000 FLOPs (Triton 3.9; "B" = bytes/thread).

    Tensor cores (fp16, bf16 on sm_80/sm_90; bf16 builds exactly like fp16):

    - D <= 64: 128 x 128, 8 warps, 3 stages. sm_80: 197 registers, 80 KiB shared, 662 instructions = 1.26;
      sm_90: 203 registers, 112 KiB, 474 = 0.90. (128 x 64: 1.36 and 1.14; 2 stages spill 16 B on sm_80;
      the old 64 x 64 tiles, on the old kernel: 3.95 and 3.40.)
    - D <= 128: 128 x 64, 8 warps, 3 stages. sm_80: 212 registers, 96 KiB, 558 = 1.06; sm_90: 182
      registers, 128 KiB, 370 = 0.71. (128 x 128 spills 88 B on sm_80, and 2 stages spill 32 B there. On
      sm_90 alone 128 x 128 builds without spilling at 255 registers, the most a thread may have, and 224
      of the 227 KiB of shared memory: 0.57; not taken, as the next compiler version may well spill, and
      both configurations' issue ceilings, 1,850 and 1,480 TFLOP/s, lie above the H200's dense fp16 peak,
      989. The old 128 x 32 tiles on the old kernel: 1.52 and 1.37.)
    - D = 256: 64 x 32, 8 warps, 3 stages (64 x 64 spills on sm_80).

    FMA units (fp32 everywhere, every dtype on a T4): a warp's FFMA does 64 FLOPs, so 15.6 is the floor.

    - D <= 64: 64 x 32, 8 warps, 2 stages: 20.8 (sm_80 fp32: 108 registers, 40 KiB), 21.1 (sm_90 fp32:
      92), 20.9 (T4 fp32: 126, 32 KiB), 21.1 (T4 fp16: 211, 24 KiB). The old 16 x 16 tiles: 27.6 to 28.1.
      (64 x 16 x 4 warps spills on sm_90 in fp32; 3 stages take more shared memory for no fewer instructions.)
    - D <= 128: 32 x 16, 4 warps, 2 stages: 20.7 (sm_80 fp32: 144 registers), 20.9 (sm_90 fp32: 200),
      21.0 (T4 fp32: 128), 21.0 (T4 fp16: 233, 24 KiB). 16 x 16: 24.0 to 24.7. (32 x 32 x 8 warps and
      64 x 16 x 8 warps spill on sm_90 in fp32.)
    - D = 256: 16 x 16, 4 warps, 2 stages (32 x 16 spills on a T4 in fp16).

    The JIT builds another kernel when T and S are not multiples of 16 (most prompts): with T = S = 1001,
    128 x 64 at D <= 128 takes 255 registers and spills 40 B on sm_80 (Triton 3.9), so below sm_90 the
    default there is 128 x 32 x 8 warps x 2 stages: 200 registers, no spill, 1.18 per 1,000 FLOPs, with T
    either way (sm_90 keeps 128 x 64: 184 registers, no spill, 0.71). The compile check builds both.

    Triton before 3.9 allocates registers for this kernel far worse (built the same way with Triton 3.6):
    128 x 128 at D <= 64 spills 216 B/thread on sm_90 and 128 x 64 at D <= 128 spills 184 B, so with an
    older Triton the tensor-core defaults are 128 x 64 x 8 warps x 2 stages at D <= 64 (3.6: 240 / 191
    registers on sm_80 / sm_90, no spill, 1.55 / 1.34 per 1,000 FLOPs) and 128 x 32 x 8 warps x 2 stages
    at D <= 128 (3.6: 255 / 213 registers, no spill, 1.41 / 1.23).

    On FMA units Triton 3.6 spills 360-500 B/thread on a T4 with the tiles above (and 416 B with the old
    16 x 16 x 4 warps at D = 128), so before 3.9 they are 32 x 32 x 8 warps x 1 stage at D <= 64 (T4, 3.6:
    223 registers, no spill, 24.3 per 1,000 FLOPs) and 16 x 16 x 8 warps x 2 stages above (206, 28.6).

    ``tests/test_compile.py`` rebuilds the defaults with whichever Triton is installed and fails on a spill.
    """
    if interpreter:  # fewer, larger programs run faster in the interpreter (which ignores warps and stages)
        return 32, 32, 4, 1
    if not tensor_cores:
        if not _TRITON_39:  # Triton 3.6 spills 360-500 B/thread on a T4 with the tiles below; these do not
            return (32, 32, 8, 1) if D <= 64 else (16, 16, 8, 2)
        if D <= 64:
            return 64, 32, 8, 2
        if D <= 128:
            return 32, 16, 4, 2
        return 16, 16, 4, 2
    if not _TRITON_39:
        return (128, 64, 8, 2) if D <= 64 else (128, 32, 8, 2) if D <= 128 else (64, 32, 8, 3)
    if D <= 64:
        return 128, 128, 8, 3
    if D <= 128 and not hopper:  # 128 x 64 spills 40 B on sm_80 when T and S are not multiples of 16
        return 128, 32, 8, 2
    if D <= 128:
        return 128, 64, 8, 3
    return 64, 32, 8, 3


def flash_attention(q, k, v, causal=True):
    """Attention with the Triton kernel; same arguments and result as ``attention_ref``.

    Takes fp32, fp16 or bf16 (bf16 needs a GPU of compute capability >= 8.0; not in CPU mode).

    >>> from kvlib.runtime import DEVICE
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(1, 2, 5, 16, generator=g).to(DEVICE) for _ in range(3))
    >>> torch.allclose(flash_attention(q, k, v), attention_ref(q, k, v), atol=1e-5)
    True
    """
    check_attention_inputs(q, k, v, max_head_dim=256)
    check_kernel_dtype("attention.flash_attention", "q", q, dot=True)
    if not runtime.require_triton("attention.flash_attention", q=q, k=k, v=v):
        return attention_ref(q, k, v, causal)
    B, H, T, D = q.shape
    S = k.shape[2]
    out = torch.empty_like(q)
    TILE_D = max(16, triton.next_power_of_2(D))
    cap = runtime.capability(q.device)
    TILE_M, TILE_N, num_warps, num_stages = _tiles(TILE_D, runtime.INTERPRETER, dot_on_tensor_cores(q.dtype, q.device),
                                                   hopper=cap is not None and cap >= (9, 0))
    grid = (triton.cdiv(T, TILE_M), B * H)
    _flash_attention_kernel[grid](
        q, k, v, out, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        H, T, S, D, H // k.shape[1], (1.0 / math.sqrt(D)) * 1.4426950408889634,
        CAUSAL=causal, TILE_M=TILE_M, TILE_N=TILE_N, TILE_D=TILE_D, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def _compile_launch(dtype: torch.dtype, D: int, causal: bool = True, T: int = 256):
    """A zero-argument launch for ``kvlib.course.compile_check``: flash_attention on CPU tensors shaped like a model's
    (B=2, H=32 query heads sharing H_KV=8 K/V heads, T=S=256 or 1001; views of (B, T, H, D) buffers, as
    ``kvlib.model`` makes them: strides of H*D, D and 1). compile_check records the launch instead of
    running it, so the values never matter, only which sizes the JIT sees as multiples of 16: at T = 256
    all of them, at T = 1001 (a typical prompt) not T and S, which builds another kernel."""
    def launch():
        B, H, H_KV = 2, 32, 8
        q = torch.empty(B, T, H, D, dtype=dtype).transpose(1, 2)  # (B, H, T, D)
        k = torch.empty(B, T, H_KV, D, dtype=dtype).transpose(1, 2)  # (B, H_KV, S, D)
        v = torch.empty(B, T, H_KV, D, dtype=dtype).transpose(1, 2)
        return flash_attention(q, k, v, causal=causal)
    return launch


def _compile_launch_minimal(dtype: torch.dtype, D: int, S: int):
    """A zero-argument launch of flash_attention_minimal for ``kvlib.course.compile_check``: B=2, H=32, S tokens
    (S = 1001 is not a multiple of 16, which builds another kernel than S = 256)."""
    def launch():
        q, k, v = (torch.empty(2, 32, S, D, dtype=dtype) for _ in range(3))
        return flash_attention_minimal(q, k, v)
    return launch


def _minimal_loop_work(a: dict) -> dict:
    """One iteration of the minimal kernel's loop: Q K^T and P V (TILE_M x TILE_N x D multiply-adds each), one
    TILE_N x D tile of K and one of V loaded."""
    return dict(flops=4 * a["TILE_M"] * a["TILE_N"] * a["D"], bytes=2 * a["TILE_N"] * a["D"] * a["k_ptr"].element_size(),
                loop=0)


def _loop_work(a: dict) -> dict:
    """What one program does per iteration of its first (unmasked) key loop: Q K^T and P V are each
    TILE_M x TILE_N x TILE_D multiply-adds (2 FLOPs each), and it loads one TILE_N x TILE_D tile of K and
    one of V."""
    return dict(flops=4 * a["TILE_M"] * a["TILE_N"] * a["TILE_D"],
                bytes=2 * a["TILE_N"] * a["TILE_D"] * a["k_ptr"].element_size(), loop=0)


# What kvlib.course.compile_check (and tests/test_compile.py) builds: the launches the wrapper makes for the head
# dims and dtypes of real models, with the tiles it picks on sm_80/sm_90 (tensor cores) and on a T4
# (sm_75: FMA units, no bf16). `loops` says how much work one iteration of the steady-state loop does.
COMPILE_SPECS = [
    dict(name=f"prefill {name} D={D} {'causal' if causal else 'full'}{'' if T == 256 else f' T={T}'}",
         launch=_compile_launch(dtype, D, causal, T), archs=archs, loops={"_flash_attention_kernel": _loop_work})
    for name, dtype, D, causal, archs, T in [
        ("fp16", torch.float16, 64, True, (80, 90), 256),
        ("fp16", torch.float16, 64, True, (80, 90), 1001),
        ("fp16", torch.float16, 128, True, (80, 90), 256),
        ("fp16", torch.float16, 128, True, (80, 90), 1001),
        ("fp16", torch.float16, 128, False, (80, 90), 256),
        ("bf16", torch.bfloat16, 128, True, (80, 90), 1001),
        ("fp32", torch.float32, 64, True, (80, 90), 1001),
        ("fp16", torch.float16, 64, True, (75,), 256),
        ("fp16", torch.float16, 128, True, (75,), 1001),
        ("fp32", torch.float32, 64, True, (75,), 1001),
    ]
] + [
    dict(name=f"minimal prefill {name} D={D} S={S}", launch=_compile_launch_minimal(dtype, D, S), archs=archs,
         loops={"_flash_attention_minimal_kernel": _minimal_loop_work})
    for name, dtype, D, S, archs in [
        ("fp16", torch.float16, 64, 256, (75, 80, 90)),
        ("fp16", torch.float16, 128, 1001, (75, 80, 90)),
        ("fp32", torch.float32, 64, 1001, (75, 80, 90)),
    ]
]
