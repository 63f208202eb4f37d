"""Keeping less by compressing K/V (chapter 09): low rank, multi-head latent attention, cross-layer sharing.

What you will learn:
- low rank: the keys (after RoPE) and values a trained model produces are not spread evenly over
  all D directions. ``fit_low_rank`` records them on some text and keeps, per layer and K/V head,
  the ``rank`` strongest directions (an SVD; ``low_rank_error`` measures what the rest held).
  ``LowRankKVCache`` stores only each row's ``rank`` coefficients and attends in that rank-r space
  *without rebuilding a key*: the query is projected instead, since q . (U c) = (U^T q) . c.
  rank/D of the bytes, and chapter 03's decode kernel unchanged (it just sees head dim r);
- low rank before RoPE, as Palu does: fitted on the keys before the rotation (``fit_low_rank(...,
  keys="pre_rope")``), the basis no longer has to cover every rotated copy of a direction, so the same
  rank loses far less; the price is that the query cannot absorb U (RoPE sits between), so the cache
  rebuilds the keys and rotates them when it attends. ``values="exact"`` keeps the values whole (K only);
- MLA (multi-head latent attention, DeepSeek-V2): low rank trained in from the start. Each token
  caches one latent c_kv of d_c numbers shared by every head, plus one small RoPE key.
  ``LatentAttention.decode_absorbed`` folds W_uk into the query and applies W_uv after the softmax,
  so a decode step never materializes a per-head key or value;
- cross-layer sharing (CLA): adjacent layers use one K/V. ``SharedKVSeam`` runs (and fine-tunes)
  a model that way, ``CrossLayerKVCache`` serves it with 1/share of the bytes.

Shapes: B batch, H query heads, H_KV K/V heads, T new tokens, S cached length (S_max capacity),
D head dim, C model width; r the rank; d_c MLA's latent width, d_rope its RoPE key width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from .attention import attention_ref, flash_attention
from .cache import (CacheFullError, KVCache, check_attend_args, check_int, decode_attention, decode_attention_ref,
                    store_kv, store_kv_ref)
from .gqa import finetune
from .memory import dtype_bytes
from .model import ModelConfig, Transformer, apply_rope, rope_cos_sin, rope_frequencies, rotate
from .train import evaluate

__all__ = ["record_kv", "fit_low_rank", "low_rank_error", "LowRankKVCache", "MLAConfig", "LatentAttention",
           "LatentKVCache", "MLA_CONFIGS", "mla_bytes_per_token", "mha_bytes_per_token", "mla_gqa_groups",
           "SharedKVSeam", "CrossLayerKVCache", "finetune_shared", "evaluate_shared"]


def _tiny_model(n_layers=2):
    """The seeded random model the examples below use (16 tokens, 2 heads of D = 16)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=n_layers, n_heads=2, hidden_dim=64)).eval()


# --------------------------------------------------------------------------------------------
# 1. Low rank: record K/V, fit bases, store coefficients
# --------------------------------------------------------------------------------------------


KEY_FITS = ("post_rope", "pre_rope")  # where fit_low_rank takes the keys: after RoPE (absorbed) or before (Palu)
VALUE_MODES = ("low_rank", "exact")  # LowRankKVCache's values: r coefficients (U_v folded in after attention) or D


def _check_keys(keys) -> str:
    if keys not in KEY_FITS:
        raise ValueError(f"keys must be one of {KEY_FITS} (where the key bases are fitted), got {keys!r}")
    return keys


class _RecordingSeam:
    """A seam object that keeps each layer's k and v and attends over exactly the tokens given.

    With ``inv_freq`` it asks the model for keys *before* RoPE (``keys_before_rope``), keeps those, and
    rotates them at positions 0..T-1 itself before attending, so the forward pass is the model's own."""

    def __init__(self, inv_freq=None):
        self.k, self.v = {}, {}
        self.inv_freq = inv_freq
        self.keys_before_rope = inv_freq is not None

    def attend(self, layer_idx, q, k, v):
        self.k[layer_idx], self.v[layer_idx] = k.detach(), v.detach()
        if self.keys_before_rope:
            cos, sin = rope_cos_sin(torch.arange(k.shape[2], device=k.device), self.inv_freq.to(k.device), k.dtype)
            k = rotate(k, cos, sin)  # (B, H_KV, T, D) at positions 0..T-1, as the model would have
        return attention_ref(q, k, v, causal=True)


@torch.no_grad()
def record_kv(model, ids, keys: str = "post_rope"):
    """The model's keys and values on ``ids``, teacher-forced: two lists, one (B, H_KV, T, D) per layer.

    ids: a (B, T) or (T,) integer tensor, at positions 0..T-1. keys: "post_rope" (the keys a KVCache
    stores, rotated at their positions) or "pre_rope" (k = x W_k, before the rotation).

    >>> ks, vs = record_kv(_tiny_model(), torch.arange(12) % 16)
    >>> len(ks), tuple(ks[0].shape)  # one (B, H_KV, T, D) per layer
    (2, (1, 2, 12, 16))
    >>> pre, _ = record_kv(_tiny_model(), torch.arange(12) % 16, keys="pre_rope")
    >>> [torch.allclose(pre[0][:, :, t], ks[0][:, :, t]) for t in (0, 1)]  # position 0 is not rotated, 1 is
    [True, False]
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() not in (1, 2):
        raise ValueError(f"ids must be a (B, T) or (T,) tensor of token ids, got {getattr(ids, 'shape', type(ids))}")
    seam = _RecordingSeam(rope_frequencies(model.config) if _check_keys(keys) == "pre_rope" else None)
    model(ids.view(1, -1) if ids.dim() == 1 else ids, cache=seam)
    n = model.config.n_layers
    return [seam.k[i] for i in range(n)], [seam.v[i] for i in range(n)]


def _check_rank(rank, D: int) -> int:
    rank = check_int("rank", rank)
    if rank > D:
        raise ValueError(f"rank must lie in 1..D={D} (the head dim), got {rank}")
    return rank


def _directions(x):
    """(B, H_KV, T, D) rows -> (H_KV, D, D): per head its right-singular vectors as columns, strongest first."""
    rows = x.transpose(0, 1).flatten(1, 2).double()  # (H_KV, B*T, D)
    return torch.linalg.svd(rows, full_matrices=False).Vh.transpose(1, 2)  # (H_KV, D, D)


class _FittedBases(list):
    """fit_low_rank's list of (U_k, U_v) pairs, tagged with where the key bases were fitted (``fitted_keys``),
    so that LowRankKVCache picks the matching attention and refuses the other one."""

    def __init__(self, pairs, fitted_keys):
        super().__init__(pairs)
        self.fitted_keys = fitted_keys


def fit_low_rank(model, ids, rank: int, keys: str = "post_rope"):
    """Per layer (U_k, U_v), each (H_KV, D, rank) with orthonormal columns: the top right-singular
    vectors of the keys and values the model produces on ``ids`` (not centred: a row is
    approximated by U U^T row).

    keys: "post_rope" fits U_k on the keys after RoPE (what ``LowRankKVCache`` absorbs into the query);
    "pre_rope" fits it on k = x W_k before RoPE, as Palu does (Chang et al. 2024, "Palu: Compressing
    KV-Cache with Low-Rank Projection", arXiv:2407.21118): the cache then rebuilds each key and rotates it.
    Before RoPE a head's keys keep one set of directions at every position; after it, position p turns
    them by p's angles, so one basis must cover every rotated copy and the rank needed grows. The default
    stays "post_rope", the contrast chapter 09 starts from; the returned list remembers which (its
    ``fitted_keys``), and the cache follows it.

    Palu itself decomposes the projection weight W_k (M-LRD: one factorization per head, or G-LRD over
    groups of heads) with SVD-LLM's whitening and allocates ranks per layer by Fisher information. Per
    head, the SVD of the recorded pre-RoPE keys X W_k is the rank-r W_k U U^T that minimises
    ||X W_k - X W'||_F, i.e. the whitened objective, on this calibration text; here every layer and
    head gets the same rank and no groups are formed.

    >>> bases = fit_low_rank(_tiny_model(), torch.arange(64) % 16, rank=4)
    >>> U_k, U_v = bases[0]
    >>> len(bases), tuple(U_k.shape), torch.allclose(U_k[0].T @ U_k[0], torch.eye(4), atol=1e-5)
    (2, (2, 16, 4), True)
    >>> fit_low_rank(_tiny_model(), torch.arange(64) % 16, rank=4, keys="pre_rope").fitted_keys
    'pre_rope'
    """
    rank = _check_rank(rank, model.config.head_dim)
    ks, vs = record_kv(model, ids, keys=_check_keys(keys))
    cast = dict(dtype=model.dtype, device=model.device)
    return _FittedBases([(_directions(k)[..., :rank].to(**cast).contiguous(),
                          _directions(v)[..., :rank].to(**cast).contiguous()) for k, v in zip(ks, vs)], keys)


def low_rank_error(model, ids, ranks, fit_ids=None, keys: str = "post_rope") -> dict:
    """{rank: {"k": error, "v": error}}: relative reconstruction error ||X - X U U^T|| / ||X|| (Frobenius,
    over all layers and heads) of the model's keys and values on ``ids``, with bases fitted on
    ``fit_ids`` (default: ``ids`` itself, where the SVD's error is the smallest possible). keys: the keys
    after or before RoPE, as in ``fit_low_rank`` (the values are the same either way).

    >>> model = _tiny_model()
    >>> err = low_rank_error(model, torch.arange(64) % 16, [2, 8, 16])
    >>> err[2]["k"] > err[8]["k"] > err[16]["k"], round(err[16]["v"], 6)  # rank = D is exact
    (True, 0.0)
    """
    D = model.config.head_dim
    ranks = [_check_rank(r, D) for r in ranks]
    fit_k, fit_v = record_kv(model, ids if fit_ids is None else fit_ids, keys=keys)
    ks, vs = (fit_k, fit_v) if fit_ids is None else record_kv(model, ids, keys=keys)
    return _rank_errors(fit_k, fit_v, ks, vs, ranks)


def _rank_errors(fit_k, fit_v, ks, vs, ranks) -> dict:
    """``low_rank_error``'s sums from recorded keys and values (lists of (B, H_KV, T, D) per layer): bases from
    ``fit_k``/``fit_v``, errors measured on ``ks``/``vs``."""
    dirs = {"k": [_directions(x) for x in fit_k], "v": [_directions(x) for x in fit_v]}
    out = {}
    for r in ranks:
        out[r] = {}
        for name, xs in (("k", ks), ("v", vs)):
            err = total = 0.0
            for x, U in zip(xs, dirs[name]):
                x, U = x.double(), U[..., :r]  # (B, H_KV, T, D), (H_KV, D, r)
                err += (x - x @ U @ U.transpose(1, 2)).pow(2).sum().item()
                total += x.pow(2).sum().item()
            out[r][name] = math.sqrt(err / total)
    return out


def _check_bases(bases, n_layers=None, n_kv_heads=None, head_dim=None):
    """(n_layers, H_KV, D, r) of valid bases: a list of (U_k, U_v) pairs, all floating (H_KV, D, r)."""
    pairs = isinstance(bases, (list, tuple)) and bases and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(u, torch.Tensor) for u in p) for p in bases)
    if not pairs:
        raise TypeError("bases must be a list of (U_k, U_v) tensor pairs, one per layer, as fit_low_rank returns")
    if n_layers is not None and len(bases) != n_layers:
        raise ValueError(f"bases must hold one (U_k, U_v) pair per layer ({n_layers}), got {len(bases)}")
    first = bases[0][0]
    if first.dim() != 3:
        raise ValueError(f"bases[0] U_k must be an (H_KV, D, r) tensor, got shape {tuple(first.shape)}")
    want = (n_kv_heads or first.shape[0], head_dim or first.shape[1], first.shape[2])  # (H_KV, D, r)
    for i, (u_k, u_v) in enumerate(bases):
        for name, u in (("U_k", u_k), ("U_v", u_v)):
            if u.dim() != 3 or tuple(u.shape) != want or not u.is_floating_point():
                raise ValueError(f"bases[{i}] {name} must be a floating (H_KV, D, r) = {want} tensor like the "
                                 f"others, got {tuple(u.shape)} {u.dtype}")
    _check_rank(want[2], want[1])
    return len(bases), *want


def _store_rows(buf, new, start, triton_kernels):
    """Write new (B, H_KV, T, d) rows into one buffer (B, H_KV, S_max, d) at start[b]: chapter 03's store,
    handed the buffer as both of its caches (the K-only cache's two buffers differ in width)."""
    (store_kv if triton_kernels else store_kv_ref)(buf, buf, new, new, start)


class LowRankKVCache(KVCache):
    """Chapter 03's cache storing r coefficients per K (and V) row instead of D numbers: (B, H_KV, S_max, r).

    For each layer and K/V head, a basis U (D, r) with orthonormal columns (``fit_low_rank``):
    store c_k = k U_k and c_v = v U_v. Three ways to attend, chosen by ``keys`` and ``values``:

    - keys="post_rope" (bases fitted on keys after RoPE), values="low_rank": attention never rebuilds a
      key: the query is projected, scores = (q U_k) . c_k / sqrt(D) (the scale stays 1/sqrt(D): these are
      the same dot products, up to the lost directions), and out = (p c_v) U_v^T. Decode reuses
      ``decode_attention`` (or its ref) unchanged with head dim r: it scales by 1/sqrt(r), so the projected
      query is pre-multiplied by sqrt(r / D). No new kernel;
    - keys="pre_rope" (Palu, Chang et al. 2024, "Palu: Compressing KV-Cache with Low-Rank Projection",
      arXiv:2407.21118): the cache sets ``keys_before_rope``, so the model hands it k before RoPE; it stores
      c_k = k U_k and, when it attends, rebuilds every key (c_k U_k^T) and rotates it at its position
      (slot s holds position s, as in KVCache). The query cannot absorb U_k here: RoPE rotates each
      position by its own angles, R_p U_k != U_k R_p, so q . R_p U_k c is not (U_k^T q) . c for one U_k
      shared by all positions. Palu fuses the rebuild and the rotation into its attention kernel; here
      rebuild + rotate + attention is one step in plain PyTorch (fp32, like ``attention_ref``), for the
      torch and the triton kernels alike (only the store uses chapter 03's kernel). V stays absorbed:
      out = (p c_v) U_v^T;
    - values="exact" (with either keys): a K-only cache, the values kept whole, (B, H_KV, S_max, D),
      U_v unused; attention is the plain-PyTorch step above (the rank-r keys and D-wide values no longer
      fit chapter 03's kernel, which wants K and V of one width).

    ``self.k[layer]`` holds the key coefficients, ``self.v[layer]`` the value coefficients (or the values).
    ``keys=None`` takes where the bases were fitted (``fit_low_rank``'s ``fitted_keys``; "post_rope" for
    a plain list); naming the other one is refused.

    ``nbytes`` and ``bytes_per_token`` count the coefficient (and value) buffers only: per token and layer
    H_KV x (r + r) numbers, or H_KV x (r + D) for the K-only cache. The bases (2 x n_layers x H_KV x D x r
    numbers) are weights shared by every sequence, whatever their length.

    V's basis could be folded into the model's weights (W_v U_v, then U_v^T W_o); K's cannot, since
    RoPE sits between W_k and the cache. That is why MLA (below) keeps a separate small RoPE key.

    >>> from kvlib.generate import generate
    >>> model = _tiny_model()
    >>> bases = fit_low_rank(model, torch.arange(64) % 16, rank=16)  # rank = D: nothing lost
    >>> cache = LowRankKVCache.for_model(model, batch=1, max_len=16, bases=bases)
    >>> torch.equal(generate(model, [[1, 2, 3]], 8, cache=cache), generate(model, [[1, 2, 3]], 8))
    True
    >>> small = LowRankKVCache.for_model(model, 1, 16, fit_low_rank(model, torch.arange(64) % 16, rank=4))
    >>> tuple(small.k[0].shape), cache.bytes_per_token(), small.bytes_per_token()  # 2 layers x K,V x 2 heads x r x 4 B
    ((1, 2, 16, 4), 512, 128)
    >>> pre = fit_low_rank(model, torch.arange(64) % 16, rank=4, keys="pre_rope")  # Palu: bases before RoPE
    >>> palu, k_only = (LowRankKVCache.for_model(model, 1, 16, pre, values=v) for v in ("low_rank", "exact"))
    >>> palu.keys_before_rope, palu.bytes_per_token(), k_only.bytes_per_token()  # K-only: 2 x 2 x (4 + 16) x 4 B
    (True, 128, 320)
    """

    shared_attrs = ("U_k", "U_v", "inv_freq")  # every sequence uses the same bases and RoPE frequencies

    def __init__(self, bases, batch, max_len, dtype=torch.float32, device="cpu", kernels=None, keys=None,
                 values="low_rank", inv_freq=None):
        n_layers, H_KV, D, r = _check_bases(bases)
        fitted = getattr(bases, "fitted_keys", None)
        keys = (fitted or "post_rope") if keys is None else _check_keys(keys)
        if fitted is not None and keys != fitted:
            raise ValueError(f"keys={keys!r}, but these bases were fitted on keys {fitted.replace('_', ' ')} "
                             f"(fit_low_rank(..., keys={keys!r}) fits the other kind)")
        if values not in VALUE_MODES:
            raise ValueError(f"values must be one of {VALUE_MODES}, got {values!r}")
        if keys == "pre_rope":
            if not isinstance(inv_freq, torch.Tensor) or tuple(inv_freq.shape) != (D // 2,) or D % 2:
                raise ValueError(f"keys='pre_rope' needs inv_freq, the model's (D/2,) = ({D // 2},) RoPE "
                                 f"frequencies, to rotate the rebuilt keys; got {getattr(inv_freq, 'shape', inv_freq)}")
            inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        super().__init__(n_layers, batch, H_KV, max_len, r, dtype, device, kernels)  # coefficients (B, H_KV, S_max, r)
        if values == "exact":  # the values whole: (B, H_KV, S_max, D)
            self.v = [torch.zeros(batch, H_KV, max_len, D, dtype=dtype, device=device) for _ in range(n_layers)]
        self.U_k = [u.to(device, dtype).contiguous() for u, _ in bases]  # per layer (H_KV, D, r)
        self.U_v = None if values == "exact" else [u.to(device, dtype).contiguous() for _, u in bases]
        self.head_dim, self.keys, self.values = D, keys, values
        self.inv_freq = inv_freq if keys == "pre_rope" else None  # (D/2,) fp32
        self.keys_before_rope = keys == "pre_rope"  # the model's seam then hands over k before RoPE

    @classmethod
    def for_model(cls, model, batch, max_len, bases, kernels=None, keys=None, values="low_rank"):
        c = model.config
        _check_bases(bases, c.n_layers, c.n_kv_heads, c.head_dim)
        return cls(bases, batch, max_len, model.dtype, model.device, kernels, keys=keys, values=values,
                   inv_freq=rope_frequencies(c).to(model.device))

    def _check_attend(self, layer_idx, q, k, v, kv_dtype):
        B, H_KV = self.k[0].shape[:2]
        check_attend_args(layer_idx, q, k, v, n_layers=len(self.k), batch=B, n_kv_heads=H_KV, head_dim=self.head_dim,
                          kv_dtype=kv_dtype, batch_is=f"the cache holds B={B} sequence(s)")

    def attend(self, layer_idx, q, k, v):
        self._check_attend(layer_idx, q, k, v, self.k[0].dtype)
        B, H, T, D = q.shape
        U_k = self.U_k[layer_idx]  # (H_KV, D, r)
        H_KV, r = U_k.shape[0], U_k.shape[2]
        start = self.seq_lens
        L = self._make_room(T)
        c_k, c_v = self.k[layer_idx], self.v[layer_idx]  # (B, H_KV, S_max, r); c_v (..., D) when values are exact
        triton_kernels = self.kernels == "triton"
        new_k = (k @ U_k).contiguous()  # (B, H_KV, T, r): before or after RoPE, as k arrives
        if self.values == "exact":
            _store_rows(c_k, new_k, start, triton_kernels)
            _store_rows(c_v, v.contiguous(), start, triton_kernels)
        else:
            (store_kv if triton_kernels else store_kv_ref)(c_k, c_v, new_k, (v @ self.U_v[layer_idx]).contiguous(),
                                                           start)
        if self.keys == "pre_rope" or self.values == "exact":
            out = self._attend_torch(layer_idx, q, start, L)
            self._advance(layer_idx, T)
            return out
        # query head h reads K/V head h // n_rep: project it into that head's rank-r space, scale for the kernel
        q_r = (q.reshape(B, H_KV, H // H_KV, T, D) @ U_k[:, None]).reshape(B, H, T, r)  # (B, H, T, r)
        q_r = q_r * math.sqrt(r / D)  # the kernels divide by sqrt(r); these scores need 1/sqrt(D)
        if T == 1:
            decode = decode_attention if triton_kernels else decode_attention_ref
            o_r = decode(q_r[:, :, 0].contiguous(), c_k, c_v, start + 1)[:, :, None]  # (B, H, 1, r)
        else:
            prefill = flash_attention if triton_kernels else attention_ref
            o_r = prefill(q_r, c_k[:, :, :L], c_v[:, :, :L], causal=True)  # (B, H, T, r)
        out = o_r.reshape(B, H_KV, H // H_KV, T, r) @ self.U_v[layer_idx].transpose(1, 2)[:, None]  # (..., T, D)
        self._advance(layer_idx, T)
        return out.reshape(B, H, T, D)

    def _attend_torch(self, layer_idx, q, start, S):
        """Attention of q (B, H, T, D) over the first S slots, in fp32: sequence b's new token t sits at
        position start[b] + t and sees the slots 0 .. start[b] + t (causal prefill and ragged decode alike)."""
        B, H, T, D = q.shape
        U_k = self.U_k[layer_idx].float()  # (H_KV, D, r)
        H_KV, n_rep = U_k.shape[0], H // U_k.shape[0]
        c_k = self.k[layer_idx][:, :, :S].float()  # (B, H_KV, S, r)
        q = q.float().reshape(B, H_KV, n_rep * T, D)  # the query heads that read K/V head h, rows (rep, t)
        if self.keys == "pre_rope":  # rebuild the keys and rotate each at its position
            cos, sin = rope_cos_sin(torch.arange(S, device=q.device), self.inv_freq, torch.float32)  # (S, D)
            scores = q @ rotate(c_k @ U_k.transpose(1, 2), cos, sin).transpose(-1, -2)  # (B, H_KV, n_rep*T, S)
        else:  # keys after RoPE: the query absorbs U_k
            scores = (q @ U_k) @ c_k.transpose(-1, -2)
        q_pos = (start.long()[:, None] + torch.arange(T, device=q.device)).repeat(1, n_rep)  # (B, n_rep*T)
        seen = torch.arange(S, device=q.device) <= q_pos[..., None]  # (B, n_rep*T, S)
        probs = torch.softmax((scores / math.sqrt(D)).masked_fill(~seen[:, None], float("-inf")), dim=-1)
        out = probs @ self.v[layer_idx][:, :, :S].float()  # (B, H_KV, n_rep*T, r or D)
        if self.values == "low_rank":
            out = out @ self.U_v[layer_idx].float().transpose(1, 2)  # back to D dims
        return out.reshape(B, H, T, D).to(self.k[0].dtype)


# --------------------------------------------------------------------------------------------
# 2. MLA: multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, section 2.1)
# --------------------------------------------------------------------------------------------


@dataclass
class MLAConfig:
    """The sizes of one MLA layer (Hugging Face config.json names in the comments).

    >>> cfg = MLAConfig(dim=32, n_heads=4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    >>> cfg.kv_lora_rank + cfg.qk_rope_head_dim  # numbers cached per token, for all 4 heads together
    12
    """

    dim: int  # C: model width (Hugging Face: hidden_size)
    n_heads: int  # H: attention heads (num_attention_heads); MLA has no separate K/V head count
    kv_lora_rank: int  # d_c: width of the latent c_kv = W_dkv x that each token caches, shared by all heads
    qk_nope_head_dim: int  # per-head query/key dims without RoPE; the key part is rebuilt from c_kv by W_uk
    qk_rope_head_dim: int  # d_rope: the decoupled RoPE part; its key is one vector for all heads, cached
    v_head_dim: int  # per-head value dims, rebuilt from c_kv by W_uv
    q_lora_rank: int | None = None  # the query's own bottleneck (saves weights, not cache); None: q = W_q x
    rope_theta: float = 10000.0  # RoPE base for the d_rope dims

    def __post_init__(self):
        for name in ("dim", "n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_int(f"MLAConfig.{name}", getattr(self, name))
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig.qk_rope_head_dim must be even (RoPE rotates pairs), "
                             f"got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None:
            check_int("MLAConfig.q_lora_rank", self.q_lora_rank)


class LatentAttention(nn.Module):
    """One MLA layer: c_kv = W_dkv x (d_c), k_rope = RoPE(W_kr x) shared by all heads (d_rope); per head
    q = [q_nope, q_rope], k = [W_uk c_kv, k_rope], v = W_uv c_kv, softmax scale 1/sqrt(qk_nope + qk_rope).

    ``forward`` is the plain way (every head's k and v materialized, causal attention), ``decode_absorbed``
    the way a server runs it from a ``LatentKVCache``. DeepSeek-V2 also RMS-normalizes c_kv (and the
    query's latent) before the up-projections; that changes nothing about what is cached, so it is left out.

    >>> cfg = MLAConfig(dim=32, n_heads=4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    >>> with torch.random.fork_rng():
    ...     _ = torch.manual_seed(0)
    ...     attn, x = LatentAttention(cfg).eval(), torch.randn(2, 5, 32)  # x (B, T, C)
    >>> attn(x).shape  # (B, T, C)
    torch.Size([2, 5, 32])
    """

    def __init__(self, config: MLAConfig):
        super().__init__()
        if not isinstance(config, MLAConfig):
            raise TypeError(f"config must be an MLAConfig, got {type(config).__name__}")
        self.config = c = config
        H, d_qk = c.n_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
        if c.q_lora_rank is None:
            self.w_q = nn.Linear(c.dim, H * d_qk, bias=False)
        else:
            self.w_dq = nn.Linear(c.dim, c.q_lora_rank, bias=False)  # query down-projection...
            self.w_uq = nn.Linear(c.q_lora_rank, H * d_qk, bias=False)  # ...and up again
        self.w_dkv = nn.Linear(c.dim, c.kv_lora_rank, bias=False)  # x -> c_kv: what the cache keeps
        self.w_kr = nn.Linear(c.dim, c.qk_rope_head_dim, bias=False)  # x -> the shared RoPE key (cached too)
        self.w_uk = nn.Linear(c.kv_lora_rank, H * c.qk_nope_head_dim, bias=False)  # c_kv -> every head's k_nope
        self.w_uv = nn.Linear(c.kv_lora_rank, H * c.v_head_dim, bias=False)  # c_kv -> every head's v
        self.w_o = nn.Linear(H * c.v_head_dim, c.dim, bias=False)
        d = c.qk_rope_head_dim
        self.register_buffer("inv_freq", 1.0 / c.rope_theta ** (torch.arange(0, d, 2).float() / d), persistent=False)

    def _rope(self, x, positions):
        """RoPE on x (B, heads, T, d_rope) at positions (B, T), as kvlib.model does it."""
        return apply_rope(x, *rope_cos_sin(positions, self.inv_freq, x.dtype))

    def _queries(self, x, positions):
        """x (B, T, C) -> q_nope (B, H, T, qk_nope), q_rope (B, H, T, d_rope) after RoPE."""
        c, (B, T, _) = self.config, x.shape
        q = self.w_q(x) if c.q_lora_rank is None else self.w_uq(self.w_dq(x))
        q = q.view(B, T, c.n_heads, -1).transpose(1, 2)  # (B, H, T, qk_nope + d_rope)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        return q_nope, self._rope(q_rope, positions)

    def _latents(self, x, positions):
        """x (B, T, C) -> what each token caches: c_kv (B, T, d_c) and k_rope (B, T, d_rope) after RoPE."""
        return self.w_dkv(x), self._rope(self.w_kr(x)[:, None], positions)[:, 0]

    def _check_x(self, x, positions):
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != self.config.dim:
            raise ValueError(f"x must be (B, T, C={self.config.dim}), got {getattr(x, 'shape', type(x).__name__)}")
        B, T, _ = x.shape
        if positions is None:
            return torch.arange(T, device=x.device).expand(B, T)
        if not isinstance(positions, torch.Tensor) or tuple(positions.shape) != (B, T):
            raise ValueError(f"positions must be a (B, T) = {(B, T)} tensor, "
                             f"got {getattr(positions, 'shape', positions)}")
        return positions

    def forward(self, x, positions=None):
        """x (B, T, C) -> (B, T, C), attending causally over exactly these T tokens (positions default 0..T-1)."""
        positions = self._check_x(x, positions)
        c, (B, T, _) = self.config, x.shape
        H, d_rope = c.n_heads, c.qk_rope_head_dim
        q_nope, q_rope = self._queries(x, positions)
        c_kv, k_rope = self._latents(x, positions)
        k_nope = self.w_uk(c_kv).view(B, T, H, c.qk_nope_head_dim).transpose(1, 2)  # (B, H, T, qk_nope)
        k = torch.cat([k_nope, k_rope[:, None].expand(B, H, T, d_rope)], dim=-1)  # (B, H, T, qk_nope + d_rope)
        q = torch.cat([q_nope, q_rope], dim=-1)  # (B, H, T, qk_nope + d_rope)
        v = self.w_uv(c_kv).view(B, T, H, c.v_head_dim).transpose(1, 2)  # (B, H, T, d_v)
        scores = q @ k.transpose(-1, -2) / math.sqrt(c.qk_nope_head_dim + d_rope)  # (B, H, T, T)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        out = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v  # (B, H, T, d_v)
        return self.w_o(out.transpose(1, 2).reshape(B, T, H * c.v_head_dim))

    @torch.no_grad()
    def decode_absorbed(self, x_t, cache, positions=None):
        """One new token per sequence, x_t (B, 1, C) -> (B, 1, C), from a ``LatentKVCache`` of (c_kv, k_rope).

        Appends the token's c_kv and k_rope to the cache, then, without any per-head key or value:
        q_lat = q_nope W_uk (per head, d_c wide), scores = (q_lat . c_kv + q_rope . k_rope) / sqrt(qk_nope +
        d_rope), o_lat = p @ c_kv, out = W_o (o_lat W_uv^T). Every head reads the same cached rows: MQA with
        one K/V head of width d_c + d_rope. positions (B, 1): default each sequence's cached length.

        >>> cfg = MLAConfig(dim=32, n_heads=4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
        >>> with torch.random.fork_rng():
        ...     _ = torch.manual_seed(0)
        ...     attn, x = LatentAttention(cfg).eval(), torch.randn(2, 5, 32)
        >>> cache = LatentKVCache.for_layer(attn, batch=2, max_len=5)
        >>> steps = torch.cat([attn.decode_absorbed(x[:, t: t + 1], cache) for t in range(5)], dim=1)
        >>> torch.allclose(steps, attn(x), atol=1e-5)  # token by token from the latents == the plain forward
        True
        """
        if not isinstance(cache, LatentKVCache):
            raise TypeError(f"cache must be a LatentKVCache, got {type(cache).__name__}")
        c = self.config
        B = cache.seq_lens.shape[0]
        if not isinstance(x_t, torch.Tensor) or tuple(x_t.shape) != (B, 1, c.dim):
            raise ValueError(f"x_t must be (B={B}, 1, C={c.dim}): one new token per cached sequence, "
                             f"got {getattr(x_t, 'shape', type(x_t).__name__)}")
        if (cache.c_kv.shape[2], cache.k_rope.shape[2]) != (c.kv_lora_rank, c.qk_rope_head_dim):
            raise ValueError(f"cache holds (d_c, d_rope) = {(cache.c_kv.shape[2], cache.k_rope.shape[2])}, "
                             f"this layer needs {(c.kv_lora_rank, c.qk_rope_head_dim)}")
        positions = self._check_x(x_t, cache.next_positions() if positions is None else positions)
        H, d_c = c.n_heads, c.kv_lora_rank
        q_nope, q_rope = self._queries(x_t, positions)  # (B, H, 1, qk_nope), (B, H, 1, d_rope)
        cache.append(*self._latents(x_t, positions))
        S, lens = int(cache.seq_lens.max()), cache.seq_lens
        c_kv, k_rope = cache.c_kv[:, :S], cache.k_rope[:, :S]  # (B, S, d_c), (B, S, d_rope)
        w_uk = self.w_uk.weight.view(H, c.qk_nope_head_dim, d_c)  # per head: k_nope = w_uk[h] @ c_kv
        q_lat = torch.einsum("bhn,hnc->bhc", q_nope[:, :, 0], w_uk)  # (B, H, d_c): q_nope absorbed through W_uk
        scores = q_lat @ c_kv.transpose(1, 2) + q_rope[:, :, 0] @ k_rope.transpose(1, 2)  # (B, H, S)
        scores = scores / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim)
        past = torch.arange(S, device=x_t.device)[None, None, :] < lens[:, None, None]  # each sequence's own length
        o_lat = torch.softmax(scores.masked_fill(~past, float("-inf")), dim=-1) @ c_kv  # (B, H, d_c)
        w_uv = self.w_uv.weight.view(H, c.v_head_dim, d_c)
        out = torch.einsum("bhc,hvc->bhv", o_lat, w_uv)  # (B, H, d_v): W_uv applied after the softmax
        return self.w_o(out.reshape(B, 1, H * c.v_head_dim))


class LatentKVCache:
    """What one MLA layer caches per token: c_kv (d_c) and the shared RoPE key (d_rope), nothing per head.

    Buffers (B, S_max, d_c) and (B, S_max, d_rope), one length per sequence. It serves one
    ``LatentAttention`` (``decode_absorbed``); there is no MLA Transformer in kvlib to plug into generate.

    >>> cfg = MLAConfig(dim=32, n_heads=4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    >>> cache = LatentKVCache(cfg, batch=2, max_len=16)
    >>> tuple(cache.c_kv.shape), cache.bytes_per_token()  # (8 + 4) fp32 numbers for all 4 heads together
    ((2, 16, 8), 48)
    """

    def __init__(self, config: MLAConfig, batch, max_len, dtype=torch.float32, device="cpu"):
        if not isinstance(config, MLAConfig):
            raise TypeError(f"config must be an MLAConfig, got {type(config).__name__}")
        batch, self.max_len = check_int("batch", batch), check_int("max_len", max_len)
        self.c_kv = torch.zeros(batch, max_len, config.kv_lora_rank, dtype=dtype, device=device)  # (B, S_max, d_c)
        self.k_rope = torch.zeros(batch, max_len, config.qk_rope_head_dim, dtype=dtype, device=device)  # after RoPE
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)  # (B,) positions filled

    @classmethod
    def for_layer(cls, layer: LatentAttention, batch, max_len):
        w = layer.w_dkv.weight
        return cls(layer.config, batch, max_len, w.dtype, w.device)

    def append(self, c_kv, k_rope):
        """Write one token per sequence, c_kv (B, 1, d_c) and k_rope (B, 1, d_rope), after each one's length."""
        B = self.seq_lens.shape[0]
        for name, t, buf in (("c_kv", c_kv, self.c_kv), ("k_rope", k_rope, self.k_rope)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (B, 1, buf.shape[2]):
                raise ValueError(f"{name} must be (B={B}, 1, {buf.shape[2]}), got {getattr(t, 'shape', t)}")
        if int(self.seq_lens.max()) + 1 > self.max_len:
            raise CacheFullError(f"the latent cache holds {self.max_len} positions per sequence; it is full")
        rows, pos = torch.arange(B, device=self.c_kv.device), self.seq_lens.long()
        self.c_kv[rows, pos], self.k_rope[rows, pos] = c_kv[:, 0], k_rope[:, 0]
        self.seq_lens += 1

    def reset(self):
        self.seq_lens.zero_()

    def next_positions(self) -> torch.Tensor:
        """(B, 1) position of each sequence's next token."""
        return self.seq_lens.long()[:, None]

    def nbytes(self) -> int:
        return self.c_kv.nbytes + self.k_rope.nbytes

    def bytes_per_token(self) -> int:
        """Bytes one cached token takes in this layer."""
        return self.nbytes() // (self.seq_lens.shape[0] * self.max_len)

    def held(self, b: int) -> int:
        return int(self.seq_lens[b])


# Real MLA models: numbers from each model's config.json on Hugging Face (hidden_size, num_hidden_layers,
# num_attention_heads, kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim):
#   https://huggingface.co/deepseek-ai/DeepSeek-V2/blob/main/config.json
#   https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json  (no query compression:
#       q_lora_rank null, as the paper's appendix on V2-Lite says)
#   https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json
MLA_CONFIGS = {
    "DeepSeek-V2": dict(n_layers=60, source="https://huggingface.co/deepseek-ai/DeepSeek-V2/blob/main/config.json",
                        config=MLAConfig(dim=5120, n_heads=128, kv_lora_rank=512, qk_nope_head_dim=128,
                                         qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536)),
    "DeepSeek-V2-Lite": dict(n_layers=27,
                             source="https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json",
                             config=MLAConfig(dim=2048, n_heads=16, kv_lora_rank=512, qk_nope_head_dim=128,
                                              qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=None)),
    "DeepSeek-V3": dict(n_layers=61, source="https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json",
                        config=MLAConfig(dim=7168, n_heads=128, kv_lora_rank=512, qk_nope_head_dim=128,
                                         qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536)),
}


def _check_mla_args(config, n_layers):
    if not isinstance(config, MLAConfig):
        raise TypeError(f"config must be an MLAConfig (e.g. MLA_CONFIGS['DeepSeek-V2']['config']), got "
                        f"{type(config).__name__}")
    return check_int("n_layers", n_layers)


def mla_bytes_per_token(config: MLAConfig, n_layers: int, dtype="bf16") -> int:
    """Bytes one token takes in an MLA model's cache: n_layers x (d_c + d_rope) numbers.

    >>> m = MLA_CONFIGS["DeepSeek-V2"]
    >>> mla_bytes_per_token(m["config"], m["n_layers"])  # 60 x (512 + 64) x 2 bytes
    69120
    """
    n_layers = _check_mla_args(config, n_layers)
    return n_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * dtype_bytes(dtype)


def mha_bytes_per_token(config: MLAConfig, n_layers: int, n_kv_heads: int | None = None, head_dim: int | None = None,
                        dtype="bf16") -> int:
    """Bytes per token of ordinary attention with the same layers and heads, K and V materialized:
    n_kv_heads x (qk_nope + qk_rope) for K plus n_kv_heads x v_head_dim for V, per layer.

    n_kv_heads: None is MHA (n_heads K/V heads); g is GQA with g groups. head_dim: one dim for K and V
    heads instead (the paper's d_h, which leaves out the RoPE part).

    >>> m = MLA_CONFIGS["DeepSeek-V2"]
    >>> cfg, L = m["config"], m["n_layers"]
    >>> print(f"MLA = {mla_bytes_per_token(cfg, L):,} bytes/token vs MHA {mha_bytes_per_token(cfg, L):,} "
    ...       f"vs GQA-8 {mha_bytes_per_token(cfg, L, n_kv_heads=8):,}")
    MLA = 69,120 bytes/token vs MHA 4,915,200 vs GQA-8 307,200
    """
    n_layers = _check_mla_args(config, n_layers)
    g = config.n_heads if n_kv_heads is None else check_int("n_kv_heads", n_kv_heads)
    k_dim = config.qk_nope_head_dim + config.qk_rope_head_dim if head_dim is None else check_int("head_dim", head_dim)
    v_dim = config.v_head_dim if head_dim is None else head_dim
    return n_layers * g * (k_dim + v_dim) * dtype_bytes(dtype)


def mla_gqa_groups(config: MLAConfig, head_dim: int | None = None) -> float:
    """How many GQA groups (K/V heads of ``head_dim`` for K and V) store as much per token as MLA.

    The paper's d_h (default: qk_nope_head_dim = 128 for DeepSeek-V2) gives its 2.25 (section 2.1.4:
    (d_c + d_rope) = 4.5 d_h); counting the 192-dim keys MLA materializes instead gives 576 / 320 = 1.8.

    >>> cfg = MLA_CONFIGS["DeepSeek-V2"]["config"]
    >>> mla_gqa_groups(cfg)  # the paper's number
    2.25
    >>> mla_bytes_per_token(cfg, 1) / mha_bytes_per_token(cfg, 1, n_kv_heads=1)  # K heads of 128 + 64
    1.8
    """
    d_h = config.qk_nope_head_dim if head_dim is None else head_dim
    return mla_bytes_per_token(config, 1) / mha_bytes_per_token(config, 1, n_kv_heads=1, head_dim=d_h)


# --------------------------------------------------------------------------------------------
# 3. Cross-layer KV sharing (CLA, Brandon et al. 2024, arXiv:2405.12981)
# --------------------------------------------------------------------------------------------


class SharedKVSeam:
    """A seam object (``model(ids, cache=SharedKVSeam(share))``) with no buffers: in each group of
    ``share`` adjacent layers (0..share-1, share..2*share-1, ...), the first layer attends causally
    over its own k, v and keeps them; the others ignore their own k, v and reuse the first's.
    Gradients flow through the kept tensors, so a model can be fine-tuned this way
    (``finetune_shared``). The model still computes the unused projections: a CLA model built from
    scratch would not have them. ``Transformer.forward`` builds no mask when given a seam object, so
    this one does causal attention itself, over exactly the tokens of the call.

    >>> model = _tiny_model()
    >>> ids = torch.tensor([[1, 2, 3, 4]])
    >>> torch.allclose(model(ids, cache=SharedKVSeam(1)), model(ids), atol=1e-5)  # share=1: the plain model
    True
    >>> bool((model(ids, cache=SharedKVSeam(2)) - model(ids)).abs().max() > 1e-3)  # layer 1 reads layer 0's K/V
    True
    """

    def __init__(self, share: int = 2):
        self.share = check_int("share", share)
        self._kv = None  # (layer index of the group's first layer, its k, its v)

    def attend(self, layer_idx, q, k, v):
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx must be an int >= 0, got {layer_idx!r}")
        first = layer_idx - layer_idx % self.share
        if layer_idx == first:
            self._kv = (first, k, v)
        elif self._kv is None or self._kv[0] != first:
            raise ValueError(f"layer {layer_idx} reuses layer {first}'s K/V, but layer {first} has not run just before "
                             "it in this forward pass")
        _, k, v = self._kv
        return attention_ref(q, k, v, causal=True)  # (B, H, T, D); handles H_KV < H


class CrossLayerKVCache(KVCache):
    """A contiguous cache for a model whose layers share K/V in groups of ``share`` (CLA).

    Layers 0, share, 2*share, ... store their K/V; the other layers of each group ignore their own k, v
    and attend over their group's cache (which already holds the current tokens: the group's first layer
    ran just before). So it holds ceil(n_layers / share) layers: 1/share of the bytes (an odd layer count
    keeps the last group smaller). Its tokens match the model run through ``SharedKVSeam(share)``.

    >>> model = _tiny_model(n_layers=3)
    >>> cache = CrossLayerKVCache.for_model(model, batch=1, max_len=8, share=2)
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> with torch.no_grad():
    ...     same = torch.allclose(model(ids, cache=cache), model(ids, cache=SharedKVSeam(2)), atol=1e-5)
    >>> same, len(cache.k), cache.bytes_per_token()  # 3 layers, 2 stored: (0, 1) share, 2 alone; 2 x K,V x 2 x 16 x 4 B
    (True, 2, 512)
    """

    def __init__(self, n_layers, batch, n_kv_heads, max_len, head_dim, share=2, dtype=torch.float32, device="cpu",
                 kernels=None):
        n_layers, share = check_int("n_layers", n_layers), check_int("share", share)
        if share > n_layers:
            raise ValueError(f"share must lie in 1..n_layers={n_layers}, got {share}")
        super().__init__(-(-n_layers // share), batch, n_kv_heads, max_len, head_dim, dtype, device, kernels)
        self.share, self.n_layers = share, n_layers  # self.k / self.v: one entry per group

    @classmethod
    def for_model(cls, model, batch, max_len, share=2, kernels=None):
        c = model.config
        return cls(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, share, model.dtype, model.device, kernels)

    def _check_attend(self, layer_idx, q, k, v, kv_dtype):
        B, H_KV, _, D = self.k[0].shape
        check_attend_args(layer_idx, q, k, v, n_layers=self.n_layers, batch=B, n_kv_heads=H_KV, head_dim=D,
                          kv_dtype=kv_dtype, batch_is=f"the cache holds B={B} sequence(s)")

    def _advance(self, layer_idx: int, T: int):
        if layer_idx == self.n_layers - 1:  # after the model's last layer, not the last stored group
            self.seq_lens += T

    # KVCache.attend, with a group's buffers: the group's first layer stores, the others read what it stored
    # (these T tokens included)
    def _buffers(self, layer_idx):
        group = layer_idx // self.share
        return self.k[group], self.v[group]

    def _stores(self, layer_idx) -> bool:
        return layer_idx % self.share == 0


class _ThroughSeam(nn.Module):
    """``model`` whose forward(ids) runs through a fresh ``SharedKVSeam(share)``, so that kvlib.gqa.finetune
    and kvlib.train.evaluate (which call ``model(x)``) train and score the shared model unchanged."""

    def __init__(self, model, share):
        super().__init__()
        share = check_int("share", share)
        if share > model.config.n_layers:
            raise ValueError(f"share must lie in 1..n_layers={model.config.n_layers}, got {share}")
        self.model, self.share = model, share

    @property
    def device(self):
        return self.model.device

    def forward(self, ids):
        return self.model(ids, cache=SharedKVSeam(self.share))


def finetune_shared(model, train_ids: torch.Tensor, steps: int = 60, share: int = 2, batch: int = 8,
                    seq_len: int = 128, lr: float = 5e-4, seed: int = 0, progress: bool = False) -> list[float]:
    """``kvlib.gqa.finetune`` (the same seeded AdamW loop, the same windows for the same seed) with every
    forward pass through ``SharedKVSeam(share)``; trains ``model`` in place, returns the batch losses.

    >>> model = _tiny_model()
    >>> losses = finetune_shared(model, torch.arange(200) % 16, steps=3, batch=2, seq_len=16)
    >>> len(losses), losses[-1] < losses[0]
    (3, True)
    """
    return finetune(_ThroughSeam(model, share), train_ids, steps=steps, batch=batch, seq_len=seq_len, lr=lr,
                    seed=seed, progress=progress)


def evaluate_shared(model, ids: torch.Tensor, seq_len: int, share: int = 2, max_windows: int = 64) -> float:
    """``kvlib.train.evaluate`` (mean next-token cross-entropy, nats per byte for the tiny model, over up
    to ``max_windows`` evenly spaced windows) with the model run through ``SharedKVSeam(share)``.

    >>> from kvlib.train import evaluate
    >>> model, ids = _tiny_model(), torch.arange(200) % 16
    >>> abs(evaluate_shared(model, ids, 16, share=1) - evaluate(model, ids, 16)) < 1e-5  # share=1: unchanged
    True
    """
    return evaluate(_ThroughSeam(model, share), ids, seq_len, max_windows=max_windows)
