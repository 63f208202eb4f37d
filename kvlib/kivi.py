"""KIVI (chapter 09): a KV cache in 2 or 4 bits, keys per channel, values per token, the newest tokens exact.

KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv:2402.02750):
keys have outlier *channels* (a few dims are large for every token) and values do not, so keys are
quantized per channel over a group of ``group`` consecutive tokens, values per token (over groups of
``v_group`` channels). A key group can only be quantized once all its tokens exist, so a window of the
newest tokens (``residual`` = R of them) stays in full precision — which also keeps the tokens attention
usually weighs most exact. The prompt is attended in full precision, over its own exact K/V, and only
then stored in low bits.

What you will learn:
- packing: four 2-bit codes per byte (``kvlib.lowbit.pack_bits``). The decode kernel loads a byte, shifts
  and masks out each code and dequantizes it in registers (``_kivi_decode_kernel``), then attends over the
  exact windows, with one online softmax across all of it;
- two windows that slide differently: keys leave theirs a group at a time, values one token at a time;
- what a format really costs: scales, zero points and the exact window are memory too
  (``KiviCache.bytes_per_token``, ``KiviCache.nbytes``).

Shapes: B batch, H query heads, H_KV key/value heads, T new tokens, S cached length, D head dim, G = group.
Keys: packed codes (B, H_KV, S_kq, D * bits / 8) uint8 (S_kq a multiple of G), scales / zeros (B, H_KV,
S_kq / G, D), the exact window (B, H_KV, R, D). Values: packed codes (B, H_KV, S_vq, D * bits / 8) uint8,
scales / zeros (B, H_KV, S_vq, D / v_group), the exact window (B, H_KV, R, D).
"""

from __future__ import annotations

import math

import torch

from . import runtime
from ._triton import check_kernel_dtype, tl, triton
from .attention import attention_ref, flash_attention
from .cache import KVCache, check_int, decode_attention_ref
from .evict import check_snapkv_options, snapkv_select
from .lowbit import _check_bits, dequantize_asym, pack_bits, quantize_asym, quantize_keys_per_channel, unpack_bits

__all__ = ["kivi_decode_attention_ref", "kivi_decode_attention", "KiviCache", "SnapKiviCache"]

PREFILL_MODES = ("exact", "quantized")
FLUSH_RULES = ("group", "residual")


def _quantize_values(v: torch.Tensor, bits: int, v_group: int):
    """KIVI's values: per token, one (scale, zero) per group of ``v_group`` consecutive channels.

    v (B, H_KV, S, D) -> (codes (B, H_KV, S, D) uint8, scale, zero (B, H_KV, S, D / v_group) fp32).
    ``quantize_values_per_token`` is the case v_group = D (with a trailing 1 instead of D / D)."""
    B, H_KV, S, D = v.shape
    q, scale, zero = quantize_asym(v.reshape(B, H_KV, S, D // v_group, v_group), bits, dim=-1)
    return q.reshape(B, H_KV, S, D), scale[..., 0], zero[..., 0]


def _dequantize_keys(k_packed, k_scale, k_zero, n, group, bits, dtype):
    """The first n (a multiple of group) quantized key positions as (B, H_KV, n, D)."""
    return dequantize_asym(unpack_bits(k_packed[:, :, :n], bits),
                           k_scale[:, :, :n // group].repeat_interleave(group, dim=2),  # a group's row serves its tokens
                           k_zero[:, :, :n // group].repeat_interleave(group, dim=2), dtype)


def _dequantize_values(v_packed, v_scale, v_zero, n, bits, dtype):
    """The first n quantized value positions as (B, H_KV, n, D); v_scale / v_zero (B, H_KV, S_vq, D / v_group)."""
    codes = unpack_bits(v_packed[:, :, :n], bits)  # (B, H_KV, n, D)
    B, H_KV, _, D = codes.shape
    n_groups = v_scale.shape[3]
    grouped = codes.reshape(B, H_KV, n, n_groups, D // n_groups)
    return dequantize_asym(grouped, v_scale[:, :, :n, :, None], v_zero[:, :, :n, :, None], dtype).reshape(B, H_KV, n, D)


# --------------------------------------------------------------------------------------------
# KIVI decode attention: checks, reference, kernel, wrapper
# --------------------------------------------------------------------------------------------


def _check_kivi_args(q, k_packed, k_scale, k_zero, n_kq, k_res, n_kr, v_packed, v_scale, v_zero, n_vq, v_res, n_vr,
                     group, bits):
    """Every check both KIVI decode functions make; returns the value group (D / v_scale.shape[3]) and the
    four per-sequence counts as lists (read on the host once)."""
    bits, group = _check_bits(bits), check_int("group", group)
    given = dict(q=q, k_packed=k_packed, k_scale=k_scale, k_zero=k_zero, n_kq=n_kq, k_res=k_res, n_kr=n_kr,
                 v_packed=v_packed, v_scale=v_scale, v_zero=v_zero, n_vq=n_vq, v_res=v_res, n_vr=n_vr)
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
            raise ValueError(f"{name} must be (B={B}, H_KV, S_{name[0]}q, D * bits / 8 = {D // per}) for q of shape "
                             f"{tuple(q.shape)} and bits={bits}, got {tuple(t.shape)}")
    H_KV, S_kq, S_vq = k_packed.shape[1], k_packed.shape[2], v_packed.shape[2]
    if H_KV < 1 or H % H_KV:
        raise ValueError(f"k_packed has H_KV={H_KV} heads, which must divide q's H={H} heads")
    if v_packed.shape[1] != H_KV:
        raise ValueError(f"v_packed must have k_packed's H_KV={H_KV} heads, got {tuple(v_packed.shape)}")
    if S_kq % group:
        raise ValueError(f"k_packed holds S_kq={S_kq} positions, which must be a multiple of group={group}")
    if v_scale.dim() != 4 or v_scale.shape[3] < 1 or D % v_scale.shape[3]:
        raise ValueError(f"v_scale must be (B={B}, H_KV={H_KV}, S_vq={S_vq}, D / v_group), one per (token, group of "
                         f"v_group channels) with v_group dividing D={D}, got {tuple(v_scale.shape)}")
    n_vgroups = v_scale.shape[3]
    per_group, per_token = (B, H_KV, S_kq // group, D), (B, H_KV, S_vq, n_vgroups)
    for name, t, want in (("k_scale", k_scale, per_group), ("k_zero", k_zero, per_group),
                          ("v_scale", v_scale, per_token), ("v_zero", v_zero, per_token)):
        if tuple(t.shape) != want:
            what = ("one per (group of tokens, channel)" if want == per_group else
                    "one per (token, group of v_group channels)")
            raise ValueError(f"{name} must be of shape {want}, {what}, got {tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.float32):
            raise TypeError(f"{name} must be fp16 or fp32, got {t.dtype}")
    for name, t in (("k_res", k_res), ("v_res", v_res)):
        if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (B, H_KV, D):
            raise ValueError(f"{name} must be (B={B}, H_KV={H_KV}, R, D={D}), the exact window, "
                             f"got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must be q's dtype {q.dtype}, got {t.dtype}")
    for name in ("n_kq", "n_kr", "n_vq", "n_vr"):
        t = given[name]
        if t.shape != (B,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a (B={B},) int32/int64 tensor, got {tuple(t.shape)} {t.dtype}")
    if len({t.device for t in given.values()}) != 1:
        raise ValueError(f"all of {', '.join(given)} must be on one device")
    kq, kr, vq, vr = torch.stack([n_kq.long(), n_kr.long(), n_vq.long(), n_vr.long()]).tolist()  # one host read
    if any(n % group or not 0 <= n <= S_kq for n in kq):
        raise ValueError(f"n_kq must be multiples of group={group} in 0..S_kq={S_kq}, got {kq}")
    if any(not 0 <= n <= S_vq for n in vq):
        raise ValueError(f"n_vq must lie in 0..S_vq={S_vq}, got {vq}")
    for name, ns, R in (("n_kr", kr, k_res.shape[2]), ("n_vr", vr, v_res.shape[2])):
        if any(not 0 <= n <= R for n in ns):
            raise ValueError(f"{name} must lie in 0..R={R} (the {name[2]} window's rows), got {ns}")
    if [a + b for a, b in zip(kq, kr)] != [a + b for a, b in zip(vq, vr)]:
        raise ValueError(f"keys and values must cover the same positions: n_kq + n_kr = "
                         f"{[a + b for a, b in zip(kq, kr)]}, n_vq + n_vr = {[a + b for a, b in zip(vq, vr)]}")
    if any(a + b < 1 for a, b in zip(kq, kr)):
        raise ValueError(f"every sequence needs at least one cached position, got n_kq={kq}, n_kr={kr}")
    return D // n_vgroups, kq, kr, vq, vr


def kivi_decode_attention_ref(q, k_packed, k_scale, k_zero, n_kq, k_res, n_kr, v_packed, v_scale, v_zero, n_vq,
                              v_res, n_vr, group, bits=2):
    """Sequence b's keys: its first n_kq[b] quantized positions then n_kr[b] exact rows; its values: n_vq[b]
    quantized then n_vr[b] exact (n_kq + n_kr = n_vq + n_vr positions, in order); attend (fp32).

    q (B, H, D); k_packed (B, H_KV, S_kq, D * bits / 8) uint8, k_scale, k_zero (B, H_KV, S_kq / group, D);
    v_packed (B, H_KV, S_vq, D * bits / 8) uint8, v_scale, v_zero (B, H_KV, S_vq, D / v_group); k_res
    (B, H_KV, R_k, D), v_res (B, H_KV, R_v, D) in q's dtype; n_kq (multiples of group), n_kr, n_vq, n_vr (B,)
    int. Returns (B, H, D) in q's dtype.

    >>> from kvlib.lowbit import pack_2bit
    >>> g = torch.Generator().manual_seed(0)
    >>> k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(2))  # (B, H_KV, S, D)
    >>> kq, ks, kz = quantize_keys_per_channel(k[:, :, :32], group=16)  # keys: 2 groups of 16 tokens + 8 exact
    >>> vq, vs, vz = _quantize_values(v[:, :, :35], bits=2, v_group=8)  # values: 35 tokens + 5 exact
    >>> q = torch.randn(1, 4, 16, generator=g)  # (B, H, D): 4 query heads, 2 K/V heads
    >>> n = lambda x: torch.tensor([x])
    >>> out = kivi_decode_attention_ref(q, pack_2bit(kq), ks, kz, n(32), k[:, :, 32:], n(8),
    ...                                 pack_2bit(vq), vs, vz, n(35), v[:, :, 35:], n(5), group=16)
    >>> full = decode_attention_ref(q, k, v, n(40))
    >>> out.shape, bool((out - full).abs().max() < 0.5)  # 2-bit: close, not equal
    (torch.Size([1, 4, 16]), True)
    """
    _, kq, kr, vq, vr = _check_kivi_args(q, k_packed, k_scale, k_zero, n_kq, k_res, n_kr, v_packed, v_scale, v_zero,
                                         n_vq, v_res, n_vr, group, bits)
    out = torch.empty_like(q)
    for b in range(q.shape[0]):  # ragged: each sequence has its own four counts
        one = slice(b, b + 1)
        k = torch.cat([_dequantize_keys(k_packed[one], k_scale[one], k_zero[one], kq[b], group, bits, torch.float32),
                       k_res[one, :, :kr[b]].float()], dim=2)  # (1, H_KV, n, D): positions in order
        v = torch.cat([_dequantize_values(v_packed[one], v_scale[one], v_zero[one], vq[b], bits, torch.float32),
                       v_res[one, :, :vr[b]].float()], dim=2)
        lens = torch.tensor([kq[b] + kr[b]], device=q.device)
        out[b] = decode_attention_ref(q[one].float(), k, v, lens)[0]  # (H, D)
    return out


@triton.jit
def _kivi_tile(
    acc, l_i, m_i,  # this program's running sums and maximum
    q,  # (TILE_D,) the query, fp32
    pos0, n_kq, n_vq, n,  # the tile's first position; quantized keys / values; positions in all
    kq_ptr, ks_ptr, kz_ptr, kr_ptr,  # keys: codes, scale, zero, exact window (already at this K/V head's rows)
    vq_ptr, vs_ptr, vz_ptr, vr_ptr,  # values: codes, scale, zero, exact window (likewise)
    group, D, dims, dim_ok, qk_scale,
    K_CODES: tl.constexpr,  # True: every key of the tile is quantized (and the tile lies in one key group)
    V_MODE: tl.constexpr,  # 0: every value quantized; 1: every value exact; 2: either, by position
    BITS: tl.constexpr, V_GROUP: tl.constexpr, TILE_N: tl.constexpr,
):
    """Fold positions pos0 .. pos0 + TILE_N - 1 (those < n) into (acc, l_i, m_i), each key and value read
    from its codes (dequantized in registers) or from its exact window."""
    pos = pos0 + tl.arange(0, TILE_N)  # (TILE_N,)
    pos_ok = pos < n
    byte = dims // (8 // BITS)  # 2 bits: code d is in byte d // 4 ...
    shift = (dims % (8 // BITS)) * BITS  # ... at bits 2 * (d % 4), 2 * (d % 4) + 1
    row_bytes = D // (8 // BITS)
    if K_CODES:
        mask = pos_ok[:, None] & dim_ok[None, :]
        codes = tl.load(kq_ptr + pos[:, None] * row_bytes + byte[None, :], mask=mask, other=0).to(tl.int32)
        codes = (codes >> shift[None, :]) & ((1 << BITS) - 1)  # (TILE_N, TILE_D) in 0 .. 2**BITS - 1
        grp = pos0 // group  # the tile's key group: one scale and zero per channel
        k_scale = tl.load(ks_ptr + grp * D + dims, mask=dim_ok, other=0.0).to(tl.float32)  # (TILE_D,)
        k_zero = tl.load(kz_ptr + grp * D + dims, mask=dim_ok, other=0.0).to(tl.float32)
        k = codes.to(tl.float32) * k_scale[None, :] + k_zero[None, :]  # (TILE_N, TILE_D)
    else:  # exact window row j holds position n_kq + j
        mask = (pos_ok & (pos >= n_kq))[:, None] & dim_ok[None, :]
        k = tl.load(kr_ptr + (pos - n_kq)[:, None] * D + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sum(k * q[None, :], axis=1) * qk_scale  # (TILE_N,)
    s = tl.where(pos_ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)  # (TILE_N,)
    if V_MODE != 1:  # codes, with a scale and zero per (token, group of V_GROUP channels)
        quant = pos_ok & (pos < n_vq)
        mask = quant[:, None] & dim_ok[None, :]
        codes = tl.load(vq_ptr + pos[:, None] * row_bytes + byte[None, :], mask=mask, other=0).to(tl.int32)
        codes = (codes >> shift[None, :]) & ((1 << BITS) - 1)
        sc = pos[:, None] * (D // V_GROUP) + (dims // V_GROUP)[None, :]  # (TILE_N, TILE_D) its (token, group)
        v_scale = tl.load(vs_ptr + sc, mask=mask, other=0.0).to(tl.float32)
        v_zero = tl.load(vz_ptr + sc, mask=mask, other=0.0).to(tl.float32)
        v = codes.to(tl.float32) * v_scale + v_zero  # (TILE_N, TILE_D)
    if V_MODE != 0:  # the exact window: row j holds position n_vq + j
        mask = (pos_ok & (pos >= n_vq))[:, None] & dim_ok[None, :]
        v_exact = tl.load(vr_ptr + (pos - n_vq)[:, None] * D + dims[None, :], mask=mask, other=0.0).to(tl.float32)
        if V_MODE == 1:
            v = v_exact
        else:
            v = tl.where((pos < n_vq)[:, None], v, v_exact)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
    return acc, l_i, m_new


@triton.jit
def _kivi_decode_kernel(
    q_ptr,  # (B, H, D) the new query of each sequence, contiguous
    kq_ptr, ks_ptr, kz_ptr,  # keys: codes (B, H_KV, S_kq, D // (8 // BITS)) uint8, scale / zero (B, H_KV, S_kq // group, D)
    kr_ptr,  # keys' exact window (B, H_KV, R_k, D): row j holds position n_kq + j
    vq_ptr, vs_ptr, vz_ptr,  # values: codes (B, H_KV, S_vq, D // (8 // BITS)) uint8, scale / zero (B, H_KV, S_vq, D // V_GROUP)
    vr_ptr,  # values' exact window (B, H_KV, R_v, D): row j holds position n_vq + j
    n_kq_ptr, n_kr_ptr, n_vq_ptr,  # (B,) quantized keys (a multiple of group), exact keys, quantized values
    o_ptr,  # output (B, H, D) in q's dtype
    H_KV, S_kq, S_vq, R_k, R_v, D,  # K/V heads, quantized capacities, window capacities (positions), head dim
    n_rep, group,  # query heads per K/V head (H // H_KV), tokens per key group
    qk_scale,  # 1/sqrt(D) * log2(e)
    BITS: tl.constexpr,  # bits per code: 2 (4 codes per byte), 4 (2 per byte) or 8
    V_GROUP: tl.constexpr,  # channels per value scale
    TILE_N: tl.constexpr,  # positions per inner step; divides group, so a key tile lies inside one key group
    TILE_D: tl.constexpr,  # head dim padded to a power of two
):
    pid = tl.program_id(0).to(tl.int64)  # one program per (sequence, query head); 64-bit offsets below
    b = pid // (H_KV * n_rep)
    kv_row = b * H_KV + (pid % (H_KV * n_rep)) // n_rep  # the (sequence, K/V head) query head h reads: h // n_rep
    dims = tl.arange(0, TILE_D)
    dim_ok = dims < D
    row_bytes = D // (8 // BITS)
    q = tl.load(q_ptr + pid * D + dims, mask=dim_ok, other=0.0).to(tl.float32)  # (TILE_D,)
    n_kq = tl.load(n_kq_ptr + b)
    n_vq = tl.load(n_vq_ptr + b)
    n = n_kq + tl.load(n_kr_ptr + b)  # positions of this sequence (= n_vq + n_vr, checked by the wrapper)
    kq_ptr += kv_row * S_kq * row_bytes  # this (sequence, K/V head)'s rows of every buffer
    ks_ptr += kv_row * (S_kq // group) * D
    kz_ptr += kv_row * (S_kq // group) * D
    kr_ptr += kv_row * R_k * D
    vq_ptr += kv_row * S_vq * row_bytes
    vs_ptr += kv_row * S_vq * (D // V_GROUP)
    vz_ptr += kv_row * S_vq * (D // V_GROUP)
    vr_ptr += kv_row * R_v * D
    m_i = -1.0e30  # running max (log2 units)
    l_i = 0.0  # running sum of exp2(score - m_i)
    acc = tl.zeros((TILE_D,), dtype=tl.float32)

    # Four ranges of positions, each tile read from where its keys and values are (in the cache, values
    # are quantized up to n_vq <= n_kq; the kernel takes either order):
    # 1) 0 .. m1 - 1: keys and values both codes (the steady state: nearly every position)
    m1 = tl.minimum(n_kq, n_vq) // TILE_N * TILE_N
    for pos0 in range(0, m1, TILE_N):
        acc, l_i, m_i = _kivi_tile(acc, l_i, m_i, q, pos0, n_kq, n_vq, n, kq_ptr, ks_ptr, kz_ptr, kr_ptr, vq_ptr,
                                   vs_ptr, vz_ptr, vr_ptr, group, D, dims, dim_ok, qk_scale, True, 0, BITS, V_GROUP,
                                   TILE_N)
    # 2) m1 .. n_kq - 1: keys codes (tiles aligned to key groups: m1 is a multiple of TILE_N), values either
    for pos0 in range(m1, n_kq, TILE_N):
        acc, l_i, m_i = _kivi_tile(acc, l_i, m_i, q, pos0, n_kq, n_vq, n, kq_ptr, ks_ptr, kz_ptr, kr_ptr, vq_ptr,
                                   vs_ptr, vz_ptr, vr_ptr, group, D, dims, dim_ok, qk_scale, True, 2, BITS, V_GROUP,
                                   TILE_N)
    # 3) n_kq .. e3 - 1: keys exact, values either (only when n_vq > n_kq)
    e3 = n_kq + (tl.maximum(n_vq - n_kq, 0) + TILE_N - 1) // TILE_N * TILE_N
    for pos0 in range(n_kq, e3, TILE_N):
        acc, l_i, m_i = _kivi_tile(acc, l_i, m_i, q, pos0, n_kq, n_vq, n, kq_ptr, ks_ptr, kz_ptr, kr_ptr, vq_ptr,
                                   vs_ptr, vz_ptr, vr_ptr, group, D, dims, dim_ok, qk_scale, False, 2, BITS, V_GROUP,
                                   TILE_N)
    # 4) e3 .. n - 1: keys and values both exact (the windows)
    for pos0 in range(e3, n, TILE_N):
        acc, l_i, m_i = _kivi_tile(acc, l_i, m_i, q, pos0, n_kq, n_vq, n, kq_ptr, ks_ptr, kz_ptr, kr_ptr, vq_ptr,
                                   vs_ptr, vz_ptr, vr_ptr, group, D, dims, dim_ok, qk_scale, False, 1, BITS, V_GROUP,
                                   TILE_N)

    out = acc / l_i  # l_i > 0: the wrapper checked n >= 1
    tl.store(o_ptr + pid * D + dims, out.to(o_ptr.dtype.element_ty), mask=dim_ok)


def _tile_n(group: int, TILE_D: int) -> int:
    """Positions per inner step: the largest power of two that divides ``group`` (so a tile never straddles
    two key groups), at most 4096 // TILE_D elements' worth on a GPU (64 positions in the interpreter)."""
    cap = 64 if runtime.INTERPRETER else max(16, 4096 // TILE_D)
    return min(group & -group, cap)


def kivi_decode_attention(q, k_packed, k_scale, k_zero, n_kq, k_res, n_kr, v_packed, v_scale, v_zero, n_vq, v_res,
                          n_vr, group, bits=2):
    """Decode attention over a KIVI cache with the Triton kernel; same arguments and result as the ref.

    One program per (sequence, query head) unpacks and dequantizes the packed codes in registers and reads
    the exact windows, with one online softmax over all positions. Keys and values may hold different
    numbers of quantized positions (keys a multiple of group, values any). q and the windows: fp32, fp16
    or bf16; scales and zeros fp16 or fp32 (the cache stores fp16).

    >>> from kvlib.lowbit import pack_2bit
    >>> from kvlib.runtime import DEVICE
    >>> g = torch.Generator().manual_seed(0)
    >>> k, v = (torch.randn(1, 2, 40, 16, generator=g).to(DEVICE) for _ in range(2))
    >>> kq, ks, kz = quantize_keys_per_channel(k[:, :, :32], group=16)  # 32 quantized keys + 8 exact
    >>> vq, vs, vz = _quantize_values(v[:, :, :35], bits=2, v_group=8)  # 35 quantized values + 5 exact
    >>> q = torch.randn(1, 4, 16, generator=g).to(DEVICE)
    >>> n = lambda x: torch.tensor([x], device=DEVICE)
    >>> args = (q, pack_2bit(kq), ks.half(), kz.half(), n(32), k[:, :, 32:], n(8),
    ...         pack_2bit(vq), vs.half(), vz.half(), n(35), v[:, :, 35:], n(5), 16)
    >>> torch.allclose(kivi_decode_attention(*args), kivi_decode_attention_ref(*args), atol=1e-5)
    True
    """
    v_group, _, _, _, _ = _check_kivi_args(q, k_packed, k_scale, k_zero, n_kq, k_res, n_kr, v_packed, v_scale, v_zero,
                                           n_vq, v_res, n_vr, group, bits)
    check_kernel_dtype("kivi.kivi_decode_attention", "q", q)
    if not runtime.require_triton("kivi.kivi_decode_attention", q=q, k_packed=k_packed, k_scale=k_scale,
                                  k_zero=k_zero, n_kq=n_kq, k_res=k_res, n_kr=n_kr, v_packed=v_packed,
                                  v_scale=v_scale, v_zero=v_zero, n_vq=n_vq, v_res=v_res, n_vr=n_vr):
        return kivi_decode_attention_ref(q, k_packed, k_scale, k_zero, n_kq, k_res, n_kr, v_packed, v_scale, v_zero,
                                         n_vq, v_res, n_vr, group, bits)
    B, H, D = q.shape
    H_KV, S_kq, S_vq, R_k, R_v = k_packed.shape[1], k_packed.shape[2], v_packed.shape[2], k_res.shape[2], v_res.shape[2]

    def arg(t):  # contiguous, and never an empty buffer (a cache may hold no quantized positions yet)
        return t.contiguous() if t.numel() else torch.zeros(1, dtype=t.dtype, device=t.device)

    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    TILE_D = max(16, triton.next_power_of_2(D))
    _kivi_decode_kernel[(B * H,)](
        arg(q), arg(k_packed), arg(k_scale), arg(k_zero), arg(k_res), arg(v_packed), arg(v_scale), arg(v_zero),
        arg(v_res), arg(n_kq), arg(n_kr), arg(n_vq), out,
        H_KV, S_kq, S_vq, R_k, R_v, D, H // H_KV, group, (1.0 / math.sqrt(D)) * 1.4426950408889634,
        BITS=bits, V_GROUP=v_group, TILE_N=_tile_n(group, TILE_D), TILE_D=TILE_D,
    )
    return out


# --------------------------------------------------------------------------------------------
# The KIVI cache
# --------------------------------------------------------------------------------------------


class KiviCache(KVCache):
    """KIVI: keys per channel over groups of ``group`` = G tokens, values per token over groups of
    ``v_group`` channels, both in ``bits`` bits (packed, 8 // bits codes per byte, an fp16 scale and zero
    per group), and an exact window of the newest tokens for each (``residual`` = R of them).

    Every call attends over what the cache held before it plus its own tokens, exact, causal among
    themselves, and only then stores them (sliding the windows): so the prompt (a call on an empty cache)
    attends in full precision over its own exact K/V, a later multi-token call over the dequantized old
    part + the exact windows + its tokens, and a decode step writes its token into each window's spare
    row, attends (``kivi_decode_attention``: the kernel when ``kernels`` is "triton", else its reference)
    and then slides the windows, as KIVI's reference code orders a decode step.

    The windows slide. Values leave theirs one token at a time, quantized per token: a sequence of n
    positions holds its ``max(0, n - R)`` oldest values quantized and exactly the R newest exact. Keys leave
    theirs a whole group at a time, quantized per channel over that group: with ``flush="group"`` (the
    default) as soon as the window would pass R tokens its oldest G leave, so the first
    ``G * ceil(max(0, n - R) / G)`` keys are quantized and the window holds between R - G + 1 and R newest
    keys once full. ``flush="residual"`` is the rule of KIVI's reference code (github.com/jy-yuan/KIVI,
    models/llama_kivi.py, ``LlamaAttention_KIVI.forward``): the window fills up to R keys and then all R are
    quantized at once (R * floor(n / R) keys quantized, between 0 and R - 1 exact; a prompt of length S
    keeps its last S % R keys exact), which keeps fewer keys exact on average (about R / 2 instead of
    R - G / 2). Either way the layout depends only on n, so tokens stored one at a time or all at once
    give the same codes (``test_kivi.py`` checks it on one layer; through a model the later layers'
    K/V differ, since an exact prefill attends differently from a token-by-token one).

    Other differences from the reference code, named where they are made: it runs single-token decode
    after the prompt only (here a multi-token call slides the windows as the same tokens one at a time
    would, after attending as above); its value groups are ``group`` channels wide (``v_group`` defaults
    to 32 here, or D when 32 does not divide D); its scales are in the model's dtype (fp16 there), here
    always fp16; it grows its tensors by concatenation, here every buffer is preallocated for max_len
    (``nbytes`` counts the windows' R + 1 rows even while they are empty).

    ``prefill="quantized"`` is *not KIVI*: the prompt's call also stores first and attends through the
    low-bit codes (and its K/V are then stored as they would be); it shows what attending the prompt
    through 2 bits costs.

    ``residual`` must be a multiple of ``group`` (as the reference code asserts); bits 2, 4 or 8; ``v_group``
    must divide head_dim. Buffers (per layer lists): ``k_packed`` (B, H_KV, S_kq, D * bits / 8) uint8,
    ``k_scale`` / ``k_zero`` (B, H_KV, S_kq / G, D) fp16; ``v_packed`` (B, H_KV, S_vq, D * bits / 8) uint8,
    ``v_scale`` / ``v_zero`` (B, H_KV, S_vq, D / v_group) fp16, where S_kq and S_vq are the quantized
    counts at max_len; ``k`` / ``v`` (KVCache's buffers) the exact windows (B, H_KV, R + 1, D): row j
    holds position (quantized count) + j, and row R is the spare row a decode step writes before the
    window slides. With residual >= every sequence's length nothing is quantized
    and the cache computes what KVCache does.

    How close (a worst case, per query head and channel d): each stored element is within δ = step / 2 +
    2^-11 (qmax * step + |zero|) of the original (half a step, plus the fp16 rounding of scale and zero), so
    every score q . k_j / sqrt(D) moves by at most ε = max_j Σ_d |q_d| δk_jd / sqrt(D), the attention weights
    by at most tanh(ε / 2) in total variation, and |out_d - exact_d| <= max_j δv_jd + tanh(ε / 2) (max_j v_jd
    - min_j v_jd). Exact positions (the windows) have δ = 0; on random data the real error is several times
    smaller than this bound (tests/test_kivi.py checks it holds).

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = KiviCache.for_model(model, batch=1, max_len=24, bits=2, group=4, residual=8)
    >>> with torch.no_grad():
    ...     logits = model(torch.arange(11)[None], cache=cache)  # prompt: attended exactly, then stored
    ...     logits = model(torch.tensor([[3]]), positions=cache.next_positions(), cache=cache)
    >>> cache.seq_lens.tolist(), cache.n_quantized(0)  # 12 positions: (keys, values) quantized; 8 exact each
    ([12], (4, 4))
    >>> tuple(cache.k_packed[0].shape), tuple(cache.v_scale[0].shape)  # (B, H_KV, S_q, D / 4), (..., D / v_group)
    ((1, 2, 16, 4), (1, 2, 16, 1))
    """

    def __init__(self, n_layers, batch, n_kv_heads, max_len, head_dim, bits=2, group=32, residual=32,
                 dtype=torch.float32, device="cpu", kernels=None, *, v_group=None, prefill="exact", flush="group"):
        bits, group, residual = _check_bits(bits), check_int("group", group), check_int("residual", residual)
        if residual % group:
            raise ValueError(f"residual={residual} must be a multiple of group={group}: keys leave the exact "
                             "window one whole group of tokens at a time")
        D = check_int("head_dim", head_dim)
        if D % (8 // bits):
            raise ValueError(f"head_dim={head_dim} must be a multiple of {8 // bits} to pack {8 // bits} "
                             f"{bits}-bit codes per byte")
        v_group = (32 if D % 32 == 0 else D) if v_group is None else check_int("v_group", v_group)
        if D % v_group:
            raise ValueError(f"v_group={v_group} must divide head_dim={D}: a value scale serves v_group channels")
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        if flush not in FLUSH_RULES:
            raise ValueError(f"flush must be one of {FLUSH_RULES}, got {flush!r}")
        super().__init__(n_layers, batch, n_kv_heads, residual + 1, head_dim, dtype, device, kernels)  # the windows
        self.max_len = check_int("max_len", max_len)
        self.bits, self.group, self.residual, self.v_group = bits, group, residual, v_group
        self.prefill, self.flush = prefill, flush
        self.rollback_rows = 0  # full-precision rows kept for truncate (enable_rollback); 0: none kept
        S_kq, S_vq = self._n_kq(self.max_len), self._n_vq(self.max_len)  # quantized capacities
        B, H_KV = batch, n_kv_heads

        def buffers(shape, dtype, fill):
            return [torch.full(shape, fill, dtype=dtype, device=device) for _ in range(n_layers)]

        self.k_packed = buffers((B, H_KV, S_kq, D * bits // 8), torch.uint8, 0)
        self.k_scale = buffers((B, H_KV, S_kq // group, D), torch.float16, 1)  # per (group of tokens, channel)
        self.k_zero = buffers((B, H_KV, S_kq // group, D), torch.float16, 0)
        self.v_packed = buffers((B, H_KV, S_vq, D * bits // 8), torch.uint8, 0)
        self.v_scale = buffers((B, H_KV, S_vq, D // v_group), torch.float16, 1)  # per (token, channel group)
        self.v_zero = buffers((B, H_KV, S_vq, D // v_group), torch.float16, 0)

    @classmethod
    def for_model(cls, model, batch, max_len, bits=2, group=32, residual=32, kernels=None, *, v_group=None,
                  prefill="exact", flush="group"):
        c = model.config
        return cls(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, bits, group, residual, model.dtype,
                   model.device, kernels, v_group=v_group, prefill=prefill, flush=flush)

    def _n_kq(self, n):
        """Keys held quantized when a sequence holds n positions (an int or a tensor of them)."""
        G, R = self.group, self.residual
        if self.flush == "residual":  # KIVI's code: all R at once when the window fills
            return n // R * R
        over = n - R
        over = over.clamp(min=0) if isinstance(over, torch.Tensor) else max(0, over)
        return (over + G - 1) // G * G  # the fewest whole groups that leave at most R keys exact

    def _n_vq(self, n):
        """Values held quantized when a sequence holds n positions: all but the R newest."""
        over = n - self.residual
        return over.clamp(min=0) if isinstance(over, torch.Tensor) else max(0, over)

    def n_quantized(self, b: int) -> tuple[int, int]:
        """(keys, values) of sequence b held in low bits (the oldest); the rest are exact."""
        n = self.held(b)
        return int(self._n_kq(n)), int(self._n_vq(n))

    def nbytes(self) -> int:
        """Bytes of every buffer: packed codes, scales, zeros and the exact windows."""
        return sum(t.nbytes for t in self.k + self.v + self.k_packed + self.v_packed + self.k_scale + self.k_zero
                   + self.v_scale + self.v_zero)

    def bytes_per_token(self) -> float:
        """Steady-state bytes per cached token for the whole model (the windows' fixed 2 (R + 1) rows
        aside: ``nbytes`` counts them).

        Per layer and K/V head: keys D * bits / 8 code bytes + an fp16 scale and zero per channel, shared by
        the G tokens of a group (4 D / G); values D * bits / 8 + an fp16 scale and zero per v_group channels
        (4 D / v_group).

        >>> KiviCache(n_layers=4, batch=1, n_kv_heads=8, max_len=64, head_dim=32).bytes_per_token()  # 4*8*(8+4 + 8+4)
        768.0
        """
        n_layers, (_, H_KV, _, D) = len(self.k), self.k[0].shape
        codes = D * self.bits / 8
        return n_layers * H_KV * ((codes + 4 * D / self.group) + (codes + 4 * D / self.v_group))

    def _store(self, layer_idx, k, v):
        """Append k, v (B, H_KV, T, D) after each sequence's positions, then slide both windows: the keys
        and values that leave them are quantized into the packed part (the rules in the class docstring)."""
        T, G, bits = k.shape[2], self.group, self.bits
        k_res, v_res = self.k[layer_idx], self.v[layer_idx]
        for b, n in enumerate(self.seq_lens.tolist()):
            # keys: whole groups leave the window
            start, end = self._n_kq(n), self._n_kq(n + T)
            r = n - start  # window rows in use
            if self.rollback_rows:  # truncate: keep what this call quantizes (below) until the next call
                self.rollback_from[b, 0] = start
            if end == start:
                k_res[b, :, r: r + T] = k[b]
            else:
                tail = torch.cat([k_res[b, :, :r], k[b]], dim=1)  # (H_KV, r + T, D): positions start .. n + T - 1
                f = end - start  # whole groups
                self._keep_rows("k_rollback", layer_idx, b, 0, tail[:, :f], end)
                kq, ks, kz = quantize_keys_per_channel(tail[None, :, :f], G, bits)  # (1, H_KV, f / G, D) scales
                self.k_packed[layer_idx][b, :, start:end] = pack_bits(kq[0], bits)
                self.k_scale[layer_idx][b, :, start // G: end // G] = ks[0]
                self.k_zero[layer_idx][b, :, start // G: end // G] = kz[0]
                k_res[b, :, :r + T - f] = tail[:, f:]
            # values: one token at a time (all that left during this call at once: per token, the same codes)
            start, end = self._n_vq(n), self._n_vq(n + T)
            r = n - start
            if self.rollback_rows:
                self.rollback_from[b, 1] = start
            if end == start:
                v_res[b, :, r: r + T] = v[b]
            else:
                tail = torch.cat([v_res[b, :, :r], v[b]], dim=1)
                f = end - start
                self._keep_rows("v_rollback", layer_idx, b, 1, tail[:, :f], end)
                vq, vs, vz = _quantize_values(tail[None, :, :f], bits, self.v_group)  # (1, H_KV, f, D / v_group)
                self.v_packed[layer_idx][b, :, start:end] = pack_bits(vq[0], bits)
                self.v_scale[layer_idx][b, :, start:end] = vs[0]
                self.v_zero[layer_idx][b, :, start:end] = vz[0]
                v_res[b, :, :r + T - f] = tail[:, f:]

    def enable_rollback(self, rows: int | None = None):
        """Keep, until the next call, the full-precision rows each call quantizes, so that ``truncate`` can
        cut back into the positions of the last call (chapter 11: rejected draft tokens).

        A multi-token call may complete a key group (or push values out of the window) that a truncate then
        cuts into: the positions before the cut must come back into the exact window exactly, and only
        their full-precision rows can give them back. ``rows`` (default 2 R) rows per layer, K and V, are
        kept: enough for any call of up to R tokens; of a longer call (a prompt) only the last ``rows``
        quantized positions can be restored. Memory this adds (``k_rollback``, ``v_rollback``, not counted
        in ``nbytes``): 2 x rows x H_KV x D values per layer and sequence. Call it on the whole cache, not on
        a ``sequence(b)`` view.

        >>> cache = KiviCache(n_layers=1, batch=1, n_kv_heads=1, max_len=32, head_dim=8, group=4, residual=4)
        >>> cache.enable_rollback()
        >>> _ = cache.attend(0, *(torch.randn(1, 1, 3, 8) for _ in range(3)))  # 3 positions: all exact
        >>> _ = cache.attend(0, *(torch.randn(1, 1, 6, 8) for _ in range(3)))  # 6 drafted: 4 keys quantized
        >>> cache.n_quantized(0), cache.truncate(0, 5), cache.n_quantized(0)  # back to 5: the rows come back
        ((8, 5), True, (4, 1))
        """
        rows = 2 * self.residual if rows is None else check_int("rows", rows)
        B, H_KV, _, D = self.k[0].shape
        like = dict(dtype=self.k[0].dtype, device=self.k[0].device)
        self.k_rollback = [torch.zeros(B, H_KV, rows, D, **like) for _ in self.k]  # row j: position rollback_from + j
        self.v_rollback = [torch.zeros(B, H_KV, rows, D, **like) for _ in self.v]
        n = self.seq_lens.long()
        self.rollback_from = torch.stack([self._n_kq(n), self._n_vq(n)], dim=1)  # (B, 2): keys, values
        self.rollback_rows = rows

    def _keep_rows(self, name, layer_idx, b, col, rows, end):
        """Keep the full-precision rows (H_KV, f, D) of positions end - f .. end - 1 a call quantized (the
        last ``rollback_rows`` of them) in ``getattr(self, name)[layer_idx]``; col 0: keys, 1: values."""
        if not self.rollback_rows:
            return
        n = min(rows.shape[1], self.rollback_rows)
        getattr(self, name)[layer_idx][b, :, :n] = rows[:, rows.shape[1] - n:]
        self.rollback_from[b, col] = end - n

    def truncate(self, b: int, length: int) -> bool:
        """Cut sequence b back to its first ``length`` positions, bitwise as if it had never seen the rest.

        Codes, scales and zeros of the positions kept do not change (a key group holds only kept positions
        when it lies before the new quantized count; the codes past it are dead). What the shorter length
        keeps exact must be back in the windows: positions the last call quantized come back from the rows
        ``enable_rollback`` keeps. A cut that needs rows no longer kept (quantized by an earlier call, or
        rollback not enabled) raises ValueError and changes nothing. Returns True (exact).

        >>> cache = KiviCache(n_layers=1, batch=1, n_kv_heads=1, max_len=32, head_dim=8, group=4, residual=4)
        >>> _ = cache.attend(0, *(torch.randn(1, 1, 3, 8) for _ in range(3)))
        >>> cache.truncate(0, 2), cache.held(0)  # nothing quantized: the windows already hold it
        (True, 2)
        """
        b, m = self._check_truncate(b, length)
        cur = int(self.seq_lens[b])
        plans = []
        for col, (n_cur, n_m) in enumerate(((int(self._n_kq(cur)), int(self._n_kq(m))),
                                            (int(self._n_vq(cur)), int(self._n_vq(m))))):
            if n_m == n_cur:  # the window holds positions n_cur .. cur - 1, which covers n_m .. m - 1
                continue
            first = int(self.rollback_from[b, col]) if self.rollback_rows else n_cur
            if n_m < first:
                what = "keys" if col == 0 else "values"
                how = ("the last call's" if self.rollback_rows else "no (call enable_rollback() first to keep the "
                       "last call's")
                raise ValueError(f"length={m} needs the full-precision {what} of positions {n_m}..{n_cur - 1} of "
                                 f"sequence {b}, but {how} full-precision rows are kept only from position "
                                 f"{first}{'' if self.rollback_rows else ')'}: a cut this far back cannot be exact")
            plans.append((col, n_cur, n_m, first))
        for col, n_cur, n_m, first in plans:  # checked first: a refused cut changes nothing
            windows, kept = (self.k, self.k_rollback) if col == 0 else (self.v, self.v_rollback)
            for window, rows in zip(windows, kept):
                back = rows[b, :, n_m - first: min(m, n_cur) - first]  # positions n_m .. that were quantized
                new = torch.cat([back, window[b, :, :max(0, m - n_cur)]], dim=1)  # then those still exact
                window[b, :, :new.shape[1]] = new
        self.seq_lens[b] = m
        return True

    def _held_kv(self, layer_idx, n, dtype):
        """Every sequence's n positions as the cache holds them, (B, H_KV, n, D) keys and values: the
        dequantized part, then the exact window (all sequences of equal length n)."""
        nk, nv = self._n_kq(n), self._n_vq(n)
        i = layer_idx
        keys = torch.cat([_dequantize_keys(self.k_packed[i], self.k_scale[i], self.k_zero[i], nk, self.group,
                                           self.bits, dtype), self.k[i][:, :, :n - nk]], dim=2)
        values = torch.cat([_dequantize_values(self.v_packed[i], self.v_scale[i], self.v_zero[i], nv, self.bits,
                                               dtype), self.v[i][:, :, :n - nv]], dim=2)
        return keys, values

    def attend(self, layer_idx, q, k, v):
        """q (B, H, T, D), k/v (B, H_KV, T, D) for the new tokens -> attention output (B, H, T, D)."""
        self._check_attend(layer_idx, q, k, v, self.k[0].dtype)
        T = q.shape[2]
        L = self._make_room(T)  # refuses before anything is written
        triton_kernels = self.kernels == "triton"
        prefill = flash_attention if triton_kernels else attention_ref
        i = layer_idx
        if T == 1:  # decode: the token goes into each window's next row, is attended, then the windows slide
            n = self.seq_lens.long()
            n_kq, n_vq = self._n_kq(n), self._n_vq(n)
            for b, (nb, kb, vb) in enumerate(zip(n.tolist(), n_kq.tolist(), n_vq.tolist())):
                self.k[i][b, :, nb - kb], self.v[i][b, :, nb - vb] = k[b, :, 0], v[b, :, 0]
            decode = kivi_decode_attention if triton_kernels else kivi_decode_attention_ref
            out = decode(q[:, :, 0], self.k_packed[i], self.k_scale[i], self.k_zero[i], n_kq, self.k[i], n + 1 - n_kq,
                         self.v_packed[i], self.v_scale[i], self.v_zero[i], n_vq, self.v[i], n + 1 - n_vq, self.group,
                         self.bits)[:, :, None]  # (B, H, 1, D): ragged, each sequence with its own counts
        elif L == T and self.prefill == "quantized":  # not KIVI: the prompt stored first, attended through its codes
            self._store(i, k, v)
            out = prefill(q, *self._held_kv(i, L, q.dtype), causal=True)
        else:  # the prompt (nothing held: exact attention) or a later call: what is held + its own tokens, exact
            keys, values = self._held_kv(i, L - T, q.dtype)  # (B, H_KV, L - T, D)
            out = prefill(q, torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2), causal=True)
        if T == 1 or L > T or self.prefill == "exact":
            self._store(i, k, v)  # then the windows slide: what leaves them is quantized
        self._advance(i, T)
        return out


class SnapKiviCache(KiviCache):
    """Two compressions composed: SnapKV chooses ``budget`` of the prompt's positions per K/V head, and
    KIVI stores those and every later token in ``bits`` bits (Li et al. 2024, "SnapKV: LLM Knows What You
    are Looking for Before Generation", arXiv:2404.14469, then ``KiviCache``).

    The prompt (a call on an empty cache longer than ``budget``) attends exactly over its own K/V, as in
    both papers; ``kvlib.evict.snapkv_select`` then recomputes the last ``window`` queries' attention and
    keeps the window + the best-voted positions, and only those enter KIVI's layout (the newest of them in
    its exact windows). Later tokens are all kept, as SnapKV's paper does after the prefill (as ``SnapKVCache`` does by
    default; its ``decode_evict=True`` goes on evicting), so the cache grows by one low-bit token per step. Keys are
    stored rotated at their true positions, so dropping positions changes no key; ``next_positions``
    counts the dropped ones (``dropped``).

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = SnapKiviCache.for_model(model, 1, max_len=16, budget=6, window=2, group=4, residual=4)
    >>> with torch.no_grad():
    ...     _ = model(torch.arange(12)[None], cache=cache)  # a 12-token prompt: 6 kept
    ...     _ = model(torch.tensor([[3]]), positions=cache.next_positions(), cache=cache)
    >>> cache.held(0), cache.dropped.tolist(), cache.next_positions().tolist(), cache.n_quantized(0)
    (7, [6], [[13]], (4, 3))
    """

    def __init__(self, n_layers, batch, n_kv_heads, max_len, head_dim, budget, bits=2, group=32, residual=32,
                 dtype=torch.float32, device="cpu", kernels=None, *, window=32, kernel=7, pooling="max",
                 v_group=None, flush="group"):
        super().__init__(n_layers, batch, n_kv_heads, max_len, head_dim, bits, group, residual, dtype, device,
                         kernels, v_group=v_group, prefill="exact", flush=flush)
        self.budget = check_int("budget", budget)
        self.window, self.kernel, self.pooling = check_snapkv_options(window, self.budget, kernel, pooling)
        self.dropped = torch.zeros(batch, dtype=torch.int64, device=device)  # prompt positions SnapKV dropped

    @classmethod
    def for_model(cls, model, batch, max_len, budget, bits=2, group=32, residual=32, kernels=None, **options):
        c = model.config
        return cls(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, budget, bits, group, residual, model.dtype,
                   model.device, kernels, **options)

    def reset(self, batch=None, length=None):
        """Empty the cache. ``length`` is not checked here: a compressed prompt needs fewer positions than it
        has, and a call that would not fit is refused before anything is written."""
        super().reset(batch, None)
        self.dropped.zero_()

    def next_positions(self) -> torch.Tensor:
        return (self.seq_lens.long() + self.dropped)[:, None]

    def attend(self, layer_idx, q, k, v):
        T = q.shape[2]
        if T <= self.budget or int(self.seq_lens.max()) > 0 or bool(self.dropped.any()):
            return super().attend(layer_idx, q, k, v)  # not a prompt to compress: KIVI as it is
        self._check_attend(layer_idx, q, k, v, self.k[0].dtype)
        self._make_room(self.budget)  # only the kept positions are stored
        prefill = flash_attention if self.kernels == "triton" else attention_ref
        out = prefill(q, k, v, causal=True)  # the prompt attends exactly over its own K/V
        keep = snapkv_select(q, k, self.budget, self.window, self.kernel, self.pooling)  # (B, H_KV, budget)
        rows = keep[..., None].expand(*keep.shape, k.shape[3])
        self._store(layer_idx, k.gather(2, rows), v.gather(2, rows))
        self._advance(layer_idx, self.budget)
        if layer_idx == len(self.k) - 1:
            self.dropped += T - self.budget
        return out


# How kvlib.course.compile_check builds the decode kernel: the wrapper's launch for 32 query heads over 8 K/V heads,
# D = 128, fp16 queries, windows and scales, KIVI's group of 32 tokens and value groups of 32 channels,
# residual 128, two sequences (1024 and 517 positions) as KiviCache lays them out, 2-bit and 4-bit codes.
def _compile_launch(bits: int, group: int = 32, v_group: int = 32, R: int = 128):
    B, H, H_KV, D, S = 2, 32, 8, 128, 1024
    n = torch.tensor([S, 517])
    n_kq, n_vq = (n - R + group - 1) // group * group, n - R
    S_kq, S_vq = int(n_kq.max()), int(n_vq.max())
    per = 8 // bits
    k_codes = torch.zeros(B, H_KV, S_kq, D // per, dtype=torch.uint8)
    v_codes = torch.zeros(B, H_KV, S_vq, D // per, dtype=torch.uint8)
    k_scale, k_zero = (torch.ones(B, H_KV, S_kq // group, D, dtype=torch.float16) for _ in range(2))
    v_scale, v_zero = (torch.ones(B, H_KV, S_vq, D // v_group, dtype=torch.float16) for _ in range(2))
    res = torch.zeros(B, H_KV, R, D, dtype=torch.float16)
    return kivi_decode_attention(torch.zeros(B, H, D, dtype=torch.float16), k_codes, k_scale, k_zero, n_kq, res,
                                 n - n_kq, v_codes, v_scale, v_zero, n_vq, res.clone(), n - n_vq, group, bits)


def _kivi_loop(a):
    """One step of the steady-state loop (range 1: keys and values both codes): packed K and V codes, the key
    group's scale + zero per channel and the values' scale + zero per (token, channel group); every query head
    of a group reads them again."""
    rows, d = a["TILE_N"], a["TILE_D"]
    codes = 2 * rows * d * a["BITS"] // 8
    return dict(bytes=codes + 2 * d * a["ks_ptr"].element_size()
                + 2 * rows * (d // a["V_GROUP"]) * a["vs_ptr"].element_size(), reread=a["n_rep"], loop=0)


COMPILE_SPECS = [dict(name=f"KIVI {bits}-bit decode fp16 32/8", launch=lambda bits=bits: _compile_launch(bits),
                      loops={"_kivi_decode_kernel": _kivi_loop}) for bits in (2, 4)]
