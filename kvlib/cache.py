"""The contiguous KV cache (chapter 03): store each token's K/V once, attend over them every step.

What you will learn:
- the past never changes: a token's key and value depend only on the tokens before it, so they are
  computed once and stored, and each decoding step feeds the model only the newest token;
- ``KVCache``: per layer two preallocated buffers of shape (B, H_KV, S_max, D) and one length per
  sequence. It plugs into the model's seam (``cache.attend(layer_idx, q, k, v)``);
- ``store_kv``: a Triton kernel that writes T new K/V rows of every sequence at its own position;
- ``decode_attention``: one query token per sequence attending over its first ``seq_lens[b]``
  cached positions (a ragged batch), with fp32 accumulation and grouped K/V heads;
- split-K ("Flash-Decoding"): with few sequences and heads, the GPU would have too few programs;
  each sequence's positions are then split across programs whose partial results are merged with
  their log-sum-exp, exactly like the online softmax of chapter 01.

Shapes: q (B, H, D); k_cache, v_cache (B, H_KV, S_max, D); seq_lens (B,) integer.
"""

import math
import operator

import torch

from . import runtime
from ._triton import check_kernel_dtype, tl, triton
from .attention import attention_ref, flash_attention

__all__ = ["KVCache", "store_kv", "store_kv_ref", "decode_attention", "decode_attention_ref", "CacheFullError"]


class CacheFullError(RuntimeError):
    """Appending would run past the cache's capacity; nothing was written."""


def check_int(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int >= minimum, or a TypeError/ValueError naming ``name``.

    >>> check_int("max_len", 8)
    8
    >>> check_int("max_len", -3)
    Traceback (most recent call last):
    ...
    ValueError: max_len must be >= 1, got -3
    """
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = operator.index(value)  # numpy and 0-d torch integers too; never a float
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_cache_args(q, k_cache, v_cache, seq_lens, kv_dtype=None) -> int:
    """kv_dtype: the caches' required dtype when it differs from q's (int8 caches, chapter 06).

    Returns the longest sequence. Reads seq_lens on the host once (one GPU sync per call: a decode
    step over a few hundred MB of K/V takes ~100 µs, so every sync would show in the curves)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be (B, H, D), got shape {tuple(q.shape)}")
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating-point tensor, got {q.dtype}")
    if q.numel() == 0:
        raise ValueError(f"q must hold at least one sequence, head and dim (B, H, D >= 1), got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be (B, H_KV, S_max, D), got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    B, H, D = q.shape
    if k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"k_cache must be (B={B}, H_KV, S_max, D={D}) to match q, got {tuple(k_cache.shape)}")
    H_KV = k_cache.shape[1]
    if H_KV < 1 or H % H_KV:
        raise ValueError(f"k_cache has H_KV={H_KV} heads, which must divide q's H={H} heads")
    if k_cache.shape[2] < 1:
        raise ValueError(f"k_cache must hold S_max >= 1 positions, got shape {tuple(k_cache.shape)}")
    if seq_lens.dtype not in (torch.int32, torch.int64) or seq_lens.shape != (B,):
        raise ValueError(f"seq_lens must be a (B={B},) int32/int64 tensor, got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    want = kv_dtype or q.dtype
    if not (k_cache.dtype == v_cache.dtype == want):
        raise ValueError(f"k_cache and v_cache must be {want} (q is {q.dtype}), got {k_cache.dtype}, {v_cache.dtype}")
    if not (q.device == k_cache.device == v_cache.device == seq_lens.device):
        raise ValueError("q, k_cache, v_cache and seq_lens must be on one device")
    lo, hi = torch.stack([seq_lens.min(), seq_lens.max()]).tolist()
    if lo < 1 or hi > k_cache.shape[2]:
        raise ValueError(f"seq_lens must lie in 1..S_max={k_cache.shape[2]}, got values in {lo}..{hi}")
    return hi


# --------------------------------------------------------------------------------------------
# decode attention: reference, kernels, wrapper
# --------------------------------------------------------------------------------------------


def decode_attention_ref(q, k_cache, v_cache, seq_lens):
    """softmax(q . k / sqrt(D)) v over each sequence's first seq_lens[b] positions, in fp32.

    >>> k = torch.zeros(2, 1, 4, 8)  # (B, H_KV, S_max, D)
    >>> v = torch.arange(4.0).view(1, 1, 4, 1).expand(2, 1, 4, 8)  # position p holds the value p
    >>> out = decode_attention_ref(torch.zeros(2, 2, 8), k, v, torch.tensor([1, 4]))  # equal scores
    >>> out[:, :, 0]  # the mean of the first seq_lens[b] values: 0, then (0+1+2+3)/4
    tensor([[0.0000, 0.0000],
            [1.5000, 1.5000]])
    """
    _check_cache_args(q, k_cache, v_cache, seq_lens)
    B, H, D = q.shape
    n_rep = H // k_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(B):  # ragged: each sequence has its own length
        L = int(seq_lens[b])
        k = k_cache[b, :, :L].float().repeat_interleave(n_rep, 0)  # (H, L, D)
        v = v_cache[b, :, :L].float().repeat_interleave(n_rep, 0)  # (H, L, D)
        scores = (k @ q[b].float()[:, :, None])[..., 0] / math.sqrt(D)  # (H, L)
        out[b] = (torch.softmax(scores, -1)[:, None, :] @ v)[:, 0].to(q.dtype)  # (H, D)
    return out


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr,  # q (B, H, D); caches (B, H_KV, S_max, D)
    o_ptr, lse_ptr,  # output (B, H, SPLITS, D) fp32 partials and (B, H, SPLITS) log-sum-exp (log2 units)
    seq_lens_ptr,  # (B,) valid cached positions per sequence
    stride_qb, stride_qh,  # q strides (the D stride is 1)
    stride_kb, stride_kh, stride_ks,  # k strides: per sequence, per head, per position
    stride_vb, stride_vh, stride_vs,  # v strides, the same way
    H, D, n_rep,  # query heads, head dim, query heads per K/V head
    qk_scale,  # 1/sqrt(D) * log2(e)
    SPLITS: tl.constexpr,  # programs per (sequence, head) along the positions (1 = no split)
    TILE_N: tl.constexpr,  # cached positions per inner step
    TILE_D: tl.constexpr,  # head dim padded to a power of two
):
    pid_bh = tl.program_id(0).to(tl.int64)  # which (sequence, query head); 64-bit, see below
    split = tl.program_id(1)  # which slice of the positions
    # Offsets in 64 bits: Triton passes strides below 2**31 as int32, and b * stride_kb is computed in the
    # type of its operands, so with 32-bit b it wraps once (B-1) * H_KV * S_max * D passes 2**31 (B = 32,
    # 8 K/V heads, 64K positions, D = 128 already does). A 64-bit b makes every product below 64-bit.
    b = pid_bh // H
    h = pid_bh % H
    kv_h = h // n_rep  # GQA: the K/V head this query head reads
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    # Split-K sized by this sequence's own length (as vLLM and SGLang do), in multiples of 16 positions:
    # sized by S_max instead, a short sequence's positions would all land in the first split.
    split_len = tl.cdiv(tl.cdiv(seq_len, SPLITS), 16) * 16
    start = split * split_len
    end = tl.minimum(seq_len, start + split_len)

    dims = tl.arange(0, TILE_D)
    dim_ok = dims < D
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + dims, mask=dim_ok, other=0.0).to(tl.float32)  # (TILE_D,)
    k_head = k_ptr + b * stride_kb + kv_h * stride_kh  # position 0 of this sequence's K/V head
    v_head = v_ptr + b * stride_vb + kv_h * stride_vh
    m_i = -1.0e30  # running max (log2 units)
    l_i = 0.0  # running sum of exp2(score - m_i)
    acc = tl.zeros((TILE_D,), dtype=tl.float32)
    for pos0 in range(start, end, TILE_N):
        pos = pos0 + tl.arange(0, TILE_N)  # (TILE_N,) positions of this step
        pos_ok = pos < end
        mask = pos_ok[:, None] & dim_ok[None, :]
        rows = pos.to(tl.int64)[:, None]  # (TILE_N, 1)
        k = tl.load(k_head + rows * stride_ks + dims[None, :], mask=mask, other=0.0).to(tl.float32)  # (TILE_N, TILE_D)
        s = tl.sum(k * q[None, :], axis=1) * qk_scale  # (TILE_N,) one query: a row of dot products
        s = tl.where(pos_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)  # (TILE_N,)
        v = tl.load(v_head + rows * stride_vs + dims[None, :], mask=mask, other=0.0).to(tl.float32)  # (TILE_N, TILE_D)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new

    row = pid_bh * SPLITS + split
    empty = l_i == 0.0  # a split past the end of a short sequence saw no positions
    tl.store(o_ptr + row * D + dims, acc / tl.where(empty, 1.0, l_i), mask=dim_ok)
    tl.store(lse_ptr + row, tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i))))


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr,  # (B*H, SPLITS, D) fp32 partial outputs, (B*H, SPLITS) log-sum-exp in log2 units
    o_ptr,  # output (B, H, D) in the query's dtype
    stride_ob, stride_oh,  # output strides (the D stride is 1)
    H, D,  # query heads, head dim
    SPLITS: tl.constexpr,  # number of partial results per (sequence, head)
    TILE_D: tl.constexpr,  # head dim padded to a power of two
):
    pid_bh = tl.program_id(0).to(tl.int64)  # 64-bit offsets, as in _decode_kernel
    b = pid_bh // H
    h = pid_bh % H
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, TILE_D)
    lse = tl.load(lse_ptr + pid_bh * SPLITS + splits)  # (SPLITS,)
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - m)  # (SPLITS,) weight of each split: its share of the whole row's softmax sum
    part = tl.load(part_ptr + (pid_bh * SPLITS + splits[:, None]) * D + dims[None, :], mask=dims[None, :] < D,
                   other=0.0)  # (SPLITS, TILE_D)
    out = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + dims, out.to(o_ptr.dtype.element_ty), mask=dims < D)


def _decode_tile_n(TILE_D: int, element_size: int = 2) -> int:
    """Cached positions per inner step on a GPU: 64 rows of 128 fp16/bf16 values (16 KB per K or V tile), 16
    of fp32 (8 KB). Built as the JIT builds them (``python -m kvlib.course.compile_check --module cache``), 64 fp16
    rows take 87 warp instructions per KB of K/V on sm_90 against 97.5 for 32 rows, with 95 registers and
    no spill on sm_75/80/90; 32 fp32 rows spill on sm_80."""
    budget = 16384 if element_size <= 2 else 8192
    return max(16, budget // (TILE_D * element_size))


def choose_splits(programs: int, max_len: int) -> int:
    """How many programs share one sequence's positions (split-K), as a power of two.

    programs: how many the grid launches without splitting (B·H for a per-head kernel, B·H_KV for a
    grouped one). Enough programs to cover the GPU's multiprocessors about twice, but never splits
    shorter than 256 positions of the longest sequence (below that, merging costs more than it saves).
    1 on the CPU interpreter.
    """
    if runtime.DEVICE != "cuda" or runtime.INTERPRETER:
        return 1
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = 1
    while programs * splits < 2 * sms and max_len // (splits * 2) >= 256 and splits < 64:
        splits *= 2
    return splits


def decode_attention(q, k_cache, v_cache, seq_lens, num_splits=None):
    """One query token per sequence over its cached K/V; same result as ``decode_attention_ref``.

    num_splits: None chooses automatically (``choose_splits``); 1 disables split-K; a power of two
    forces that many splits. q and the caches: fp32, fp16 or bf16 (bf16 needs a GPU of compute
    capability >= 8.0).

    >>> from kvlib.runtime import DEVICE
    >>> g = torch.Generator().manual_seed(0)
    >>> q = torch.randn(2, 4, 16, generator=g).to(DEVICE)  # (B, H, D)
    >>> k, v = (torch.randn(2, 2, 8, 16, generator=g).to(DEVICE) for _ in range(2))  # (B, H_KV, S_max, D)
    >>> lens = torch.tensor([8, 3], device=DEVICE)
    >>> torch.allclose(decode_attention(q, k, v, lens), decode_attention_ref(q, k, v, lens), atol=1e-5)
    True
    """
    longest = _check_cache_args(q, k_cache, v_cache, seq_lens)
    check_kernel_dtype("cache.decode_attention", "q", q)
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("q, k_cache and v_cache must be contiguous along the head dim D (stride 1)")
    if not runtime.require_triton("cache.decode_attention", q=q, k_cache=k_cache, v_cache=v_cache,
                                  seq_lens=seq_lens):
        return decode_attention_ref(q, k_cache, v_cache, seq_lens)
    return launch_decode(q, k_cache, v_cache, seq_lens, num_splits, longest)


def launch_decode(q, k, v, seq_lens, num_splits=None, longest=None):
    """Launch ``_decode_kernel`` (+ the split merge) over contiguous caches k, v (B, H_KV, S_max, D).
    longest: the longest of seq_lens when the caller knows it (saves reading it back from the GPU)."""
    B, H, D = q.shape
    n_rep = H // k.shape[1]
    if num_splits is None:  # the grid below launches B·H programs per split
        num_splits = choose_splits(B * H, int(seq_lens.max()) if longest is None else longest)
    check_num_splits(num_splits)
    seq_lens = seq_lens.contiguous()  # the kernel reads seq_lens[b] with a unit stride
    TILE_D = max(16, triton.next_power_of_2(D))
    TILE_N = 64 if runtime.INTERPRETER else _decode_tile_n(TILE_D, k.element_size())
    part = torch.empty(B * H, num_splits, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(B * H, num_splits, device=q.device, dtype=torch.float32)
    _decode_kernel[(B * H, num_splits)](
        q, k, v, part, lse, seq_lens, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), H, D, n_rep, (1.0 / math.sqrt(D)) * 1.4426950408889634,
        SPLITS=num_splits, TILE_N=TILE_N, TILE_D=TILE_D,
    )
    return merge_splits(q, part, lse)


def check_num_splits(num_splits: int):
    if not isinstance(num_splits, int) or num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits!r}")


def merge_splits(q, part, lse):
    """The (B, H, D) output from per-split partials (B*H, SPLITS, D) and their log-sum-exp."""
    B, H, D = q.shape
    num_splits = part.shape[1]
    out = torch.empty_like(q)
    if num_splits == 1:
        out.copy_(part.view(B, H, D))
        return out
    _merge_splits_kernel[(B * H,)](part, lse, out, out.stride(0), out.stride(1), H, D,
                                   SPLITS=num_splits, TILE_D=max(16, triton.next_power_of_2(D)))
    return out


def pick_kernels(kernels, device="cuda"):
    """A cache's kernels: "triton" or "torch"; None means Triton for a cache on the GPU in GPU mode,
    the PyTorch references elsewhere (the interpreter would only be slow)."""
    if kernels is None:
        kernels = "triton" if runtime.mode() == "gpu" and torch.device(device).type == "cuda" else "torch"
    if kernels not in ("triton", "torch"):
        raise ValueError(f"kernels must be 'triton' or 'torch', got {kernels!r}")
    return kernels


# --------------------------------------------------------------------------------------------
# store: reference, kernel, wrapper
# --------------------------------------------------------------------------------------------


def _check_store_args(k_cache, v_cache, k_new, v_new, start, cache_dtype=None, names=("k_cache", "v_cache")):
    """Shapes, dtypes, devices and positions of a store (cache_dtype: the caches' dtype when it is not k_new's;
    names: what the caller calls its two caches, for the messages)."""
    kc, vc = names
    for name, t in ((kc, k_cache), (vc, v_cache), ("k_new", k_new), ("v_new", v_new), ("start", start)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in ((kc, k_cache), (vc, v_cache), ("k_new", k_new), ("v_new", v_new)):
        if t.dim() != 4 or t.numel() == 0:
            raise ValueError(f"{name} must be a non-empty 4-d tensor (B, H_KV, S_max or T, D), got shape {tuple(t.shape)}")
    B, H_KV, T, D = k_new.shape
    if v_new.shape != k_new.shape:
        raise ValueError(f"v_new must have k_new's shape {tuple(k_new.shape)}, got {tuple(v_new.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.shape[:2] != (B, H_KV) or k_cache.shape[3] != D:
        raise ValueError(f"{kc}/{vc} must be (B={B}, H_KV={H_KV}, S_max, D={D}), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not k_new.is_floating_point() or v_new.dtype != k_new.dtype:
        raise TypeError(f"k_new and v_new must share one floating-point dtype, got {k_new.dtype}, {v_new.dtype}")
    want = cache_dtype or k_new.dtype
    if not (k_cache.dtype == v_cache.dtype == want):
        raise TypeError(f"{kc} and {vc} must be {want}, got {k_cache.dtype}, {v_cache.dtype}")
    if start.shape != (B,) or start.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"start must be a (B={B},) int32/int64 tensor, got {tuple(start.shape)} {start.dtype}")
    if len({t.device for t in (k_cache, v_cache, k_new, v_new, start)}) != 1:
        raise ValueError(f"{kc}, {vc}, k_new, v_new and start must be on one device")
    lo, hi = torch.stack([start.min(), start.max()]).tolist()  # one host read
    if lo < 0 or hi + T > k_cache.shape[2]:
        raise ValueError(f"writing T={T} rows from start {start.tolist()} runs past S_max={k_cache.shape[2]}")


def store_kv_ref(k_cache, v_cache, k_new, v_new, start):
    """Write k_new/v_new (B, H_KV, T, D) into the caches at positions start[b] .. start[b]+T-1.

    >>> k_cache, v_cache = torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2)
    >>> store_kv_ref(k_cache, v_cache, torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), torch.tensor([1]))
    >>> k_cache[0, 0, :, 0].tolist()
    [0.0, 1.0, 1.0, 0.0]
    """
    _check_store_args(k_cache, v_cache, k_new, v_new, start)
    for b in range(k_new.shape[0]):
        s = int(start[b])
        k_cache[b, :, s: s + k_new.shape[2]] = k_new[b]
        v_cache[b, :, s: s + v_new.shape[2]] = v_new[b]


@triton.jit
def _store_kv_kernel(
    k_new_ptr, v_new_ptr,  # new rows (B, H_KV, T, D)
    k_cache_ptr, v_cache_ptr,  # caches (B, H_KV, S_max, D)
    start_ptr,  # (B,) first position to write for each sequence
    stride_nb, stride_nh, stride_nt,  # strides of k_new / v_new (same layout; D stride 1)
    stride_cb, stride_ch, stride_cs,  # strides of the caches (D stride 1)
    H_KV, T, D,
    TILE_T: tl.constexpr,  # new rows per program
    TILE_D: tl.constexpr,  # head dim padded to a power of two
):
    pid_bh = tl.program_id(0).to(tl.int64)  # which (sequence, K/V head); 64-bit offsets as in _decode_kernel
    pid_t = tl.program_id(1)  # which tile of new rows
    b = pid_bh // H_KV
    h = pid_bh % H_KV
    start = tl.load(start_ptr + b)
    rows = pid_t * TILE_T + tl.arange(0, TILE_T)
    dims = tl.arange(0, TILE_D)
    mask = (rows[:, None] < T) & (dims[None, :] < D)
    src = b * stride_nb + h * stride_nh + rows.to(tl.int64)[:, None] * stride_nt + dims[None, :]
    dst = b * stride_cb + h * stride_ch + (start + rows).to(tl.int64)[:, None] * stride_cs + dims[None, :]
    tl.store(k_cache_ptr + dst, tl.load(k_new_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_new_ptr + src, mask=mask), mask=mask)


def store_kv(k_cache, v_cache, k_new, v_new, start):
    """Write T new K/V rows of each sequence at its own position ``start[b]`` (Triton kernel).

    k_cache, v_cache (B, H_KV, S_max, D); k_new, v_new (B, H_KV, T, D), one dtype (fp32, fp16, bf16);
    start (B,) int32/int64 tensor.

    >>> from kvlib.runtime import DEVICE
    >>> k_cache, v_cache = torch.zeros(2, 1, 4, 2, device=DEVICE), torch.zeros(2, 1, 4, 2, device=DEVICE)
    >>> new = torch.ones(2, 1, 1, 2, device=DEVICE)  # one new token per sequence
    >>> store_kv(k_cache, v_cache, new, new, torch.tensor([0, 3], device=DEVICE))
    >>> k_cache[:, 0, :, 0].tolist()  # sequence 0 got position 0, sequence 1 position 3
    [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
    """
    _check_store_args(k_cache, v_cache, k_new, v_new, start)
    B, H_KV, T, D = k_new.shape
    check_kernel_dtype("cache.store_kv", "k_new", k_new)  # the caches share its dtype (checked above)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share strides and be contiguous along D")
    start = start.contiguous()
    if not runtime.require_triton("cache.store_kv", k_cache=k_cache, v_cache=v_cache, k_new=k_new,
                                  v_new=v_new, start=start):
        return store_kv_ref(k_cache, v_cache, k_new, v_new, start)
    k_new, v_new = k_new.contiguous(), v_new.contiguous()
    TILE_D = max(16, triton.next_power_of_2(D))
    TILE_T = 16 if T > 1 else 1
    _store_kv_kernel[(B * H_KV, triton.cdiv(T, TILE_T))](
        k_new, v_new, k_cache, v_cache, start,
        k_new.stride(0), k_new.stride(1), k_new.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        H_KV, T, D, TILE_T=TILE_T, TILE_D=TILE_D,
    )


# --------------------------------------------------------------------------------------------
# The cache module
# --------------------------------------------------------------------------------------------


def check_attend_args(layer_idx, q, k, v, *, n_layers, batch, n_kv_heads, head_dim, kv_dtype, batch_is):
    """The checks every cache's ``attend`` makes before writing anything: a valid ``layer_idx`` and
    q (B, H, T, D), k/v (B, H_KV, T, D) that match the cache (``batch_is`` says where B comes from)."""
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < n_layers:
        raise ValueError(f"layer_idx must be an int in 0..{n_layers - 1} (the cache has {n_layers} layers), "
                         f"got {layer_idx!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor (B, heads, T, D), got {getattr(t, 'shape', type(t).__name__)}")
    B, H_KV, D = batch, n_kv_heads, head_dim
    Bq, H, T, Dq = q.shape
    if Bq != B:
        raise ValueError(f"q has batch {Bq}, but {batch_is}")
    if T < 1 or Dq != D or H % H_KV:
        raise ValueError(f"q must be (B={B}, H, T >= 1, D={D}) with H a multiple of the cache's H_KV={H_KV}, "
                         f"got {tuple(q.shape)}")
    want = (B, H_KV, T, D)
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise ValueError(f"k and v must be (B, H_KV, T, D) = {want} for this cache, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if kv_dtype is not None and not (k.dtype == v.dtype == kv_dtype):
        raise TypeError(f"k and v must be {kv_dtype} like the cache, got {k.dtype} and {v.dtype}")


class KVCache:
    """Preallocated K/V buffers for every layer: (B, H_KV, S_max, D) each, plus per-sequence lengths.

    Plugs into ``Transformer.forward(..., cache=cache)``: every layer calls ``attend`` with the new
    tokens' q, k, v; the cache stores k, v after each sequence's current length and attends over
    everything stored. After the last layer the lengths advance by T. One call gives every sequence
    the same number T of new tokens; prompts of different lengths are prefilled one sequence at a
    time through ``cache.sequence(b)``, a view that shares this cache's memory. ``reset()`` empties
    it (``generate`` does that first when it is given a cache).

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = KVCache.for_model(model, batch=1, max_len=8)
    >>> with torch.no_grad():
    ...     logits = model(torch.tensor([[1, 2, 3]]), cache=cache)  # prefill: 3 positions stored
    ...     logits = model(torch.tensor([[4]]), positions=cache.next_positions(), cache=cache)  # one decode step
    >>> cache.seq_lens.tolist(), tuple(cache.k[0].shape)  # (B, H_KV, S_max, D)
    ([4], (1, 2, 8, 16))
    """

    #: Attributes ``sequence(b)`` passes on whole instead of slicing along the batch: what every sequence
    #: shares (RoPE frequencies, fitted bases, per-layer bit widths). A subclass lists its own; the
    #: names of every class in the hierarchy count.
    shared_attrs: tuple[str, ...] = ()

    def __init__(self, n_layers, batch, n_kv_heads, max_len, head_dim, dtype=torch.float32, device="cpu",
                 kernels=None):
        n_layers, batch, max_len = check_int("n_layers", n_layers), check_int("batch", batch), check_int("max_len", max_len)
        n_kv_heads, head_dim = check_int("n_kv_heads", n_kv_heads), check_int("head_dim", head_dim)
        self.kernels = pick_kernels(kernels, device)  # "triton": store_kv/decode_attention/flash_attention; "torch": their _refs
        shape = (batch, n_kv_heads, max_len, head_dim)  # (B, H_KV, S_max, D)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)  # (B,) positions filled
        self.max_len = max_len

    @classmethod
    def for_model(cls, model, batch, max_len, kernels=None):
        c = model.config
        return cls(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, model.dtype, model.device, kernels)

    def sequence(self, b: int) -> "KVCache":
        """A view of sequence b alone (batch 1) sharing this cache's buffers and lengths."""
        B = self.seq_lens.shape[0]
        if check_int("b", b, minimum=0) >= B:
            raise ValueError(f"b must be a sequence index in 0..{B - 1}, got {b}")
        view = object.__new__(type(self))
        shared = {name for cls in type(self).__mro__ for name in getattr(cls, "shared_attrs", ())}
        for name, value in vars(self).items():  # basic slicing gives views: writes land in our buffers
            if name in shared:  # the same for every sequence (model constants): not sliced
                pass
            elif isinstance(value, list):  # per-layer buffers (B, ...)
                value = [t[b: b + 1] for t in value]
            elif isinstance(value, torch.Tensor):  # the lengths: advancing the view advances ours
                value = value[b: b + 1]
            setattr(view, name, value)
        return view

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def bytes_per_token(self) -> int:
        """Bytes one cached position takes across all layers, K and V (and scales, where a subclass has
        them): ``nbytes()`` over the capacity, batch x max_len."""
        return self.nbytes() // (self.seq_lens.shape[0] * self.max_len)

    def held(self, b: int) -> int:
        """Positions stored for sequence b."""
        return int(self.seq_lens[check_int("b", b, minimum=0)])

    def truncate(self, b: int, length: int) -> bool:
        """Cut sequence b back to its first ``length`` positions (chapter 11: rewind rejected draft tokens).

        Here only the length changes: the rows past it are dead and the next call overwrites them, so the
        cache is then bitwise the cache that never saw the cut tokens. Returns True: the rollback is exact
        (``BudgetCache.truncate`` may return False). A ValueError names ``b`` or ``length`` when b is not a
        sequence or length is past what b holds; nothing changes then.

        >>> cache = KVCache(n_layers=1, batch=1, n_kv_heads=1, max_len=8, head_dim=4)
        >>> _ = cache.attend(0, *(torch.ones(1, 1, 5, 4) for _ in range(3)))  # 5 tokens in one call
        >>> cache.truncate(0, 3), cache.held(0), cache.next_positions().tolist()  # keep 3: the next goes at 3
        (True, 3, [[3]])
        >>> cache.truncate(0, 4)
        Traceback (most recent call last):
        ...
        ValueError: length must lie in 0..3 (what sequence 0 holds), got 4
        """
        if type(self)._stored is not KVCache._stored and type(self).truncate is KVCache.truncate:
            raise NotImplementedError(f"{type(self).__name__} rewrites stored rows after each call (_stored): "
                                      "cutting its lengths alone would not undo that, so it cannot truncate")
        b, length = self._check_truncate(b, length)
        self.seq_lens[b] = length
        return True

    def _check_truncate(self, b, length) -> tuple[int, int]:
        """(b, length) as ints, or a ValueError naming the argument (b a sequence, length <= what b holds)."""
        B = self.seq_lens.shape[0]
        if check_int("b", b, minimum=0) >= B:
            raise ValueError(f"b must be a sequence index in 0..{B - 1}, got {b}")
        held = int(self.seq_lens[b])
        if check_int("length", length, minimum=0) > held:
            raise ValueError(f"length must lie in 0..{held} (what sequence {b} holds), got {length}")
        return int(b), int(length)

    # The four calls kvlib.generate.generate makes on any cache:
    def reset(self, batch: int | None = None, length: int | None = None):
        """Empty the cache (every length back to 0; the buffers are kept and overwritten later).

        With ``batch`` / ``length``, first check that ``batch`` sequences of up to ``length``
        positions fit; if not, raise (ValueError / CacheFullError) and change nothing.
        """
        B = self.seq_lens.shape[0]
        if batch is not None and batch != B:
            raise ValueError(f"the cache holds batch={B} sequence(s), got {batch} prompt(s): build it with batch={batch}")
        if length is not None and length > self.max_len:
            raise CacheFullError(f"the cache holds {self.max_len} positions per sequence; this call needs {length}")
        self.seq_lens.zero_()

    def prefill_view(self, b: int, prompt):
        """(the seam object for prefilling sequence b, how many prompt positions are cached already)."""
        return self.sequence(b), 0

    def decode_view(self, tokens):
        """The seam object for one decode step of every sequence (``tokens``: the B new ids)."""
        return self

    def next_positions(self) -> torch.Tensor:
        """(B, 1) position of each sequence's next token."""
        return self.seq_lens.long()[:, None]

    def _make_room(self, T: int) -> int:
        """Check that T more tokens fit (before anything is written, so a refusal leaves the cache
        intact); return the common length L after appending them when T > 1 (prefill)."""
        longest = int(self.seq_lens.max())
        if longest + T > self.max_len:
            raise CacheFullError(f"the cache holds {self.max_len} positions per sequence; appending {T} "
                                 f"token(s) to a sequence of {longest} would overflow it")
        if T > 1 and int(self.seq_lens.min()) != longest:
            raise ValueError("a multi-token call must extend sequences of equal length; "
                             "prefill ragged prompts one at a time with cache.sequence(b)")
        return longest + T

    def _advance(self, layer_idx: int, T: int):
        if layer_idx == len(self.k) - 1:  # after the last layer these T tokens are part of the past
            self.seq_lens += T

    def _check_attend(self, layer_idx, q, k, v, kv_dtype):
        """Raise a clear error unless layer_idx and q, k, v fit this cache (kv_dtype: k/v's required dtype)."""
        B, H_KV, _, D = self.k[0].shape
        check_attend_args(layer_idx, q, k, v, n_layers=len(self.k), batch=B, n_kv_heads=H_KV, head_dim=D,
                          kv_dtype=kv_dtype, batch_is=f"the cache holds B={B} sequence(s)")

    def attend(self, layer_idx, q, k, v):
        """q (B, H, T, D), k/v (B, H_KV, T, D) for the new tokens -> attention output (B, H, T, D)."""
        self._check_attend(layer_idx, q, k, v, self.k[0].dtype)
        T, start = q.shape[2], self.seq_lens
        L = self._make_room(T)
        triton_kernels = self.kernels == "triton"
        k_cache, v_cache = self._buffers(layer_idx)
        if self._stores(layer_idx):
            (store_kv if triton_kernels else store_kv_ref)(k_cache, v_cache, k, v, start)
        self._stored(layer_idx, start, T)
        if T == 1:  # decode: one new token per sequence, ragged lengths
            decode = decode_attention if triton_kernels else decode_attention_ref
            out = decode(q[:, :, 0], k_cache, v_cache, start + 1)[:, :, None]  # (B, H, 1, D)
        else:  # prefill (or several tokens at once): causal attention over past + new
            prefill = flash_attention if triton_kernels else attention_ref
            out = prefill(q, k_cache[:, :, :L], v_cache[:, :, :L], causal=True)  # (B, H, T, D)
        self._advance(layer_idx, T)
        return out

    def _buffers(self, layer_idx):
        """The (k, v) buffers layer ``layer_idx`` stores into and attends over (CrossLayerKVCache: its group's)."""
        return self.k[layer_idx], self.v[layer_idx]

    def _stores(self, layer_idx) -> bool:
        """Whether layer ``layer_idx`` writes its new K/V (CrossLayerKVCache: only a group's first layer)."""
        return True

    def _stored(self, layer_idx, start, T):
        """Hook between storing T new rows per sequence (at positions start[b]..) and attending: a subclass
        may rewrite what was stored (LayerQuantCache quantizes the key groups the call completed)."""


# How kvlib.course.compile_check builds these kernels: the wrappers' own launches at a realistic shape (32 query
# heads over 8 K/V heads, D = 128, a 1024-position cache holding two ragged sequences), with the tiles the
# wrappers pick for each GPU.
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _compile_inputs(dtype="fp16", B=2, H=32, H_KV=8, S_max=1024, D=128):
    """q, k, v, seq_lens on the CPU at a realistic shape: two ragged sequences in a 1024-position cache
    (dtype: a torch dtype or its short name). Also the grouped, paged and int8 decodes' specs use it."""
    dtype = _DTYPES.get(dtype, dtype)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    k, v = (torch.randn(B, H_KV, S_max, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v, torch.tensor([S_max - 24, S_max // 2 + 5][:B] + [S_max] * max(0, B - 2), dtype=torch.int32)


def _decode_loop(a):
    """What one program of _decode_kernel reads per step: a K and a V tile, which each of the n_rep query
    heads of a group reads again."""
    return dict(bytes=2 * a["TILE_N"] * a["TILE_D"] * a["k_ptr"].element_size(), reread=a["n_rep"])


def _store_launch(T):
    _, k, v, lens = _compile_inputs(torch.float16)
    new = torch.zeros(k.shape[0], k.shape[1], T, k.shape[3], dtype=k.dtype)
    store_kv(k, v, new, new, lens - T)


COMPILE_SPECS = [
    *(dict(name=f"decode fp16 {H}/{H_KV} splits={n}", launch=lambda H=H, H_KV=H_KV, n=n: decode_attention(
        *_compile_inputs(H=H, H_KV=H_KV), num_splits=n), loops={"_decode_kernel": _decode_loop})
      for H, H_KV, n in ((32, 8, 1), (32, 8, 8), (64, 8, 1), (32, 32, 1))),
    *(dict(name=f"decode {dt} 32/8", launch=lambda dt=dt: decode_attention(
        *_compile_inputs(dt), num_splits=1), archs=archs, loops={"_decode_kernel": _decode_loop})
      for dt, archs in (("bf16", (80, 90)), ("fp32", (75, 80, 90)))),
    dict(name="store 1 token", launch=lambda: _store_launch(1)),
    dict(name="store 512 tokens", launch=lambda: _store_launch(512)),
    dict(name="store 37 tokens", launch=lambda: _store_launch(37)),  # a size the JIT does not see as 16-divisible
]
