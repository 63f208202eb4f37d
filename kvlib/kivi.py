"""KIVI (chapter 09): a KV cache in 2 or 4 bits, keys per channel, values per token, the newest tokens exact.

KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv:2402.02750):
keys have outlier *channels* (a few dims are large for every token) and values do not, so keys are
quantized per channel over a group of ``group`` consecutive tokens, values per token. A key group can
only be quantized once all its tokens exist, so the newest tokens (up to ``residual``) stay in full
precision — which also keeps the tokens attention usually weighs most exact.

What you will learn:
- packing: four 2-bit codes per byte (``kvlib.lowbit.pack_bits``). The decode kernel loads a byte, shifts
  and masks out each code and dequantizes it in registers (``_kivi_decode_kernel``), then attends over the
  residual, with one online softmax across both parts;
- what a format really costs: scales and zero points are memory too (``KiviCache.bytes_per_token``).

Shapes: B batch, H query heads, H_KV key/value heads, T new tokens, S cached length, D head dim.
Packed codes (B, H_KV, S_q, D * bits / 8) uint8; key scales / zeros (B, H_KV, S_q / group, D); value
scales / zeros (B, H_KV, S_q); the full-precision residual (B, H_KV, R, D).
"""

from __future__ import annotations

import math

import torch

from . import runtime
from ._triton import check_kernel_dtype, tl, triton
from .attention import attention_ref, flash_attention
from .cache import KVCache, check_int, decode_attention_ref
from .lowbit import (_check_bits, dequantize_asym, pack_bits, quantize_keys_per_channel,
                     quantize_values_per_token, unpack_bits)

__all__ = ["kivi_decode_attention_ref", "kivi_decode_attention", "KiviCache"]

def _dequantize_kivi(k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, n, group, bits, dtype):
    """The first n (a multiple of group) quantized positions as (B, H_KV, n, D) keys and values."""
    keys = dequantize_asym(unpack_bits(k_packed[:, :, :n], bits),
                           k_scale[:, :, :n // group].repeat_interleave(group, dim=2),  # a group's row serves its tokens
                           k_zero[:, :, :n // group].repeat_interleave(group, dim=2), dtype)
    values = dequantize_asym(unpack_bits(v_packed[:, :, :n], bits), v_scale[:, :, :n, None], v_zero[:, :, :n, None],
                             dtype)
    return keys, values


# --------------------------------------------------------------------------------------------
# KIVI decode attention: checks, reference, kernel, wrapper
# --------------------------------------------------------------------------------------------


def _check_kivi_args(q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, n_quant, k_res, v_res, n_res,
                     group, bits):
    """Every check both KIVI decode functions make; returns v_scale, v_zero as (B, H_KV, S_q) and n_quant, n_res
    as lists (read on the host once)."""
    bits, group = _check_bits(bits), check_int("group", group)
    given = dict(q=q, k_packed=k_packed, k_scale=k_scale, k_zero=k_zero, v_packed=v_packed, v_scale=v_scale,
                 v_zero=v_zero, n_quant=n_quant, k_res=k_res, v_res=v_res, n_res=n_res)
    for name, t in given.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or q.numel() == 0:
        raise ValueError(f"q must be a non-empty (B, H, D) tensor (one decode token), got shape {tuple(q.shape)}")
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating-point tensor, got {q.dtype}")
    B, H, D = q.shape
    per = 8 // bits
    if D % per:
        raise ValueError(f"head dim D={D} must be a multiple of {per} to pack {per} {bits}-bit codes per byte")
    for name, t in (("k_packed", k_packed), ("v_packed", v_packed)):
        if t.dtype != torch.uint8:
            raise TypeError(f"{name} must be torch.uint8 ({per} {bits}-bit codes per byte, from pack_bits), "
                            f"got {t.dtype}")
        if t.dim() != 4 or t.shape[0] != B or t.shape[3] != D // per:
            raise ValueError(f"{name} must be (B={B}, H_KV, S_q, D * bits / 8 = {D // per}) for q of shape "
                             f"{tuple(q.shape)} and bits={bits}, got {tuple(t.shape)}")
    if v_packed.shape != k_packed.shape:
        raise ValueError(f"v_packed must have k_packed's shape {tuple(k_packed.shape)}, got {tuple(v_packed.shape)}")
    H_KV, S_q = k_packed.shape[1], k_packed.shape[2]
    if H_KV < 1 or H % H_KV:
        raise ValueError(f"k_packed has H_KV={H_KV} heads, which must divide q's H={H} heads")
    if S_q % group:
        raise ValueError(f"k_packed holds S_q={S_q} positions, which must be a multiple of group={group}")
    scales = {}
    per_group, per_token = (B, H_KV, S_q // group, D), (B, H_KV, S_q)
    for name, t, want in (("k_scale", k_scale, per_group), ("k_zero", k_zero, per_group),
                          ("v_scale", v_scale, per_token), ("v_zero", v_zero, per_token)):
        if name.startswith("v") and t.dim() == 4 and t.shape[3] == 1:
            t = t[..., 0]  # quantize_values_per_token keeps the reduced dim
        if tuple(t.shape) != want:
            what = "one per (group of tokens, channel)" if want == per_group else "one per token (or with a trailing 1)"
            raise ValueError(f"{name} must be of shape {want}, {what}, got {tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.float32):
            raise TypeError(f"{name} must be fp16 or fp32, got {t.dtype}")
        scales[name] = t
    for name, t in (("k_res", k_res), ("v_res", v_res)):
        if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (B, H_KV, D):
            raise ValueError(f"{name} must be (B={B}, H_KV={H_KV}, R, D={D}), the full-precision residual, "
                             f"got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must be q's dtype {q.dtype}, got {t.dtype}")
    if v_res.shape != k_res.shape:
        raise ValueError(f"v_res must have k_res's shape {tuple(k_res.shape)}, got {tuple(v_res.shape)}")
    for name, t in (("n_quant", n_quant), ("n_res", n_res)):
        if t.shape != (B,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a (B={B},) int32/int64 tensor, got {tuple(t.shape)} {t.dtype}")
    if len({t.device for t in given.values()}) != 1:
        raise ValueError(f"all of {', '.join(given)} must be on one device")
    nq, nr = torch.stack([n_quant.long(), n_res.long()]).tolist()  # one host read
    if any(n % group or not 0 <= n <= S_q for n in nq):
        raise ValueError(f"n_quant must be multiples of group={group} in 0..S_q={S_q}, got {nq}")
    if any(not 0 <= n <= k_res.shape[2] for n in nr):
        raise ValueError(f"n_res must lie in 0..R={k_res.shape[2]}, got {nr}")
    if any(a + b < 1 for a, b in zip(nq, nr)):
        raise ValueError(f"every sequence needs at least one cached position, got n_quant={nq}, n_res={nr}")
    return scales["v_scale"], scales["v_zero"], nq, nr


def kivi_decode_attention_ref(q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, n_quant, k_res, v_res,
                              n_res, group, bits=2):
    """Dequantize each sequence's first n_quant[b] positions, append its n_res[b] residual rows, attend (fp32).

    q (B, H, D); k_packed, v_packed (B, H_KV, S_q, D * bits / 8) uint8; k_scale, k_zero (B, H_KV, S_q / group,
    D); v_scale, v_zero (B, H_KV, S_q) (or with a trailing 1); k_res, v_res (B, H_KV, R, D) in q's dtype;
    n_quant, n_res (B,) int. Returns (B, H, D) in q's dtype.

    >>> from kvlib.lowbit import pack_2bit
    >>> g = torch.Generator().manual_seed(0)
    >>> k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(2))  # (B, H_KV, S, D): 32 + 8 tokens
    >>> kq, ks, kz = quantize_keys_per_channel(k[:, :, :32], group=16)  # 2 groups of 16 tokens
    >>> vq, vs, vz = quantize_values_per_token(v[:, :, :32])
    >>> q = torch.randn(1, 4, 16, generator=g)  # (B, H, D): 4 query heads, 2 K/V heads
    >>> out = kivi_decode_attention_ref(q, pack_2bit(kq), ks, kz, pack_2bit(vq), vs, vz, torch.tensor([32]),
    ...                                 k[:, :, 32:], v[:, :, 32:], torch.tensor([8]), group=16)
    >>> full = decode_attention_ref(q, k, v, torch.tensor([40]))
    >>> out.shape, bool((out - full).abs().max() < 0.5)  # 2-bit: close, not equal
    (torch.Size([1, 4, 16]), True)
    """
    v_scale, v_zero, n_quant, n_res = _check_kivi_args(q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero,
                                                       n_quant, k_res, v_res, n_res, group, bits)
    out = torch.empty_like(q)
    for b, (nq, nr) in enumerate(zip(n_quant, n_res)):  # ragged: each sequence has its own n_quant and n_res
        one = slice(b, b + 1)
        kq, vq = _dequantize_kivi(k_packed[one], k_scale[one], k_zero[one], v_packed[one], v_scale[one],
                                  v_zero[one], nq, group, bits, torch.float32)  # (1, H_KV, nq, D)
        k = torch.cat([kq, k_res[one, :, :nr].float()], dim=2)  # (1, H_KV, nq + nr, D): positions in order
        v = torch.cat([vq, v_res[one, :, :nr].float()], dim=2)
        lens = torch.tensor([nq + nr], device=q.device)
        out[b] = decode_attention_ref(q[one].float(), k, v, lens)[0]  # (H, D)
    return out


@triton.jit
def _kivi_decode_kernel(
    q_ptr,  # (B, H, D) the new query of each sequence, contiguous
    kq_ptr, vq_ptr,  # packed codes (B, H_KV, S_q, D // (8 // BITS)) uint8, contiguous
    ks_ptr, kz_ptr,  # key scale and zero (B, H_KV, S_q // group, D): per (group of tokens, channel)
    vs_ptr, vz_ptr,  # value scale and zero (B, H_KV, S_q): per token
    n_quant_ptr, n_res_ptr,  # (B,) quantized positions (a multiple of group) and residual positions
    kr_ptr, vr_ptr,  # full-precision residual (B, H_KV, R, D), contiguous: row j holds position n_quant + j
    o_ptr,  # output (B, H, D) in q's dtype
    H_KV, S_q, R, D,  # K/V heads, quantized capacity (positions), residual capacity (positions), head dim
    n_rep, group,  # query heads per K/V head (H // H_KV), tokens per key group
    qk_scale,  # 1/sqrt(D) * log2(e)
    BITS: tl.constexpr,  # bits per code: 2 (4 codes per byte), 4 (2 per byte) or 8
    TILE_N: tl.constexpr,  # positions per inner step; divides group, so a tile lies inside one key group
    TILE_D: tl.constexpr,  # head dim padded to a power of two
):
    pid = tl.program_id(0).to(tl.int64)  # one program per (sequence, query head); 64-bit offsets below
    b = pid // (H_KV * n_rep)
    kv_row = b * H_KV + (pid % (H_KV * n_rep)) // n_rep  # the (sequence, K/V head) query head h reads: h // n_rep
    dims = tl.arange(0, TILE_D)
    dim_ok = dims < D
    byte = dims // (8 // BITS)  # 2 bits: code d is in byte d // 4 ...
    shift = (dims % (8 // BITS)) * BITS  # ... at bits 2 * (d % 4), 2 * (d % 4) + 1
    row_bytes = D // (8 // BITS)
    q = tl.load(q_ptr + pid * D + dims, mask=dim_ok, other=0.0).to(tl.float32)  # (TILE_D,)
    n_quant = tl.load(n_quant_ptr + b)
    n_res = tl.load(n_res_ptr + b)
    m_i = -1.0e30  # running max (log2 units)
    l_i = 0.0  # running sum of exp2(score - m_i)
    acc = tl.zeros((TILE_D,), dtype=tl.float32)

    # 1) positions 0 .. n_quant - 1: unpack the codes and dequantize them in registers
    for pos0 in range(0, n_quant, TILE_N):
        pos = pos0 + tl.arange(0, TILE_N)  # (TILE_N,)
        pos_ok = pos < n_quant
        mask = pos_ok[:, None] & dim_ok[None, :]
        rows = kv_row * S_q + pos  # (TILE_N,) cache rows
        codes = tl.load(kq_ptr + rows[:, None] * row_bytes + byte[None, :], mask=mask, other=0).to(tl.int32)
        codes = (codes >> shift[None, :]) & ((1 << BITS) - 1)  # (TILE_N, TILE_D) in 0 .. 2**BITS - 1
        grp = kv_row * (S_q // group) + pos0 // group  # this tile's key group: one scale and zero per channel
        k_scale = tl.load(ks_ptr + grp * D + dims, mask=dim_ok, other=0.0).to(tl.float32)  # (TILE_D,)
        k_zero = tl.load(kz_ptr + grp * D + dims, mask=dim_ok, other=0.0).to(tl.float32)
        k = codes.to(tl.float32) * k_scale[None, :] + k_zero[None, :]  # (TILE_N, TILE_D)
        s = tl.sum(k * q[None, :], axis=1) * qk_scale  # (TILE_N,)
        s = tl.where(pos_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)  # (TILE_N,)
        codes = tl.load(vq_ptr + rows[:, None] * row_bytes + byte[None, :], mask=mask, other=0).to(tl.int32)
        codes = (codes >> shift[None, :]) & ((1 << BITS) - 1)
        v_scale = tl.load(vs_ptr + rows, mask=pos_ok, other=0.0).to(tl.float32)  # (TILE_N,): one per token
        v_zero = tl.load(vz_ptr + rows, mask=pos_ok, other=0.0).to(tl.float32)
        v = codes.to(tl.float32) * v_scale[:, None] + v_zero[:, None]  # (TILE_N, TILE_D)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new

    # 2) positions n_quant .. n_quant + n_res - 1: the residual, read as it is (the same online softmax)
    for pos0 in range(0, n_res, TILE_N):
        pos = pos0 + tl.arange(0, TILE_N)
        pos_ok = pos < n_res
        mask = pos_ok[:, None] & dim_ok[None, :]
        rows = kv_row * R + pos
        k = tl.load(kr_ptr + rows[:, None] * D + dims[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * qk_scale
        s = tl.where(pos_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        v = tl.load(vr_ptr + rows[:, None] * D + dims[None, :], mask=mask, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new

    out = acc / l_i  # l_i > 0: the wrapper checked n_quant + n_res >= 1
    tl.store(o_ptr + pid * D + dims, out.to(o_ptr.dtype.element_ty), mask=dim_ok)


def _tile_n(group: int, TILE_D: int) -> int:
    """Positions per inner step: the largest power of two that divides ``group`` (so a tile never straddles
    two key groups), at most 4096 // TILE_D elements' worth on a GPU (64 positions in the interpreter)."""
    cap = 64 if runtime.INTERPRETER else max(16, 4096 // TILE_D)
    return min(group & -group, cap)


def kivi_decode_attention(q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, n_quant, k_res, v_res, n_res,
                          group, bits=2):
    """Decode attention over a KIVI cache with the Triton kernel; same arguments and result as the ref.

    One program per (sequence, query head) unpacks and dequantizes the packed codes in registers, then
    reads the full-precision residual, with one online softmax over both. q and the residual: fp32,
    fp16 or bf16; scales and zeros fp16 or fp32 (the cache stores fp16).

    >>> from kvlib.lowbit import pack_2bit
    >>> from kvlib.runtime import DEVICE
    >>> g = torch.Generator().manual_seed(0)
    >>> k, v = (torch.randn(1, 2, 40, 16, generator=g).to(DEVICE) for _ in range(2))  # 32 quantized + 8 residual
    >>> kq, ks, kz = quantize_keys_per_channel(k[:, :, :32], group=16)
    >>> vq, vs, vz = quantize_values_per_token(v[:, :, :32])
    >>> q = torch.randn(1, 4, 16, generator=g).to(DEVICE)
    >>> args = (q, pack_2bit(kq), ks.half(), kz.half(), pack_2bit(vq), vs.half(), vz.half(),
    ...         torch.tensor([32], device=DEVICE), k[:, :, 32:], v[:, :, 32:], torch.tensor([8], device=DEVICE), 16)
    >>> torch.allclose(kivi_decode_attention(*args), kivi_decode_attention_ref(*args), atol=1e-5)
    True
    """
    v_scale, v_zero, _, _ = _check_kivi_args(q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, n_quant, k_res,
                                             v_res, n_res, group, bits)
    check_kernel_dtype("lowbit.kivi_decode_attention", "q", q)
    if not runtime.require_triton("lowbit.kivi_decode_attention", q=q, k_packed=k_packed, k_scale=k_scale,
                                  k_zero=k_zero, v_packed=v_packed, v_scale=v_scale, v_zero=v_zero, n_quant=n_quant,
                                  k_res=k_res, v_res=v_res, n_res=n_res):
        return kivi_decode_attention_ref(q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, n_quant, k_res,
                                         v_res, n_res, group, bits)
    B, H, D = q.shape
    H_KV, S_q, R = k_packed.shape[1], k_packed.shape[2], k_res.shape[2]

    def arg(t):  # contiguous, and never an empty buffer (a cache may hold no quantized positions yet)
        return t.contiguous() if t.numel() else torch.zeros(1, dtype=t.dtype, device=t.device)

    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    TILE_D = max(16, triton.next_power_of_2(D))
    _kivi_decode_kernel[(B * H,)](
        arg(q), arg(k_packed), arg(v_packed), arg(k_scale), arg(k_zero), arg(v_scale), arg(v_zero),
        arg(n_quant), arg(n_res), arg(k_res), arg(v_res), out,
        H_KV, S_q, R, D, H // H_KV, group, (1.0 / math.sqrt(D)) * 1.4426950408889634,
        BITS=bits, TILE_N=_tile_n(group, TILE_D), TILE_D=TILE_D,
    )
    return out


# --------------------------------------------------------------------------------------------
# The KIVI cache
# --------------------------------------------------------------------------------------------


class KiviCache(KVCache):
    """KIVI: keys per channel over groups of ``group`` tokens, values per token, in ``bits`` bits (packed,
    8 // bits codes per byte, fp16 scale + zero), and the newest tokens (up to ``residual``) in full precision.

    The rule: a sequence holding n positions keeps its first ``n_quant(n) = group * ceil(max(0, n -
    residual) / group)`` quantized and the other ``n - n_quant(n)`` (at most ``residual``) as they came.
    Appending one token to a full residual therefore first quantizes its *oldest group* of tokens into the
    packed part (with residual == group, KIVI's key rule: the whole residual; with residual > group, at
    least residual - group + 1 newest tokens stay exact — a KIVI-style sliding window, at group granularity).
    The layout depends only on n, so a prompt prefilled at once is stored as if fed token by token.
    KIVI's own code (github.com/jy-yuan/KIVI, models/llama_kivi.py) differs in details: it quantizes all
    ``residual`` keys at once when they fill up (here the oldest group: the same when residual == group);
    its values slide one token at a time (here with the keys, a group at a time); its value scales are per
    group of ``group`` channels (here one per token and head, over all D); its prefill attends in full
    precision (here over what the cache holds, as Int8KVCache does).

    ``residual`` must be a multiple of ``group``; bits 2 (4 codes per byte), 4 (2 per byte) or 8.
    Buffers: ``k_packed``/``v_packed`` (B, H_KV, S_q, D * bits / 8) uint8, ``k_scale``/``k_zero`` (B, H_KV,
    S_q / group, D) fp16, ``v_scale``/``v_zero`` (B, H_KV, S_q) fp16, with S_q = n_quant(max_len); ``k``/``v``
    (KVCache's buffers, sized R = ``residual``) are the full-precision residual (B, H_KV, R, D): row j holds
    position n_quant + j. Decode goes through ``kivi_decode_attention`` (the kernel when ``kernels`` is
    "triton", else its reference); prefill attends over the dequantized part + residual, so the model sees
    exactly what the cache holds. With residual >= every sequence's length nothing is quantized and the
    cache computes what KVCache does.

    How close (a worst case, per query head and channel d): each stored element is within δ = step / 2 +
    2^-11 (qmax * step + |zero|) of the original (half a step, plus the fp16 rounding of scale and zero), so
    every score q . k_j / sqrt(D) moves by at most ε = max_j Σ_d |q_d| δk_jd / sqrt(D), the attention weights
    by at most tanh(ε / 2) in total variation, and |out_d - exact_d| <= max_j δv_jd + tanh(ε / 2) (max_j v_jd
    - min_j v_jd). Exact positions (the residual) have δ = 0; on random data the real error is several times
    smaller than this bound (tests/test_lowbit.py checks it holds).

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = KiviCache.for_model(model, batch=1, max_len=24, bits=2, group=4, residual=8)
    >>> with torch.no_grad():
    ...     logits = model(torch.arange(11)[None], cache=cache)  # 11 positions: 4 quantized, 7 exact
    ...     logits = model(torch.tensor([[3]]), positions=cache.next_positions(), cache=cache)
    >>> cache.seq_lens.tolist(), cache.n_quantized(0), tuple(cache.k_packed[0].shape)  # (B, H_KV, S_q, D / 4)
    ([12], 4, (1, 2, 16, 4))
    """

    def __init__(self, n_layers, batch, n_kv_heads, max_len, head_dim, bits=2, group=32, residual=32,
                 dtype=torch.float32, device="cpu", kernels=None):
        bits, group, residual = _check_bits(bits), check_int("group", group), check_int("residual", residual)
        if residual % group:
            raise ValueError(f"residual={residual} must be a multiple of group={group}: the residual is flushed "
                             "into the quantized part one whole group of tokens at a time")
        if check_int("head_dim", head_dim) % (8 // bits):
            raise ValueError(f"head_dim={head_dim} must be a multiple of {8 // bits} to pack {8 // bits} "
                             f"{bits}-bit codes per byte")
        super().__init__(n_layers, batch, n_kv_heads, residual, head_dim, dtype, device, kernels)  # the residual
        self.max_len = check_int("max_len", max_len)
        self.bits, self.group, self.residual = bits, group, residual
        S_q = self._n_quant(self.max_len)  # quantized capacity: whole groups
        B, H_KV, D = batch, n_kv_heads, head_dim

        def buffers(shape, dtype, fill):
            return [torch.full(shape, fill, dtype=dtype, device=device) for _ in range(n_layers)]

        self.k_packed = buffers((B, H_KV, S_q, D * bits // 8), torch.uint8, 0)
        self.v_packed = buffers((B, H_KV, S_q, D * bits // 8), torch.uint8, 0)
        self.k_scale = buffers((B, H_KV, S_q // group, D), torch.float16, 1)  # per (group, channel)
        self.k_zero = buffers((B, H_KV, S_q // group, D), torch.float16, 0)
        self.v_scale = buffers((B, H_KV, S_q), torch.float16, 1)  # per token
        self.v_zero = buffers((B, H_KV, S_q), torch.float16, 0)

    @classmethod
    def for_model(cls, model, batch, max_len, bits=2, group=32, residual=32, kernels=None):
        c = model.config
        return cls(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, bits, group, residual, model.dtype,
                   model.device, kernels)

    def _n_quant(self, n):
        """Positions held quantized when a sequence holds n (an int or a tensor of them): the fewest whole
        groups that leave at most ``residual`` positions in full precision."""
        over = n - self.residual
        over = over.clamp(min=0) if isinstance(over, torch.Tensor) else max(0, over)
        return (over + self.group - 1) // self.group * self.group

    def n_quantized(self, b: int) -> int:
        """How many of sequence b's positions (the oldest) are held in low bits; the rest are exact."""
        return int(self._n_quant(int(self.seq_lens[b])))

    def nbytes(self) -> int:
        """Bytes of every buffer: packed codes, scales, zeros and the full-precision residual."""
        return sum(t.nbytes for t in self.k + self.v + self.k_packed + self.v_packed + self.k_scale + self.k_zero
                   + self.v_scale + self.v_zero)

    def bytes_per_token(self) -> float:
        """Steady-state bytes per cached token for the whole model (the residual's fixed R tokens aside).

        Per layer and K/V head: keys D * bits / 8 code bytes + an fp16 scale and zero per channel, shared by
        the ``group`` tokens of a group (4 D / group); values D * bits / 8 + an fp16 scale and zero (4).

        >>> KiviCache(n_layers=4, batch=1, n_kv_heads=8, max_len=64, head_dim=32).bytes_per_token()  # 4*8*(8+4 + 8+4)
        768.0
        """
        n_layers, (_, H_KV, _, D) = len(self.k), self.k[0].shape
        codes = D * self.bits / 8
        return n_layers * H_KV * ((codes + 4 * D / self.group) + (codes + 4))

    def _store(self, layer_idx, k, v):
        """Append k, v (B, H_KV, T, D) after each sequence's positions; the whole groups that no longer fit
        in the residual are quantized into the packed part first (the rule in the class docstring)."""
        T, G = k.shape[2], self.group
        k_res, v_res = self.k[layer_idx], self.v[layer_idx]
        for b, n in enumerate(self.seq_lens.tolist()):
            start, end = self._n_quant(n), self._n_quant(n + T)  # quantized positions before and after
            r = n - start  # residual rows in use
            if end == start:  # nothing to flush: append to the residual
                k_res[b, :, r: r + T], v_res[b, :, r: r + T] = k[b], v[b]
                continue
            tail_k = torch.cat([k_res[b, :, :r], k[b]], dim=1)  # (H_KV, r + T, D): positions start .. n + T - 1
            tail_v = torch.cat([v_res[b, :, :r], v[b]], dim=1)
            f = end - start  # the oldest f (whole groups) go to the packed part
            kq, ks, kz = quantize_keys_per_channel(tail_k[None, :, :f], G, self.bits)  # (1, H_KV, f // G, D) scales
            vq, vs, vz = quantize_values_per_token(tail_v[None, :, :f], self.bits)  # (1, H_KV, f, 1) scales
            self.k_packed[layer_idx][b, :, start:end] = pack_bits(kq[0], self.bits)
            self.k_scale[layer_idx][b, :, start // G: end // G] = ks[0]
            self.k_zero[layer_idx][b, :, start // G: end // G] = kz[0]
            self.v_packed[layer_idx][b, :, start:end] = pack_bits(vq[0], self.bits)
            self.v_scale[layer_idx][b, :, start:end] = vs[0, :, :, 0]
            self.v_zero[layer_idx][b, :, start:end] = vz[0, :, :, 0]
            keep = r + T - f
            k_res[b, :, :keep], v_res[b, :, :keep] = tail_k[:, f:], tail_v[:, f:]

    def attend(self, layer_idx, q, k, v):
        """q (B, H, T, D), k/v (B, H_KV, T, D) for the new tokens -> attention output (B, H, T, D)."""
        self._check_attend(layer_idx, q, k, v, self.k[0].dtype)
        T = q.shape[2]
        L = self._make_room(T)  # refuses before anything is written
        self._store(layer_idx, k, v)
        packed = [t[layer_idx] for t in (self.k_packed, self.k_scale, self.k_zero, self.v_packed, self.v_scale,
                                         self.v_zero)]
        k_res, v_res = self.k[layer_idx], self.v[layer_idx]
        triton_kernels = self.kernels == "triton"
        if T == 1:  # decode: ragged lengths, each sequence with its own n_quant and n_res
            n = self.seq_lens + 1
            n_quant = self._n_quant(n)
            decode = kivi_decode_attention if triton_kernels else kivi_decode_attention_ref
            out = decode(q[:, :, 0], *packed, n_quant, k_res, v_res, n - n_quant, self.group,
                         self.bits)[:, :, None]  # (B, H, 1, D)
        else:  # prefill: every sequence holds L positions now
            nq = self._n_quant(L)
            k_q, v_q = _dequantize_kivi(*packed, nq, self.group, self.bits, q.dtype)  # (B, H_KV, nq, D)
            k_all = torch.cat([k_q, k_res[:, :, :L - nq]], dim=2)  # (B, H_KV, L, D)
            v_all = torch.cat([v_q, v_res[:, :, :L - nq]], dim=2)
            out = (flash_attention if triton_kernels else attention_ref)(q, k_all, v_all, causal=True)
        self._advance(layer_idx, T)
        return out


# How kvlib.compile_check builds the decode kernel: the wrapper's launch for 32 query heads over 8 K/V heads,
# D = 128, fp16 queries, residual and scales, KIVI's group of 32 tokens, 2-bit and 4-bit codes.
def _compile_launch(bits: int, group: int = 32):
    B, H, H_KV, S_q, R, D = 2, 32, 8, 1024, 32, 128
    codes = torch.zeros(B, H_KV, S_q, D // (8 // bits), dtype=torch.uint8)
    k_scale, k_zero = (torch.ones(B, H_KV, S_q // group, D, dtype=torch.float16) for _ in range(2))
    v_scale, v_zero = (torch.ones(B, H_KV, S_q, dtype=torch.float16) for _ in range(2))
    res = torch.zeros(B, H_KV, R, D, dtype=torch.float16)
    return kivi_decode_attention(torch.zeros(B, H, D, dtype=torch.float16), codes, k_scale, k_zero, codes.clone(),
                                 v_scale, v_zero, torch.tensor([S_q, 512]), res, res.clone(), torch.tensor([7, 32]),
                                 group, bits)


def _kivi_loop(a):
    """One step of the quantized loop: packed K and V codes, the key group's scale + zero per channel and the
    values' scale + zero per token; every query head of a group reads them again."""
    rows, d = a["TILE_N"], a["TILE_D"]
    codes = 2 * rows * d * a["BITS"] // 8
    return dict(bytes=codes + 2 * d * a["ks_ptr"].element_size() + 2 * rows * a["vs_ptr"].element_size(),
                reread=a["n_rep"], loop=0)


COMPILE_SPECS = [dict(name=f"KIVI {bits}-bit decode fp16 32/8", launch=lambda bits=bits: _compile_launch(bits),
                      loops={"_kivi_decode_kernel": _kivi_loop}) for bits in (2, 4)]
