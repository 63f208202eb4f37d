"""Keeping fewer bits (chapter 09): asymmetric quantization and packing, and mixed precision by layer.

What you will learn:
- asymmetric (min/max) quantization: over a group of numbers ``zero = min``, ``scale = (max - min) /
  (2**bits - 1)``, ``q = round((x - zero) / scale)`` in 0 .. 2**bits - 1 and ``x ≈ q * scale + zero``,
  within half a step. A zero point spends the few levels on the range the group really has (chapter 06's
  symmetric absmax wastes half of them on a sign when a group is all positive); with 2 bits there are 4;
- packing: four 2-bit codes per byte (``pack_bits``), the layout ``kvlib.kivi`` stores and reads;
- the two groupings KIVI chooses between: keys per channel over a group of tokens
  (``quantize_keys_per_channel``), values per token (``quantize_values_per_token``);
- mixed precision by layer: measure what quantizing one layer's K/V does to the next-token
  distribution (``layer_sensitivity``, a KL divergence) and give the bits to the layers that need them
  (``plan_bits``, within a budget of bits or of bytes; 16 keeps a layer unquantized). ``LayerQuantCache``
  *simulates* it, keys per channel in groups of tokens and values per token as KIVI does (or keys per
  token, the contrast): it stores the dequantized values in the model's dtype and computes the bytes the
  real layout would take, scales and zeros included.

KIVI's cache and its decode kernel are in ``kvlib.kivi``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .cache import KVCache, check_int
from .quant import _dims

__all__ = ["quantize_asym", "dequantize_asym", "pack_bits", "unpack_bits", "pack_2bit", "unpack_2bit",
           "quantize_keys_per_channel", "quantize_values_per_token", "LayerQuantCache", "kl_divergence",
           "layer_sensitivity", "plan_bits"]

PACKED_BITS = (2, 4, 8)  # code widths that fill a byte exactly: 4, 2 or 1 codes per byte
LAYER_BITS = (16, 8, 4, 2)  # LayerQuantCache: 16 = not quantized (counted as fp16)


def _check_bits(bits, allowed=PACKED_BITS) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in allowed:
        raise ValueError(f"bits must be one of {allowed}, got {bits!r}")
    return bits


# --------------------------------------------------------------------------------------------
# Asymmetric quantization and packing (plain PyTorch)
# --------------------------------------------------------------------------------------------


def quantize_asym(x: torch.Tensor, bits: int, dim=-1):
    """Asymmetric b-bit quantization, one (scale, zero) per group; the min and max run over ``dim``.

    Returns (q uint8 in 0..2**bits - 1, scale, zero), scale and zero fp32 with x's rank (size 1 along
    ``dim``) so that ``q * scale + zero`` broadcasts back. A constant group gets scale 1 and q = 0, so it
    comes back exactly. ``dim``: an int, a tuple, or None (the whole tensor), as in ``quantize_int8``.

    >>> x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [-1.0, -1.0, -1.0, -1.0]])
    >>> q, scale, zero = quantize_asym(x, bits=2, dim=-1)  # one scale and zero per row
    >>> q
    tensor([[0, 1, 2, 3],
            [0, 0, 0, 0]], dtype=torch.uint8)
    >>> scale.flatten().tolist(), zero.flatten().tolist()  # the constant row: scale 1, zero = its value
    ([1.0, 1.0], [0.0, -1.0])
    """
    bits = _check_bits(bits)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if not torch.isfinite(x).all():
        raise ValueError("x contains NaN or inf; min/max quantization needs finite values")
    dims, x32, qmax = _dims(x, dim), x.float(), 2 ** bits - 1
    zero = x32.amin(dim=dims, keepdim=True)
    scale = (x32.amax(dim=dims, keepdim=True) - zero) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: q = 0, x = zero
    q = torch.round((x32 - zero) / scale).clamp(0, qmax).to(torch.uint8)
    return q, scale, zero


def dequantize_asym(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype=torch.float32):
    """q * scale + zero in ``dtype`` (computed in fp32); scale and zero have q's rank, each dim q's or 1.

    >>> x = torch.tensor([[0.1, 0.5, 1.3, 2.2]])
    >>> q, scale, zero = quantize_asym(x, bits=2, dim=-1)  # zero 0.1, scale (2.2 - 0.1) / 3 = 0.7
    >>> q.tolist(), dequantize_asym(q, scale, zero)  # each value within half a step (0.35) of x
    ([[0, 1, 2, 3]], tensor([[0.1000, 0.8000, 1.5000, 2.2000]]))
    """
    if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8:
        raise TypeError(f"q must be a uint8 tensor of codes, got {getattr(q, 'dtype', type(q).__name__)}")
    for name, t in (("scale", scale), ("zero", zero)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != q.dim() or any(s not in (1, n) for s, n in zip(t.shape, q.shape)):
            raise ValueError(f"{name} of shape {tuple(t.shape)} does not match codes of shape {tuple(q.shape)}: "
                             "it needs the same rank, each dim equal or 1 (the group)")
    return (q.float() * scale.float() + zero.float()).to(dtype)


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., D) uint8 codes of ``bits`` bits -> (..., D * bits / 8) uint8, 8 // bits codes per byte.

    Code j of a byte sits in bits ``bits * j`` .. ``bits * j + bits - 1`` (the first code lowest).

    >>> pack_bits(torch.tensor([3, 12], dtype=torch.uint8), bits=4)  # 3 + 12 * 16
    tensor([195], dtype=torch.uint8)
    """
    bits = _check_bits(bits)
    per = 8 // bits
    if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8:
        raise TypeError(f"q must be a uint8 tensor of codes, got {getattr(q, 'dtype', type(q).__name__)}")
    if q.dim() < 1 or q.shape[-1] % per:
        raise ValueError(f"q's last dim must be a multiple of {per} to pack {per} {bits}-bit codes per byte, "
                         f"got shape {tuple(q.shape)}")
    if q.numel() and int(q.max()) > 2 ** bits - 1:
        raise ValueError(f"q must hold {bits}-bit codes (0..{2 ** bits - 1}), got a {int(q.max())}")
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per)  # (..., D / per, per): the codes of each byte
    packed = torch.zeros(q.shape[:-1], dtype=torch.uint8, device=q.device)
    for j in range(per):
        packed |= q[..., j] << (bits * j)
    return packed


def unpack_bits(p: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of ``pack_bits``: (..., D * bits / 8) uint8 -> (..., D) uint8 codes.

    >>> unpack_bits(torch.tensor([195], dtype=torch.uint8), bits=4)
    tensor([ 3, 12], dtype=torch.uint8)
    """
    bits = _check_bits(bits)
    if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8 or p.dim() < 1:
        raise TypeError(f"p must be a uint8 tensor of packed codes with at least one dim, got "
                        f"{getattr(p, 'dtype', type(p).__name__)}")
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=p.device)  # (per,): where code j sits
    return ((p[..., None] >> shifts) & (2 ** bits - 1)).flatten(-2)


def pack_2bit(q: torch.Tensor) -> torch.Tensor:
    """(..., D) codes in 0..3 -> (..., D / 4) bytes; value j of a byte in bits 2j, 2j + 1.

    >>> pack_2bit(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8))  # 1 + 2*4 + 3*16 + 0*64
    tensor([[57]], dtype=torch.uint8)
    """
    return pack_bits(q, 2)


def unpack_2bit(p: torch.Tensor) -> torch.Tensor:
    """(..., D / 4) bytes -> (..., D) codes in 0..3; the inverse of ``pack_2bit``.

    >>> unpack_2bit(torch.tensor([[57]], dtype=torch.uint8))
    tensor([[1, 2, 3, 0]], dtype=torch.uint8)
    """
    return unpack_bits(p, 2)


def _check_kv(name: str, x) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"{name} must be a (B, H_KV, S, D) tensor, got {getattr(x, 'shape', type(x).__name__)}")


def quantize_keys_per_channel(k: torch.Tensor, group: int, bits: int = 2):
    """KIVI's keys: per channel over each group of ``group`` consecutive tokens.

    k (B, H_KV, S, D) with S a multiple of group -> (codes (B, H_KV, S, D) uint8, scale, zero), scale and
    zero fp32 (B, H_KV, S / group, D): one per (group of tokens, channel).

    >>> k = torch.tensor([[[[0.0, 1.0], [3.0, 7.0], [10.0, 2.0], [13.0, 2.0]]]])  # (B, H_KV, S, D) = (1, 1, 4, 2)
    >>> q, scale, zero = quantize_keys_per_channel(k, group=2)  # 2 groups of 2 tokens, a scale per channel
    >>> q[0, 0].tolist(), scale[0, 0].tolist(), zero[0, 0].tolist()  # the last group's channel 1 is constant
    ([[0, 0], [3, 3], [0, 0], [3, 0]], [[1.0, 2.0], [1.0, 1.0]], [[0.0, 1.0], [10.0, 2.0]])
    """
    _check_kv("k", k)
    group = check_int("group", group)
    B, H_KV, S, D = k.shape
    if S % group:
        raise ValueError(f"k holds S={S} tokens, which must be a multiple of group={group}")
    groups = k.reshape(B, H_KV, S // group, group, D)  # (B, H_KV, groups, tokens of a group, D)
    q, scale, zero = quantize_asym(groups, bits, dim=3)  # min and max over a group's tokens, per channel
    return q.reshape(B, H_KV, S, D), scale[:, :, :, 0], zero[:, :, :, 0]


def quantize_values_per_token(v: torch.Tensor, bits: int = 2):
    """KIVI's values: one (scale, zero) per token and head, over its D channels.

    v (B, H_KV, S, D) -> (codes (B, H_KV, S, D) uint8, scale, zero), scale and zero fp32 (B, H_KV, S, 1).

    >>> q, scale, zero = quantize_values_per_token(torch.tensor([[[[0.0, 3.0], [1.0, 1.0]]]]))
    >>> q[0, 0].tolist(), scale.flatten().tolist(), zero.flatten().tolist()
    ([[0, 3], [0, 0]], [1.0, 1.0], [0.0, 1.0])
    """
    _check_kv("v", v)
    return quantize_asym(v, bits, dim=-1)


# --------------------------------------------------------------------------------------------
# Mixed precision by layer (a simulation) and how to choose it
# --------------------------------------------------------------------------------------------


def _round_trip(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x quantized per row of D (fp16 scale and zero, as a real cache would store them) and back, in x's dtype."""
    q, scale, zero = quantize_asym(x, bits, dim=-1)
    return dequantize_asym(q, scale.half(), zero.half(), x.dtype)


def _round_trip_keys_per_channel(k: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """k (B, H_KV, S, D), S a multiple of group: quantized per channel over each group of tokens (fp16 scale
    and zero) and back, in k's dtype."""
    q, scale, zero = quantize_keys_per_channel(k, group, bits)
    scale, zero = scale.half().repeat_interleave(group, 2), zero.half().repeat_interleave(group, 2)  # per token
    return dequantize_asym(q, scale, zero, k.dtype)


KEY_LAYOUTS = ("per_channel", "per_token")  # LayerQuantCache's keys: KIVI's grouping, or one scale per row


class LayerQuantCache(KVCache):
    """Mixed precision by layer, *simulated*: ``bits[i]`` is layer i's format, 16 = kept as is (counted as
    fp16), 8 / 4 / 2 = asymmetric quantization with fp16 scales and zeros:

    - values: per token, one (scale, zero) per row of D, quantized as they arrive;
    - keys, ``keys="per_channel"`` (the default, KIVI's grouping: Liu et al. 2024, "KIVI: A Tuning-Free
      Asymmetric 2bit Quantization for KV Cache", arXiv:2402.02750): one (scale, zero) per channel over each
      group of ``group`` consecutive tokens, so an outlier channel only widens its own scale. A group can
      only be quantized once its ``group`` tokens exist: the newest, partial group is kept exact, like
      KIVI's full-precision residual, and counted at 16 bits in ``bytes_per_token(length=...)``; when a call
      completes a group, the group is quantized before that call attends (what is stored is what is read).
      KIVI keeps a residual of up to R tokens (R >= group) and its newest values in full precision too;
      here the residual is only the partial group, and values are quantized at once.
    - a call always attends over what is stored, the prefill too (as the per-token layout did before): a
      real quantized cache (KIVI) attends over the prompt's full-precision K/V during the prefill and
      quantizes afterwards, so this simulation is the stricter of the two on the prompt's own tokens.
    - keys, ``keys="per_token"``: like the values, one (scale, zero) per row - the contrast KIVI rejects,
      since a few outlier channels set every row's range.

    Every K/V row is quantized and dequantized on store, and the *dequantized* values are stored in the
    model's dtype (KVCache's buffers): the model sees exactly the values a real layout would give back, but
    the memory is not saved (``nbytes``). ``bytes_per_token`` is what the real layout would take.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> with torch.random.fork_rng():
    ...     _ = torch.manual_seed(0)
    ...     model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = LayerQuantCache.for_model(model, batch=1, max_len=40, bits=[16, 2])  # layer 1: 2 bits, groups of 32
    >>> with torch.no_grad():
    ...     logits = model(torch.arange(40)[None] % 16, cache=cache)
    >>> k = cache.k[1][0, 0]  # (S_max, D): K/V head 0 of layer 1
    >>> k[:32, 0].unique().numel() <= 4, k[32:, 0].unique().numel()  # group 0 quantized per channel; 8 newest exact
    (True, 8)
    >>> cache.bytes_per_token()  # 2*2*(16*2) + 2*(16*2/8 + 2*2*16/32) + 2*(16*2/8 + 4)
    156.0
    >>> cache.bytes_per_token(length=40)  # with the 8 exact keys of the partial group: layer 1 costs 38.4
    166.4
    """

    shared_attrs = ("bits",)  # one format per layer, the same for every sequence

    def __init__(self, n_layers, batch, n_kv_heads, max_len, head_dim, bits, dtype=torch.float32, device="cpu",
                 kernels=None, *, keys="per_channel", group=32):
        super().__init__(n_layers, batch, n_kv_heads, max_len, head_dim, dtype, device, kernels)
        if isinstance(bits, (str, bytes)) or not hasattr(bits, "__len__") or len(bits) != len(self.k):
            raise ValueError(f"bits must be a list with one entry per layer ({len(self.k)}), got {bits!r}")
        self.bits = tuple(_check_bits(b, LAYER_BITS) for b in bits)
        if keys not in KEY_LAYOUTS:
            raise ValueError(f"keys must be one of {KEY_LAYOUTS} (how keys are grouped), got {keys!r}")
        self.keys, self.group = keys, check_int("group", group)

    @classmethod
    def for_model(cls, model, batch, max_len, bits, kernels=None, *, keys="per_channel", group=32):
        c = model.config
        return cls(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, bits, model.dtype, model.device, kernels,
                   keys=keys, group=group)

    def layer_bytes(self, bits: int) -> float:
        """Bytes per cached token one layer takes in format ``bits`` (all its K/V heads, K and V), with the
        keys' partial group left out: 16 -> D * 2 each; otherwise D * bits / 8 each, plus for the values an
        fp16 scale and zero per token (4 bytes) and for the keys 4 bytes per token ("per_token") or an fp16
        scale and zero per channel per group (4 * D / group bytes per token, "per_channel")."""
        bits = _check_bits(bits, LAYER_BITS)
        _, H_KV, _, D = self.k[0].shape
        if bits == 16:
            return float(2 * H_KV * D * 2)
        key_scales = 4 * D / self.group if self.keys == "per_channel" else 4
        return float(H_KV * (D * bits / 8 + key_scales) + H_KV * (D * bits / 8 + 4))

    def bytes_per_token(self, length: int | None = None) -> float:
        """What the real layout would take per cached token, summed over layers (``layer_bytes``).

        length: None gives the rate of a long sequence (the partial group's share goes to 0); a length n
        gives the average over n tokens when the newest n % group keys of each per-channel layer are still
        exact (counted as fp16, D * 2 bytes per K/V head) and the rest quantized."""
        total = sum(self.layer_bytes(b) for b in self.bits)
        if length is None:
            return float(total)
        n = check_int("length", length)
        _, H_KV, _, D = self.k[0].shape
        if self.keys == "per_channel":
            exact = n % self.group  # keys of the partial group: fp16 instead of codes + their scales
            for b in self.bits:
                if b < 16:
                    quant_keys = H_KV * (D * b / 8 + 4 * D / self.group)
                    total += exact * (H_KV * D * 2 - quant_keys) / n
        return float(total)

    def _quantize_completed_groups(self, layer_idx, start, T):
        """Per-channel keys: quantize (in place) every group of ``group`` tokens this call completed."""
        G, bits, k_cache = self.group, self.bits[layer_idx], self.k[layer_idx]
        for b, s in enumerate(start.tolist()):
            first, end = s // G, (s + T) // G  # groups first .. end-1 are complete now; those before first were done
            if end > first:
                rows = k_cache[b: b + 1, :, first * G: end * G]
                rows.copy_(_round_trip_keys_per_channel(rows, G, bits))

    def attend(self, layer_idx, q, k, v):
        self._check_attend(layer_idx, q, k, v, self.k[0].dtype)
        bits = self.bits[layer_idx]
        if bits < 16:
            v = _round_trip(v, bits)
            if self.keys == "per_token":
                k = _round_trip(k, bits)
        return super().attend(layer_idx, q, k, v)  # per-channel keys: _stored quantizes the completed groups

    def _stored(self, layer_idx, start, T):
        if self.bits[layer_idx] < 16 and self.keys == "per_channel":
            self._quantize_completed_groups(layer_idx, start, T)


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over rows of KL(P || Q) in nats, P = softmax(p_logits) (the reference), Q = softmax(q_logits).

    >>> p = torch.tensor([[2.0, 0.0], [0.0, 0.0]])
    >>> kl_divergence(p, p), round(kl_divergence(p, torch.zeros(2, 2)), 4)
    (0.0, 0.1639)
    """
    for name, t in (("p_logits", p_logits), ("q_logits", q_logits)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < 1:
            got = getattr(t, "dtype", type(t).__name__)
            raise TypeError(f"{name} must be a floating-point tensor (..., V), got {got}")
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"p_logits and q_logits must have one shape, got {tuple(p_logits.shape)} and "
                         f"{tuple(q_logits.shape)}")
    log_p = F.log_softmax(p_logits.double(), dim=-1)
    log_q = F.log_softmax(q_logits.double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    return max(0.0, kl)  # >= 0 in exact arithmetic; rounding can leave -1e-17 where P and Q agree


@torch.no_grad()
def layer_sensitivity(model, ids, bits: int = 2, progress: bool = False, *, keys: str = "per_channel",
                      group: int = 32) -> list[float]:
    """For each layer: the mean KL divergence (nats per token) of the next-token distribution when only that
    layer's K/V are quantized to ``bits`` (``LayerQuantCache`` with ``keys`` and ``group``), teacher-forced
    over the token ids ``ids``.

    The reference P is the same forward with every layer at 16 (a full-precision cache). One forward of
    ``ids`` (a 1-D list or tensor) per layer. With per-channel keys, the last len(ids) % group keys stay
    exact (``LayerQuantCache``).

    >>> from kvlib.model import ModelConfig, Transformer
    >>> with torch.random.fork_rng():
    ...     _ = torch.manual_seed(0)
    ...     model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> sens = layer_sensitivity(model, [1, 5, 2, 7, 3, 9], bits=2, group=2)
    >>> len(sens), all(s >= 0 for s in sens)
    (2, True)
    """
    _check_bits(bits, LAYER_BITS)
    ids = torch.as_tensor(ids)
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point():
        raise ValueError(f"ids must be a non-empty 1-D list or tensor of token ids, got {tuple(ids.shape)} {ids.dtype}")
    x = ids.long()[None].to(model.device)  # (1, T)
    n_layers = model.config.n_layers

    def logits_with(layer_bits):
        cache = LayerQuantCache.for_model(model, 1, x.shape[1], layer_bits, keys=keys, group=group)
        return model(x, cache=cache)[0]  # (T, V)

    full = logits_with([16] * n_layers)
    layers = range(n_layers)
    if progress:
        from tqdm.auto import tqdm

        layers = tqdm(layers, desc=f"{bits}-bit sensitivity per layer", leave=False)
    return [kl_divergence(full, logits_with([bits if i == layer else 16 for i in range(n_layers)]))
            for layer in layers]


def plan_bits(sensitivity, budget_bits: float | None = None, choices=(8, 4, 2), *, budget_bytes: float | None = None,
              layer_bytes=None) -> list[int]:
    """A bits-per-layer plan within a budget, the wider formats to the more sensitive layers.

    The budget is either ``budget_bits``, the average bits per layer, or ``budget_bytes``, the bytes per
    token of the whole plan, with ``layer_bytes`` {bits: bytes per token of one layer in that format} for
    every choice (``LayerQuantCache.layer_bytes``, which counts scales and zeros: at equal bits a 2-bit
    layer pays relatively more for them than an 8-bit one, so equal bytes is the fair comparison).
    ``choices`` may include 16, a layer kept unquantized ("FP16 for the important layers").

    Greedy, in rounds: every layer starts at the narrowest choice; each round visits the layers from the
    most sensitive down and moves each one step up, to the next wider choice, if the plan still fits the
    budget; rounds repeat until nothing moves. One step at a time, because the first extra bits buy the
    most (the quantization step halves with every bit): on the tiny model, 4 bits everywhere beats
    8 + 4 + 2 + 2 at the same budget. A more sensitive layer never gets fewer bits than a less sensitive
    one; part of the budget may stay unspent when no step fits.

    >>> plan_bits([0.1, 0.5, 0.2, 0.05], budget_bits=5)  # round 1: every layer 2 -> 4; round 2: layer 1 -> 8
    [4, 8, 4, 4]
    >>> cost = {16: 768.0, 8: 420.0, 4: 228.0, 2: 132.0}  # SmolLM2's bytes/token of a layer, keys per channel, G=32
    >>> plan_bits([0.1, 0.5, 0.2, 0.05], choices=(16, 2), budget_bytes=4 * 420.0, layer_bytes=cost)  # 4 x INT8's bytes
    [2, 16, 2, 2]
    """
    sens = [float(s) for s in sensitivity]
    if not sens or any(not math.isfinite(s) for s in sens):
        raise ValueError(f"sensitivity must be a non-empty list of finite numbers, one per layer, got {sensitivity!r}")
    choices = sorted({_check_bits(c, LAYER_BITS) for c in choices})  # narrowest first
    if (budget_bits is None) == (budget_bytes is None):
        raise ValueError("give one budget: budget_bits (average bits per layer) or budget_bytes (bytes per token)")
    if budget_bits is not None:
        if isinstance(budget_bits, bool) or not isinstance(budget_bits, (int, float)) or not budget_bits >= choices[0]:
            raise ValueError(f"budget_bits must be a number >= the narrowest choice {choices[0]}, got {budget_bits!r}")
        if layer_bytes is not None:
            raise ValueError("layer_bytes goes with budget_bytes; budget_bits counts bits")
        cost = {c: float(c) for c in choices}
        allowance = budget_bits * len(sens)  # total bits over all layers
    else:
        if not isinstance(layer_bytes, dict) or any(c not in layer_bytes for c in choices):
            raise ValueError(f"budget_bytes needs layer_bytes, a dict {{bits: bytes per token of one layer}} for every "
                             f"choice {tuple(choices)}, got {layer_bytes!r}")
        cost = {c: float(layer_bytes[c]) for c in choices}
        if any(not math.isfinite(cost[c]) or cost[c] <= 0 for c in choices) or \
                any(cost[a] >= cost[b] for a, b in zip(choices, choices[1:])):
            raise ValueError(f"layer_bytes must give positive costs that grow with the bits, got {layer_bytes!r}")
        floor = cost[choices[0]] * len(sens)
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) or \
                not budget_bytes >= floor * (1 - 1e-12):
            raise ValueError(f"budget_bytes must be a number >= {floor:g}, every layer at the narrowest choice "
                             f"{choices[0]}, got {budget_bytes!r}")
        allowance = float(budget_bytes)
    slack = 1e-9 * allowance  # sums of float costs: a plan that spends exactly the budget fits
    plan = [choices[0]] * len(sens)
    order = sorted(range(len(sens)), key=lambda i: -sens[i])  # most sensitive first (ties: the lower layer)
    moved = True
    while moved:
        moved = False
        for layer in order:
            wider = [c for c in choices if c > plan[layer]]
            spent = sum(cost[b] for b in plan)
            if wider and spent - cost[plan[layer]] + cost[wider[0]] <= allowance + slack:
                plan[layer], moved = wider[0], True
    return plan
