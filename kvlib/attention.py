"""Attention, first in plain PyTorch, then as a Triton flash-attention (prefill) kernel.

What you will learn (notebook 01):
- scaled dot-product attention step by step: scores, scale by 1/sqrt(D), causal mask, softmax,
  weighted sum of values;
- grouped K/V heads: query head h reads K/V head h // (H / H_KV);
- the online softmax: a running maximum and a running sum let one pass over K/V tiles produce
  exactly the softmax of the whole row, without ever holding the (T, S) score matrix;
- a Triton kernel in which one program owns TILE_M query rows of one head and streams K/V in
  tiles of TILE_N keys, accumulating in fp32, skipping tiles the causal mask hides entirely.

Shapes: q (B, H, T, D); k, v (B, H_KV, S, D) with H % H_KV == 0; output (B, H, T, D).
Causal masking is aligned to the end: query row i sits at position S - T + i (for the usual
prefill T == S this is the familiar lower triangle).
"""

import math

import torch

from . import runtime
from ._triton import check_kernel_dtype, tl, triton

__all__ = ["attention_ref", "flash_attention", "check_attention_inputs"]


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
    TILE_N: tl.constexpr,  # keys per step of the inner loop
    TILE_D: tl.constexpr,  # head dim padded to a power of two (masked beyond D)
):
    pid_m = tl.program_id(0)  # which tile of query rows
    pid_bh = tl.program_id(1)  # which (batch, query head)
    b = pid_bh // H
    h = pid_bh % H
    kv_h = h // n_rep  # GQA: the K/V head this query head reads

    rows = pid_m * TILE_M + tl.arange(0, TILE_M)  # (TILE_M,) query rows of this program
    dims = tl.arange(0, TILE_D)  # (TILE_D,)
    row_ok = rows < T
    dim_ok = dims < D
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # (TILE_M, TILE_D)

    m_i = tl.full((TILE_M,), -1.0e30, dtype=tl.float32)  # running max of each row's scores (log2 units)
    l_i = tl.zeros((TILE_M,), dtype=tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros((TILE_M, TILE_D), dtype=tl.float32)  # running sum of exp2(score - m_i) * v

    k_base = k_ptr + b * stride_kb + kv_h * stride_kh
    v_base = v_ptr + b * stride_vb + kv_h * stride_vh
    hi = S
    if CAUSAL:  # keys after the last row's position are hidden from every row of this tile
        hi = tl.minimum(S, (pid_m + 1) * TILE_M + S - T)
    for start_n in range(0, hi, TILE_N):
        cols = start_n + tl.arange(0, TILE_N)  # (TILE_N,) key positions of this step
        col_ok = cols < S
        k = tl.load(k_base + cols[:, None] * stride_ks + dims[None, :] * stride_kd,
                    mask=col_ok[:, None] & dim_ok[None, :], other=0.0)  # (TILE_N, TILE_D)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # (TILE_M, TILE_N) scores, fp32, log2 units
        keep = col_ok[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None] + (S - T))
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (TILE_M,)
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old maximum
        p = tl.exp2(s - m_new[:, None])  # (TILE_M, TILE_N)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + cols[:, None] * stride_vs + dims[None, :] * stride_vd,
                    mask=col_ok[:, None] & dim_ok[None, :], other=0.0)  # (TILE_N, TILE_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_ot + dims[None, :] * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def dot_on_tensor_cores(dtype: torch.dtype, device) -> bool:
    """Whether ``tl.dot`` on ``dtype`` runs on tensor cores there: fp16/bf16 on a GPU of compute capability
    8.0 or newer. fp32 runs in IEEE precision (runtime sets TRITON_F32_DEFAULT=ieee) and every dtype on a
    T4 (sm_75) runs on plain FMA units, which keep the whole tile in registers: they need smaller tiles."""
    device = torch.device(device)
    if dtype == torch.float32 or device.type != "cuda":
        return dtype != torch.float32
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _tiles(D: int, interpreter: bool, tensor_cores: bool = True):
    """Default tile sizes: (TILE_M, TILE_N, num_warps) for a padded head dim D.

    Chosen so that no configuration spills registers or asks for more shared memory than a block may
    have (64 KiB on a T4): ``python -m kvlib.compile_check`` checks each for sm_75, sm_80 and sm_90.
    """
    if interpreter:  # fewer, larger programs run faster in the interpreter
        return 32, 32, 4
    if not tensor_cores:  # FMA units (fp32, or a T4): larger tiles spill on Triton 3.6 (32 x 32: 312 B/thread)
        return 16, 16, 4
    if D <= 64:
        return 64, 64, 8  # 4 warps spill on sm_80 with Triton 3.2 and 3.6 (24-64 B/thread)
    if D <= 128:
        return 128, 32, 8  # TILE_N=64 spills 8 B/thread on sm_80
    return 64, 32, 8


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
    TILE_M, TILE_N, num_warps = _tiles(TILE_D, runtime.INTERPRETER, dot_on_tensor_cores(q.dtype, q.device))
    grid = (triton.cdiv(T, TILE_M), B * H)
    _flash_attention_kernel[grid](
        q, k, v, out, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        H, T, S, D, H // k.shape[1], (1.0 / math.sqrt(D)) * 1.4426950408889634,
        CAUSAL=causal, TILE_M=TILE_M, TILE_N=TILE_N, TILE_D=TILE_D, num_warps=num_warps,
    )
    return out


def _compile_spec(dtype: str, D: int, archs=(80, 90)):
    tensor_cores = dtype != "fp32" and min(archs) >= 80
    TILE_M, TILE_N, num_warps = _tiles(D, interpreter=False, tensor_cores=tensor_cores)
    sig = {n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
    for t in "qkvo":
        sig.update({f"stride_{t}{a}": "i32" for a in ("b", "h", "t" if t in "qo" else "s", "d")})
    sig.update(H="i32", T="i32", S="i32", D="i32", n_rep="i32", qk_scale="fp32",
               CAUSAL="constexpr", TILE_M="constexpr", TILE_N="constexpr", TILE_D="constexpr")
    return dict(kernel=_flash_attention_kernel, signature=sig, num_warps=num_warps, archs=archs,
                constexprs=dict(CAUSAL=True, TILE_M=TILE_M, TILE_N=TILE_N, TILE_D=D))


# How tests/test_compile.py builds this kernel: the wrapper's default tiles per head dim for sm_80/sm_90,
# and the FMA tiles it picks on a T4 (sm_75; no bf16 there).
COMPILE_SPECS = [_compile_spec("fp16", 64), _compile_spec("fp16", 128), _compile_spec("fp32", 64),
                 _compile_spec("bf16", 128),
                 _compile_spec("fp16", 64, archs=(75,)), _compile_spec("fp16", 128, archs=(75,)),
                 _compile_spec("fp32", 64, archs=(75,))]
