"""INT8 KV cache (chapter 06): store K/V as int8 with scales, dequantize inside the kernel.

What you will learn:
- symmetric absmax quantization: ``scale = max|x| / 127`` over a group of numbers, ``q =
  round(x / scale)`` in [-127, 127], ``x ≈ q * scale`` with an error of at most half a step;
- granularity is the choice of group (the dims the max runs over): one scale for the whole tensor,
  per token, per head, per channel... ``quantize_int8(x, dim)`` reduces over ``dim`` (an int, a
  tuple, or None for the whole tensor), so every granularity is one call;
- a cache that quantizes on store (one scale per cached row: per token and head) halves the bytes of
  an fp16 cache (plus one fp16 scale, 2 bytes, per D numbers);
- the decode kernel reads int8 and never builds a dequantized copy: K's per-row scale multiplies the
  row's score, V's multiplies the row's probability (chapter 07's grouped kernel,
  ``gqa._grouped_decode_kernel`` with ``INT8=True``; the int8 values become the query's dtype, exactly,
  for its ``tl.dot``);
- quantize-on-store: ``store_kv_int8`` quantizes a tile of new rows per program, each row with its
  own scale.

Shapes: cache values (B, H_KV, S_max, D) int8; scales (B, H_KV, S_max) fp16 (or fp32).
"""

from __future__ import annotations

import math

import torch

from . import runtime
from ._triton import check_kernel_dtype, tl, triton
from .attention import attention_ref
from .cache import KVCache, _check_cache_args, _check_store_args, _compile_inputs, decode_attention_ref
from .gqa import DECODE_LOOPS, grouped_decode_launch

__all__ = ["quantize_int8", "dequantize_int8", "int8_decode_attention", "int8_decode_attention_ref",
           "store_kv_int8", "store_kv_int8_ref", "Int8KVCache", "quality_report"]

QMAX = 127


def _dims(x: torch.Tensor, dim) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(x.dim()))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    for d in dims:
        if not -x.dim() <= d < x.dim():
            raise ValueError(f"dim {d} is out of range for a tensor of {x.dim()} dims")
    return tuple(d % x.dim() for d in dims)


def quantize_int8(x: torch.Tensor, dim=-1):
    """Symmetric absmax int8 quantization with one scale per group; the max runs over ``dim``.

    dim=-1: one scale per row (for K/V of shape (..., D): per token and head); dim=None: one scale for
    the whole tensor; dim=(0, 2): ... Rounds half away from zero (as the store kernel does). Returns (int8 values, fp32 scales) where scales keep x's rank
    (size 1 along ``dim``), so ``values * scales`` broadcasts back. An all-zero group gets scale 1
    and exact zeros. With K/V (B, H_KV, S, D) and dim=-1, the scales (B, H_KV, S, 1) go straight
    into ``int8_decode_attention``.

    >>> q, scale = quantize_int8(torch.tensor([[0.5, -1.27], [0.0, 0.0]]), dim=-1)  # one scale per row
    >>> q, scale
    (tensor([[  50, -127],
            [   0,    0]], dtype=torch.int8), tensor([[0.0100],
            [1.0000]]))
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if not torch.isfinite(x).all():
        raise ValueError("x contains NaN or inf; absmax quantization needs finite values")
    x32 = x.float()
    amax = x32.abs().amax(dim=_dims(x, dim), keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    y = x32 / scale
    q = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-QMAX, QMAX).to(torch.int8)  # half away from zero
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """q * scale in ``dtype``; scale must have q's rank with each dim equal to q's or 1.

    >>> x = torch.tensor([[0.5, -1.27], [3.0, 1.0]])
    >>> dequantize_int8(*quantize_int8(x, dim=-1))  # back within half a step of each row's scale
    tensor([[ 0.5000, -1.2700],
            [ 3.0000,  0.9921]])
    """
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8:
        raise TypeError(f"q must be an int8 tensor, got {getattr(q, 'dtype', type(q).__name__)}")
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale must be a torch.Tensor, got {type(scale).__name__}")
    if scale.dim() != q.dim() or any(s not in (1, n) for s, n in zip(scale.shape, q.shape)):
        raise ValueError(f"scale of shape {tuple(scale.shape)} does not match values of shape {tuple(q.shape)}: "
                         "it needs the same rank, each dim equal or 1 (the granularity's group)")
    return (q.float() * scale.float()).to(dtype)


# --------------------------------------------------------------------------------------------
# int8 decode attention: reference and wrapper (the kernel is gqa._grouped_decode_kernel, INT8=True)
# --------------------------------------------------------------------------------------------


def _check_scales(k_q, scales: dict) -> list:
    """The scales as (B, H_KV, S_max): one per cached row; (B, H_KV, S_max, 1) from quantize_int8(dim=-1) too."""
    out = []
    for name, t in scales.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 4 and t.shape[3] == 1:
            t = t[..., 0]  # quantize_int8(k, dim=-1) keeps the reduced dim
        if t.shape != k_q.shape[:3]:
            raise ValueError(f"{name} must be fp16/fp32 of shape (B, H_KV, S_max) = {tuple(k_q.shape[:3])} (or with a "
                             f"trailing 1), one scale per cached row, got {tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.float32):
            raise TypeError(f"{name} must be fp16 or fp32, got {t.dtype}")
        if t.device != k_q.device:
            raise ValueError(f"{name} must be on the cache's device {k_q.device}, got {t.device}")
        out.append(t)
    return out


def _check_int8_args(q, k_q, k_scale, v_q, v_scale, seq_lens):
    """Returns (longest sequence, k_scale, v_scale as (B, H_KV, S_max))."""
    if not isinstance(q, torch.Tensor) or not q.is_floating_point():
        raise TypeError(f"q must be a floating-point tensor, got {getattr(q, 'dtype', type(q).__name__)}")
    longest = _check_cache_args(q, k_q, v_q, seq_lens, kv_dtype=torch.int8)
    k_scale, v_scale = _check_scales(k_q, {"k_scale": k_scale, "v_scale": v_scale})
    return longest, k_scale, v_scale


def int8_decode_attention_ref(q, k_q, k_scale, v_q, v_scale, seq_lens):
    """Dequantize the cached rows, then chapter 03's reference decode attention (fp32).

    >>> k = v = torch.ones(1, 1, 4, 8)  # (B, H_KV, S_max, D)
    >>> k_q, k_scale = quantize_int8(k, dim=-1)  # scales (B, H_KV, S_max, 1)
    >>> out = int8_decode_attention_ref(torch.ones(1, 2, 8), k_q, k_scale, k_q, k_scale, torch.tensor([3]))
    >>> out.shape, out[0, 0, 0].item()
    (torch.Size([1, 2, 8]), 1.0)
    """
    _, k_scale, v_scale = _check_int8_args(q, k_q, k_scale, v_q, v_scale, seq_lens)
    k = dequantize_int8(k_q, k_scale[..., None], q.dtype)  # (B, H_KV, S_max, D)
    v = dequantize_int8(v_q, v_scale[..., None], q.dtype)
    return decode_attention_ref(q, k, v, seq_lens)


def int8_decode_attention(q, k_q, k_scale, v_q, v_scale, seq_lens, num_splits=None):
    """Decode attention over an int8 cache, dequantizing inside the kernel; same result as the ref.

    q (B, H, D) fp32/fp16/bf16; k_q, v_q (B, H_KV, S_max, D) int8; k_scale, v_scale (B, H_KV, S_max)
    fp16/fp32, or (B, H_KV, S_max, 1) as ``quantize_int8(k, dim=-1)`` returns them.

    >>> from kvlib.runtime import DEVICE
    >>> g = torch.Generator().manual_seed(0)
    >>> q = torch.randn(1, 4, 16, generator=g).to(DEVICE)  # (B, H, D)
    >>> k, v = (torch.randn(1, 2, 8, 16, generator=g).to(DEVICE) for _ in range(2))  # (B, H_KV, S_max, D)
    >>> (k_q, k_scale), (v_q, v_scale) = quantize_int8(k, dim=-1), quantize_int8(v, dim=-1)
    >>> lens = torch.tensor([8], device=DEVICE)
    >>> out = int8_decode_attention(q, k_q, k_scale, v_q, v_scale, lens)
    >>> torch.allclose(out, int8_decode_attention_ref(q, k_q, k_scale, v_q, v_scale, lens), atol=1e-5)
    True
    >>> bool((out - decode_attention_ref(q, k, v, lens)).abs().max() < 0.05)  # close to full precision
    True
    """
    longest, k_scale, v_scale = _check_int8_args(q, k_q, k_scale, v_q, v_scale, seq_lens)
    check_kernel_dtype("quant.int8_decode_attention", "q", q)
    if k_q.stride(3) != 1 or v_q.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("q, k_q and v_q must be contiguous along the head dim D (stride 1)")
    if k_scale.stride(2) != 1 or k_scale.stride() != v_scale.stride():  # the kernel reads both with one stride
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
    if not runtime.require_triton("quant.int8_decode_attention", q=q, k_q=k_q, k_scale=k_scale, v_q=v_q,
                                  v_scale=v_scale, seq_lens=seq_lens):
        return int8_decode_attention_ref(q, k_q, k_scale, v_q, v_scale, seq_lens)
    kv_strides = (k_q.stride(0), k_q.stride(1), k_q.stride(2), v_q.stride(0), v_q.stride(1), v_q.stride(2))
    return grouped_decode_launch(q, k_q, v_q, seq_lens, kv_strides, k_q.shape[1], num_splits, longest,
                                 k_scale=k_scale, v_scale=v_scale)


# --------------------------------------------------------------------------------------------
# quantize on store: reference, kernel, wrapper
# --------------------------------------------------------------------------------------------


def _check_int8_store(k_q, k_scale, v_q, v_scale, k_new, v_new, start):
    """Shapes, dtypes, devices and positions of an int8 store; returns the scales as (B, H_KV, S_max)."""
    _check_store_args(k_q, v_q, k_new, v_new, start, cache_dtype=torch.int8, names=("k_q", "v_q"))
    return _check_scales(k_q, {"k_scale": k_scale, "v_scale": v_scale})


def store_kv_int8_ref(k_q, k_scale, v_q, v_scale, k_new, v_new, start):
    """Quantize k_new/v_new (B, H_KV, T, D) per row and write them at start[b].. with their scales.

    >>> k_q, v_q = torch.zeros(1, 1, 4, 2, dtype=torch.int8), torch.zeros(1, 1, 4, 2, dtype=torch.int8)
    >>> k_scale, v_scale = torch.ones(1, 1, 4), torch.ones(1, 1, 4)  # (B, H_KV, S_max)
    >>> new = torch.tensor([[[[0.5, -1.27]]]])  # (B, H_KV, T, D): one token
    >>> store_kv_int8_ref(k_q, k_scale, v_q, v_scale, new, new, torch.tensor([2]))
    >>> k_q[0, 0].tolist(), k_scale[0, 0].tolist()
    ([[0, 0], [0, 0], [50, -127], [0, 0]], [1.0, 1.0, 0.009999999776482582, 1.0])
    """
    k_scale, v_scale = _check_int8_store(k_q, k_scale, v_q, v_scale, k_new, v_new, start)
    kq, ks = quantize_int8(k_new, dim=-1)
    vq, vs = quantize_int8(v_new, dim=-1)
    T = k_new.shape[2]
    for b in range(k_new.shape[0]):
        s = int(start[b])
        k_q[b, :, s: s + T], k_scale[b, :, s: s + T] = kq[b], ks[b, ..., 0]
        v_q[b, :, s: s + T], v_scale[b, :, s: s + T] = vq[b], vs[b, ..., 0]


@triton.jit
def _quantize_store(new_ptr, q_ptr, scale_ptr, src, dst, dims, mask, row_ok, D):
    """Quantize a tile of new rows (ROWS, TILE_D) and write each to its cache row with its scale.

    src: (ROWS,) offset of each new row; dst: (ROWS,) its cache row (values at dst * D, scale at dst)."""
    x = tl.load(new_ptr + src[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)  # (ROWS, TILE_D)
    amax = tl.max(tl.abs(x), axis=1)  # (ROWS,) one scale per row, computed in the tile
    scale = tl.where(amax > 0, amax / 127.0, 1.0)
    y = x / scale[:, None]
    q = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))  # round half away from zero
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(q_ptr + dst[:, None] * D + dims[None, :], q.to(tl.int8), mask=mask)
    tl.store(scale_ptr + dst, scale.to(scale_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _store_int8_kernel(
    k_new_ptr, v_new_ptr,  # new rows (B, H_KV, T, D) fp32/fp16/bf16, one layout, D stride 1
    k_q_ptr, v_q_ptr,  # int8 caches (B, H_KV, S_max, D), contiguous
    k_scale_ptr, v_scale_ptr,  # their scales (B, H_KV, S_max), contiguous
    start_ptr,  # (B,) first position to write for each sequence
    stride_nb, stride_nh, stride_nt,  # strides of k_new / v_new
    H_KV, T, S_max, D, n_rows,  # n_rows = B * H_KV * T new rows
    TILE_R: tl.constexpr,  # new rows per program
    TILE_D: tl.constexpr,  # head dim padded to a power of two
):
    r = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)  # (TILE_R,) new rows, numbered in (b, h, t) order
    row_ok = r < n_rows
    t = r % T
    bh = r // T
    b = bh // H_KV
    h = bh % H_KV
    start = tl.load(start_ptr + b, mask=row_ok, other=0)
    # 64-bit offsets: a cache of B * H_KV * S_max * D >= 2**31 int8 values is only 2 GB
    src = b.to(tl.int64) * stride_nb + h.to(tl.int64) * stride_nh + t.to(tl.int64) * stride_nt
    dst = bh.to(tl.int64) * S_max + start + t  # the cache row (b, h, start[b] + t)
    dims = tl.arange(0, TILE_D)
    mask = row_ok[:, None] & (dims[None, :] < D)
    _quantize_store(k_new_ptr, k_q_ptr, k_scale_ptr, src, dst, dims, mask, row_ok, D)
    _quantize_store(v_new_ptr, v_q_ptr, v_scale_ptr, src, dst, dims, mask, row_ok, D)


def _store_int8_tile_r(TILE_D: int) -> int:
    """New rows per program: 4096 elements per tile, 32 rows of D = 128 (56 registers on sm_80 and sm_90,
    63 on sm_75; 64 rows take 71 on sm_90, 128 rows 116), so a decode step's B·H_KV rows take a handful
    of programs instead of one 4-warp program per 128-element row."""
    return max(1, 4096 // TILE_D)


def store_kv_int8(k_q, k_scale, v_q, v_scale, k_new, v_new, start):
    """Quantize-on-store with the Triton kernel: each program quantizes a tile of new rows (K and V), each
    row with its own scale = absmax / 127.

    k_q, v_q (B, H_KV, S_max, D) int8 and their scales (B, H_KV, S_max) fp16/fp32, all contiguous;
    k_new, v_new (B, H_KV, T, D) fp32/fp16/bf16; start (B,) int.

    >>> from kvlib.runtime import DEVICE
    >>> k_q = torch.zeros(1, 1, 4, 2, dtype=torch.int8, device=DEVICE)
    >>> v_q = torch.zeros_like(k_q)
    >>> k_scale, v_scale = torch.ones(1, 1, 4, device=DEVICE), torch.ones(1, 1, 4, device=DEVICE)
    >>> new = torch.tensor([[[[0.5, -1.27]]]], device=DEVICE)  # (B, H_KV, T, D): one token
    >>> store_kv_int8(k_q, k_scale, v_q, v_scale, new, new, torch.tensor([2], device=DEVICE))
    >>> k_q[0, 0, 2].tolist(), round(k_scale[0, 0, 2].item(), 4)
    ([50, -127], 0.01)
    """
    k_scale, v_scale = _check_int8_store(k_q, k_scale, v_q, v_scale, k_new, v_new, start)
    B, H_KV, T, D = k_new.shape
    check_kernel_dtype("quant.store_kv_int8", "k_new", k_new)
    if not all(t.is_contiguous() for t in (k_q, v_q, k_scale, v_scale)):
        raise ValueError("the int8 caches and their scales must be contiguous")
    start = start.contiguous()
    if not runtime.require_triton("quant.store_kv_int8", k_q=k_q, k_scale=k_scale, v_q=v_q, v_scale=v_scale,
                                  k_new=k_new, v_new=v_new, start=start):
        return store_kv_int8_ref(k_q, k_scale, v_q, v_scale, k_new, v_new, start)
    if k_new.stride(3) != 1 or v_new.stride() != k_new.stride():  # the kernel reads both with one set of strides
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    TILE_D = max(16, triton.next_power_of_2(D))
    TILE_R = _store_int8_tile_r(TILE_D)
    n_rows = B * H_KV * T
    _store_int8_kernel[(triton.cdiv(n_rows, TILE_R),)](
        k_new, v_new, k_q, v_q, k_scale, v_scale, start, k_new.stride(0), k_new.stride(1), k_new.stride(2),
        H_KV, T, k_q.shape[2], D, n_rows, TILE_R=TILE_R, TILE_D=TILE_D)


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------


class Int8KVCache(KVCache):
    """Chapter 03's contiguous cache with int8 values and one fp16 scale per (sequence, head, position).

    Every K/V row is quantized when stored (per token and head); prefill and decode both attend over
    the dequantized cache, so the model sees exactly what an int8 cache holds. Lengths, capacity
    checks and the views ``generate`` uses are KVCache's.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = Int8KVCache.for_model(model, batch=1, max_len=8)
    >>> with torch.no_grad():
    ...     logits = model(torch.tensor([[1, 2, 3]]), cache=cache)
    >>> cache.seq_lens.tolist(), cache.k[0].dtype, cache.k_scale[0].shape  # scales (B, H_KV, S_max)
    ([3], torch.int8, torch.Size([1, 2, 8]))
    """

    def __init__(self, n_layers, batch, n_kv_heads, max_len, head_dim, device="cpu", kernels=None):
        super().__init__(n_layers, batch, n_kv_heads, max_len, head_dim, torch.int8, device, kernels)
        scale_shape = (batch, n_kv_heads, max_len)  # (B, H_KV, S_max)
        self.k_scale = [torch.ones(scale_shape, dtype=torch.float16, device=device) for _ in range(n_layers)]
        self.v_scale = [torch.ones(scale_shape, dtype=torch.float16, device=device) for _ in range(n_layers)]

    @classmethod
    def for_model(cls, model, batch, max_len, kernels=None):
        c = model.config
        return cls(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, model.device, kernels)

    def nbytes(self) -> int:
        """Bytes of values and scales."""
        return sum(t.nbytes for t in self.k + self.v + self.k_scale + self.v_scale)

    def attend(self, layer_idx, q, k, v):
        self._check_attend(layer_idx, q, k, v, kv_dtype=None)
        T, start = q.shape[2], self.seq_lens
        L = self._make_room(T)
        kq, ks, vq, vs = self.k[layer_idx], self.k_scale[layer_idx], self.v[layer_idx], self.v_scale[layer_idx]
        triton_kernels = self.kernels == "triton"
        (store_kv_int8 if triton_kernels else store_kv_int8_ref)(kq, ks, vq, vs, k, v, start)
        if T == 1:
            decode = int8_decode_attention if triton_kernels else int8_decode_attention_ref
            out = decode(q[:, :, 0], kq, ks, vq, vs, start + 1)[:, :, None]  # (B, H, 1, D)
        else:
            k_all = dequantize_int8(kq[:, :, :L], ks[:, :, :L, None], q.dtype)  # (B, H_KV, L, D)
            v_all = dequantize_int8(vq[:, :, :L], vs[:, :, :L, None], q.dtype)
            out = attention_ref(q, k_all, v_all, causal=True)
        self._advance(layer_idx, T)
        return out


@torch.no_grad()
def quality_report(model, ids, n_tokens: int = 200) -> dict:
    """Teacher-forced comparison of the int8 cache with a full-precision cache on a text ``ids``.

    Feeds the first token, then each next token of ``ids`` one decode step at a time through both
    caches, for ``n_tokens`` steps. Reports greedy agreement (same argmax), the largest logit
    difference, perplexity of the text under each cache and the caches' bytes.
    """
    ids = list(ids)[: n_tokens + 1]
    if len(ids) < 2:
        raise ValueError("ids must hold at least 2 tokens")
    caches = {"full": KVCache.for_model(model, 1, len(ids)), "int8": Int8KVCache.for_model(model, 1, len(ids))}
    logits = {name: [] for name in caches}
    for name, cache in caches.items():
        for pos in range(len(ids) - 1):
            x = torch.tensor([[ids[pos]]], device=model.device)
            logits[name].append(model(x, positions=torch.tensor([[pos]], device=model.device), cache=cache)[0, -1])
    full, int8 = torch.stack(logits["full"]), torch.stack(logits["int8"])  # (n, V)
    target = torch.tensor(ids[1:], device=full.device)
    nll = {n: torch.nn.functional.cross_entropy(l, target).item() for n, l in (("full", full), ("int8", int8))}
    return {
        "tokens": len(target),
        "greedy_agreement": (full.argmax(-1) == int8.argmax(-1)).float().mean().item(),
        "max_logit_error": (full - int8).abs().max().item(),
        "ppl_full": math.exp(nll["full"]),
        "ppl_int8": math.exp(nll["int8"]),
        "ppl_change": math.exp(nll["int8"]) / math.exp(nll["full"]) - 1,
        "bytes_full": caches["full"].nbytes(),
        "bytes_int8": caches["int8"].nbytes(),
    }


# --------------------------------------------------------------------------------------------
# How kvlib.course.compile_check builds the kernels: the wrappers' own launches at a realistic shape
# --------------------------------------------------------------------------------------------


def _int8_inputs(q_dtype="fp16", H=32, B=2, H_KV=8, S_max=1024, D=128):
    """q, int8 caches and fp16 scales, seq_lens on the CPU (two ragged sequences)."""
    q, k, v, lens = _compile_inputs(q_dtype, B=B, H=H, H_KV=H_KV, S_max=S_max, D=D)
    k_q, v_q = (torch.zeros(B, H_KV, S_max, D, dtype=torch.int8) for _ in range(2))
    k_scale, v_scale = (torch.ones(B, H_KV, S_max, dtype=torch.float16) for _ in range(2))
    return q, k_q, k_scale, v_q, v_scale, lens


def _store_inputs(T, B=2, H_KV=8, S_max=1024, D=128):
    """int8 caches and fp16 scales, T new fp16 rows per sequence written at ragged positions."""
    k_q, v_q = (torch.zeros(B, H_KV, S_max, D, dtype=torch.int8) for _ in range(2))
    k_scale, v_scale = (torch.ones(B, H_KV, S_max, dtype=torch.float16) for _ in range(2))
    new = torch.zeros(B, H_KV, T, D, dtype=torch.float16)
    return k_q, k_scale, v_q, v_scale, new, new, torch.tensor([S_max - T - 5, 7][:B], dtype=torch.int32)


COMPILE_SPECS = [
    *(dict(name=f"int8 {dt} query {H}/8 splits={n}", archs=(80, 90) if dt == "bf16" else (75, 80, 90),
           loops=DECODE_LOOPS,
           launch=lambda dt=dt, H=H, n=n: int8_decode_attention(*_int8_inputs(dt, H=H), num_splits=n))
      for dt, H, n in (("fp16", 32, 1), ("fp16", 32, 8), ("fp16", 64, 8), ("bf16", 32, 8), ("fp32", 32, 8))),
    dict(name="store_kv_int8 1 token", launch=lambda: store_kv_int8(*_store_inputs(1))),
    dict(name="store_kv_int8 512 tokens", launch=lambda: store_kv_int8(*_store_inputs(512))),
    dict(name="store_kv_int8 37 tokens", launch=lambda: store_kv_int8(*_store_inputs(37))),  # not 16-divisible
]
