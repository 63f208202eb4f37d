"""Chapter 06's harness: what the INT8 notebook measures, kept out of its cells so they stay short.

- Recording what a model caches: ``RecordKV`` (the cache seam, chapter 03), ``record_real`` (SmolLM2's K before
  and after RoPE, its V and its full-precision logits, through forward hooks).
- Granularity: ``error_table`` (relative error of K and V at each granularity, mean over layers),
  ``channel_max`` / ``rope_partners`` (the largest key channels and which channel RoPE turns each with),
  ``outlier_table`` (largest channel max / median channel max, SmolLM2), ``static_vs_dynamic``.
- Memory: ``cache_bytes`` (the bytes of live caches, counted from their tensors).
- Quality: ``FakeQuantKV`` (quantize a layer's whole K and V, then attend), ``heldout_ids``,
  ``perplexity_change`` (teacher-forced over windows of held-out text, a bootstrap interval over blocks of
  tokens), ``free_running``.
- Tools: ``hf_side_by_side`` (transformers' quantized caches beside ours, on SmolLM2), ``fp8_table``.
- The lab's decision: ``axis_evidence`` and ``check_axis_choice`` (which axis to quantize K and V along).

Nothing here prints a verdict: the notebook shows the numbers, its markdown says what they mean.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .. import runtime
from ..cache import KVCache
from ..model import apply_rope
from ..quant import Int8KVCache, dequantize_int8, quantize_int8, store_kv_int8_ref
from ..stats import wilson  # noqa: F401  (the notebook calls ch06.wilson)

__all__ = ["RecordKV", "rel_error", "roundtrip", "GRANULARITY", "SHARED", "KIVI", "error_table", "channel_max",
           "rope_partners", "plot_channel_max", "record_real", "outlier_table", "plot_real_outliers",
           "static_vs_dynamic", "cache_bytes", "FakeQuantKV", "SCHEMES", "shared_scale", "kivi_granularity", "heldout_ids",
           "perplexity_change", "free_running", "hf_side_by_side", "fp8_roundtrip", "fp8_table",
           "gpu_reference", "axis_evidence", "check_axis_choice", "KIVI_G", "kivi_groups", "scale_bytes",
           "shared_scale_per_token", "INT8_CACHE", "SOURCE_TOKEN", "SOURCE_WINDOW", "OURS_QUANT", "OURS_EXACT",
           "wilson", "record_kv"]

GRANULARITY = {"per-tensor": None, "per-head": (1, 2), "per-token": -1, "per-channel": 1}  # for (H_KV, T, D)
SHARED = "per-tensor, K and V together (the source article)"
KIVI_G = 32  # KIVI's group size: keys per channel over G tokens, values per token over G channels
KIVI = f"KIVI's groups, INT8, G = {KIVI_G} (K per channel over G tokens, V per token over G channels)"


# --------------------------------------------------------------------------------------------
# Recording what the model caches
# --------------------------------------------------------------------------------------------


class RecordKV:
    """Stands where a cache stands (``cache.attend``): keeps each layer's K and V of sequence 0, (H_KV, T, D),
    and attends with SDPA over them, so the model's output is a full-precision pass."""

    def __init__(self):
        self.k, self.v = {}, {}

    def attend(self, layer, q, k, v):
        self.k[layer], self.v[layer] = k[0].clone(), v[0].clone()  # (H_KV, T, D)
        n_rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def layers(self):
        """(list of K, list of V), one (H_KV, T, D) tensor per layer, in layer order."""
        return [self.k[i] for i in sorted(self.k)], [self.v[i] for i in sorted(self.v)]


@torch.no_grad()
def record_kv(model, ids):
    """K (as cached: after RoPE) and V of every layer for ``ids``, through the cache seam: (list of K, list of V),
    one (H_KV, T, D) fp32 CPU tensor per layer."""
    rec = RecordKV()
    model(torch.tensor([ids], device=model.device), cache=rec)
    k, v = rec.layers()
    return [x.float().cpu() for x in k], [x.float().cpu() for x in v]


def rel_error(x, x_hat) -> float:
    return ((x_hat - x).norm() / x.norm()).item()


def roundtrip(x, dim):
    return dequantize_int8(*quantize_int8(x, dim))


def kivi_groups(K, V, G: int = KIVI_G):
    """KIVI's grouping in symmetric INT8 (Liu et al., 2024): K (H_KV, T, D) per channel over each group of G
    consecutive tokens, V per token over each group of G channels (the last group may be shorter)."""
    k_hat = torch.cat([roundtrip(k, 1) for k in K.split(G, dim=1)], dim=1)
    v_hat = torch.cat([roundtrip(v, -1) for v in V.split(G, dim=-1)], dim=-1)
    return k_hat, v_hat


def scale_bytes(H: int, T: int, D: int, G: int = KIVI_G) -> dict:
    """Bytes of fp16 scales per stored number of a (H_KV, T, D) tensor, at each granularity (exact: 2 bytes per
    scale over the numbers the scale serves; the source article's one scale serves K and V)."""
    n = H * T * D
    return {SHARED: 2 / (2 * n), "per-tensor": 2 / n, "per-head": 2 * H / n, "per-token": 2 * H * T / n,
            "per-channel": 2 * H * D / n, KIVI: (2 * H * math.ceil(T / G) * D + 2 * H * T * math.ceil(D / G)) / (2 * n)}


def _granularity_errors(K, V) -> dict:
    """Relative error of K and V, both (H_KV, T, D), at each granularity -> {granularity: (K error, V error)}."""
    both = roundtrip(torch.stack([K, V]), None)  # the source article: one max over K and V
    out = {SHARED: (rel_error(K, both[0]), rel_error(V, both[1]))}
    for name, dim in GRANULARITY.items():
        out[name] = (rel_error(K, roundtrip(K, dim)), rel_error(V, roundtrip(V, dim)))
    k_hat, v_hat = kivi_groups(K, V)
    out[KIVI] = (rel_error(K, k_hat), rel_error(V, v_hat))
    return out


def error_table(layers_k, layers_v):
    """Mean over layers of each granularity's relative error -> (DataFrame: K, V, mean of K and V, scale bytes
    per number; per-layer dicts)."""
    import pandas as pd

    per_layer = [_granularity_errors(k, v) for k, v in zip(layers_k, layers_v)]
    table = pd.DataFrame({g: np.mean([e[g] for e in per_layer], axis=0) for g in per_layer[0]}, index=["K", "V"]).T
    table["mean of K and V"] = table[["K", "V"]].mean(axis=1)
    table["scale bytes per number"] = pd.Series(scale_bytes(*layers_k[0].shape))
    return table, per_layer


def channel_max(X):
    """X (H_KV, T, D) -> (H_KV, D): the largest |value| of each channel over all tokens."""
    return X.abs().amax(dim=1)


def rope_partners(model, channels) -> dict:
    """For each channel i: the channels a unit vector e_i reaches once the model's own RoPE turns it (at a
    position where every pair has turned), read off ``apply_rope`` rather than assumed."""
    D = model.config.head_dim
    cos, sin = model.rope(torch.tensor([[7]], device=model.device), torch.float32)  # (1, 1, D)
    out = {}
    for i in channels:
        e = torch.zeros(1, 1, 1, D, device=model.device)
        e[..., i] = 1.0
        turned = apply_rope(e, cos, sin)[0, 0, 0].abs()
        out[int(i)] = [int(c) for c in torch.nonzero(turned > 1e-6).flatten()]
    return out


def plot_channel_max(K, head: int, what: str):
    """Bar chart of one head's channel maxima (left) and |K| per token and channel (right)."""
    import matplotlib.pyplot as plt

    cmax = channel_max(K)[head]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 3.6))
    ax1.bar(range(K.shape[-1]), cmax.numpy())
    ax1.set(xlabel=f"channel of head {head}", ylabel="max |K| over tokens", title=f"{what}, head {head}")
    im = ax2.imshow(K[head].abs().T.numpy(), aspect="auto", cmap="magma", interpolation="nearest")
    fig.colorbar(im, ax=ax2, label="|K|")
    ax2.set(xlabel="token position", ylabel="channel", title=f"|K| per token and channel, head {head}")
    fig.tight_layout()
    return fig


@torch.no_grad()
def record_real(real, ids):
    """One full-precision pass of SmolLM2 over ``ids`` (no cache), with forward hooks on every layer's
    ``attn.wk`` and ``attn.wv``. Returns (K before RoPE, K after RoPE, V: lists of (H_KV, T, D) fp32 on the
    CPU, one per layer; logits (T, vocab) fp32)."""
    c = real.config
    pre, val, hooks = {}, {}, []
    for i, layer in enumerate(real.layers):
        hooks.append(layer.attn.wk.register_forward_hook(lambda m, inp, out, i=i: pre.__setitem__(i, out.detach())))
        hooks.append(layer.attn.wv.register_forward_hook(lambda m, inp, out, i=i: val.__setitem__(i, out.detach())))
    try:
        logits = real(torch.tensor([ids], device=real.device))[0].float().cpu()  # (T, V)
    finally:
        for h in hooks:
            h.remove()
    T = len(ids)
    cos, sin = real.rope(torch.arange(T, device=real.device)[None], real.dtype)
    heads = lambda x: x.view(1, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # noqa: E731  (1, H_KV, T, D)
    k_pre = [heads(pre[i]).float()[0].cpu() for i in range(c.n_layers)]
    k_post = [apply_rope(heads(pre[i]), cos, sin).float()[0].cpu() for i in range(c.n_layers)]
    v = [heads(val[i]).float()[0].cpu() for i in range(c.n_layers)]
    return k_pre, k_post, v, logits


def _ratio(X):
    """(H_KV,) largest channel max / median channel max, and (H_KV,) the index of the largest channel."""
    cmax = channel_max(X)
    return cmax.max(dim=1).values / cmax.median(dim=1).values, cmax.argmax(dim=1)


def outlier_table(k_pre, k_post, v):
    """Largest channel max / median channel max over (layer, head), for K before and after RoPE and V ->
    (DataFrame, {name: (layers, H_KV) ratios}, {name: (layers, H_KV) index of the largest channel})."""
    import pandas as pd

    ratios, top = {}, {}
    for name, X in (("K before RoPE", k_pre), ("K after RoPE", k_post), ("V", v)):
        r, a = zip(*(_ratio(x) for x in X))
        ratios[name], top[name] = torch.stack(r), torch.stack(a)
    table = pd.DataFrame({name: {"median over (layer, head)": r.median().item(), "max over (layer, head)": r.max().item(),
                                 "layer of the max": int(r.max(dim=1).values.argmax())} for name, r in ratios.items()}).T
    table["layer of the max"] = table["layer of the max"].astype(int)
    return table, ratios, top


def plot_real_outliers(k_pre, k_post, v, layer: int, head: int):
    """Left: channel maxima of one (layer, head), K before and after RoPE and V. Middle and right: the same
    head's channel maxima in every layer (K after RoPE, V), each divided by that layer's median channel."""
    import matplotlib.pyplot as plt

    D, T = k_pre[0].shape[-1], k_pre[0].shape[1]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4), gridspec_kw={"width_ratios": [1.3, 1, 1]})
    ax = axes[0]
    for X, style, name in ((k_pre, "o-", "K before RoPE"), (k_post, "s--", "K after RoPE (cached)"), (v, ":", "V")):
        ax.plot(np.arange(D), X[layer][head].abs().amax(dim=0).numpy(), style, ms=3, label=name)
    ax.axvline(D // 2, color="grey", lw=0.8)
    ax.set(xlabel=f"channel (RoPE turns i with i + {D // 2})", ylabel=f"max |x| over {T} tokens",
           title=f"layer {layer}, K/V head {head}")
    ax.legend()
    norm = lambda X: torch.stack([x[head].abs().amax(dim=0) / x[head].abs().amax(dim=0).median() for x in X]).numpy()  # noqa: E731
    vmax = max(norm(k_post).max(), norm(v).max())
    for ax, X, name in ((axes[1], k_post, "K after RoPE"), (axes[2], v, "V")):
        im = ax.imshow(norm(X), aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
        fig.colorbar(im, ax=ax, label="channel max / median channel max")
        ax.axhline(layer, color="white", lw=0.6, ls="--")
        ax.set(xlabel="channel", ylabel="layer", title=f"{name}, K/V head {head}, every layer")
    fig.tight_layout()
    return fig


def static_vs_dynamic(rec: RecordKV, calib: RecordKV):
    """Static per-channel scales calibrated on ``calib``'s text vs dynamic per-channel (the same groups, scales
    from the text itself) and dynamic per-token scales, on ``rec``'s text: relative error of each and the share of
    values clipped by the static scales, per (layer, tensor)."""
    import pandas as pd

    rows = []
    for layer in sorted(rec.k):
        for name, X, C in (("K", rec.k[layer], calib.k[layer]), ("V", rec.v[layer], calib.v[layer])):
            calibrated = C.abs().amax(dim=1, keepdim=True)  # (H_KV, 1, D) each channel's range, on the other text
            s_static = calibrated / 127
            x_static = torch.clamp(torch.round(X / s_static), -127, 127) * s_static
            rows.append({"layer": layer, "tensor": name, "static per-channel": rel_error(X, x_static),
                         "share clipped": (X.abs() > calibrated).float().mean().item(),
                         "dynamic per-channel": rel_error(X, roundtrip(X, 1)),
                         "dynamic per-token": rel_error(X, roundtrip(X, -1))})
    return pd.DataFrame(rows).set_index(["layer", "tensor"])


# --------------------------------------------------------------------------------------------
# Memory and quality
# --------------------------------------------------------------------------------------------


def cache_bytes(model, lengths):
    """Bytes of a live fp16 ``KVCache`` and a live ``Int8KVCache`` (values and scales) for one sequence of each
    length, counted from their tensors."""
    import pandas as pd

    rows = []
    for S in lengths:
        c = model.config
        fp16 = KVCache(c.n_layers, 1, c.n_kv_heads, S, c.head_dim, torch.float16)
        int8 = Int8KVCache(c.n_layers, 1, c.n_kv_heads, S, c.head_dim)
        rows.append({"positions": S, "fp16 bytes": fp16.nbytes(), "int8 + scales bytes": int8.nbytes(),
                     "int8 / fp16": int8.nbytes() / fp16.nbytes()})
    return pd.DataFrame(rows).set_index("positions")


class FakeQuantKV:
    """The cache seam (chapter 03): quantize a layer's whole K and V with ``fn(k, v)``, then causal attention over
    the result. ``fn`` sees the whole window at once: a scale over many tokens is the coarsest group a cache could
    use (it could apply it only after a prompt, to all of it); a scale per token is what a cache storing each token
    as it arrives computes, and its result here is the same as storing token by token."""

    def __init__(self, fn):
        self.fn = fn

    def attend(self, layer, q, k, v):
        k_hat, v_hat = self.fn(k, v)  # (B, H_KV, T, D)
        n_rep = q.shape[1] // k.shape[1]
        k_hat, v_hat = k_hat.repeat_interleave(n_rep, dim=1), v_hat.repeat_interleave(n_rep, dim=1)
        return F.scaled_dot_product_attention(q, k_hat.to(q.dtype), v_hat.to(q.dtype), is_causal=True)


def shared_scale(k, v):
    """The first source article's ``quantize_kv`` applied once per window: one scale for a layer's K and V
    together over every token of the sequence. k, v: (B, H_KV, T, D)."""
    out = roundtrip(torch.stack([k, v]), (0, 2, 3, 4))  # the max over K/V, heads, tokens, dims: one per sequence
    return out[0], out[1]


def shared_scale_per_token(k, v):
    """The first source article's ``quantize_kv`` applied to each token as it is stored: one scale per (layer,
    token), shared by that token's K and V and all K/V heads. k, v: (B, H_KV, T, D). Written out rather than
    through ``quantize_int8``: the article rounds with ``torch.round`` (half to even), the course's quantizer half
    away from zero (on SmolLM2's K/V of 512 tokens the two differ in 4 of 5.9 million values)."""
    amax = torch.maximum(k.abs().amax(dim=(1, 3), keepdim=True), v.abs().amax(dim=(1, 3), keepdim=True))
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # (B, 1, T, 1)
    return torch.round(k / scale).clamp(-127, 127) * scale, torch.round(v / scale).clamp(-127, 127) * scale


def kivi_granularity(k, v):
    """KIVI's groups (``kivi_groups``), each sequence on its own. k, v: (B, H_KV, T, D)."""
    out = [kivi_groups(k[b], v[b]) for b in range(k.shape[0])]
    return torch.stack([o[0] for o in out]), torch.stack([o[1] for o in out])


def heldout_ids(tok, val_text: str, eos_id: int) -> list[int]:
    """The held-out documents of the tiny model's corpus, joined by blank lines, as ``tok`` tokens."""
    return tok.encode("\n\n".join(d for d in val_text.split(chr(eos_id)) if d))


@torch.no_grad()
def _window_nll(model, x, make_cache, per_call: int = 2):
    """Per-token negative log-likelihood (B, W - 1) of the windows x (B, W), teacher-forced, and the argmax, ``per_call``
    windows per forward (each forward's logits are per_call x W x vocabulary floats: 200 MB for SmolLM2 at W = 512).
    ``make_cache(batch)``: a fresh cache for that many windows, or None for no cache."""
    nll, top = [], []
    for chunk in x.split(per_call):
        logits = model(chunk, cache=None if make_cache is None else make_cache(len(chunk))).float()
        # the vocabulary as the last, contiguous axis: 3-4x faster on a CPU than cross_entropy over a (B, V, T) view
        nll.append(F.cross_entropy(logits[:, :-1].flatten(0, 1), chunk[:, 1:].flatten(), reduction="none")
                   .view(len(chunk), -1).cpu())
        top.append(logits[:, :-1].argmax(-1).cpu())
        del logits
    return torch.cat(nll), torch.cat(top)


INT8_CACHE = "int8 cache (per token and head)"
SOURCE_TOKEN = "source article, one K+V scale per stored token"
SOURCE_WINDOW = "source article, one K+V scale per 512-token window"
SCHEMES = {INT8_CACHE: lambda model, B, T: Int8KVCache.for_model(model, B, T),
           SOURCE_TOKEN: lambda model, B, T: FakeQuantKV(shared_scale_per_token),
           SOURCE_WINDOW: lambda model, B, T: FakeQuantKV(shared_scale),
           "KIVI's groups, INT8": lambda model, B, T: FakeQuantKV(kivi_granularity)}


def _block_means(d, block: int):
    """d (windows, scored) -> (windows * scored / block,) means of consecutive blocks that tile every window."""
    if d.shape[1] % block:
        raise ValueError(f"blocks of {block} do not tile {d.shape[1]} scored tokens per window")
    return d.reshape(-1, block).mean(dim=1)


def _interval_row(d, pick, ref: float, agree=None) -> dict:
    """Change of perplexity of per-token NLL differences d (windows, scored), the 95% bootstrap interval from the
    block resampling ``pick`` (n_boot, n_blocks) of ``_block_means``, and where the interval lies against ``ref``."""
    block = d.shape[1] // (pick.shape[1] // d.shape[0])
    boot = torch.expm1(_block_means(d, block)[pick].mean(dim=1)) * 100
    lo, hi = boot.quantile(0.025).item(), boot.quantile(0.975).item()
    where = f"below {ref:g}%" if hi < ref else f"above {ref:g}%" if lo > ref else f"contains {ref:g}%"
    return {"ppl change %": 100 * math.expm1(d.mean().item()), "95% low %": lo, "95% high %": hi,
            "interval vs": where, "greedy agreement %": agree, "tokens scored": d.numel()}


def perplexity_change(model, ids, window: int, windows, schemes, block: int, paired=(), claim: float = 1.0,
                      n_boot: int = 2000, seed: int = 0):
    """Teacher-forced perplexity on the windows ``windows`` (indices of consecutive ``window``-token windows of ids),
    without a cache and through each of ``schemes`` (keys of ``SCHEMES``), every scheme on the same tokens. Per
    scheme: the change of perplexity against no cache, a 95% bootstrap interval over blocks of ``block``
    consecutive scored tokens that tile every window (the same resampled blocks for every scheme), where it lies
    against ``claim`` %, the share of positions whose argmax is unchanged (teacher-forced greedy agreement) and
    the tokens scored. ``paired``: (a, b) pairs, each a row of a's perplexity relative to b's on the same tokens
    (interval against 0). Returns (DataFrame, full-precision perplexity)."""
    import pandas as pd

    x = torch.tensor([ids[i * window:(i + 1) * window] for i in windows], device=model.device)
    nll_full, top_full = _window_nll(model, x, None)
    n_blocks = len(windows) * (window - 1) // block
    pick = torch.randint(n_blocks, (n_boot, n_blocks), generator=torch.Generator().manual_seed(seed))
    nll, rows = {}, {}
    for name in schemes:
        nll[name], top = _window_nll(model, x, lambda batch, name=name: SCHEMES[name](model, batch, window))
        agree = 100 * (top == top_full).float().mean().item()
        rows[name] = _interval_row(nll[name] - nll_full, pick, claim, agree)
    for a, b in paired:
        rows[f"{a} vs {b}"] = _interval_row(nll[a] - nll[b], pick, 0.0)
    table = pd.DataFrame(rows).T
    for col in ("ppl change %", "95% low %", "95% high %", "greedy agreement %"):
        table[col] = table[col].astype(float)  # None (a paired row's agreement) becomes NaN
    table["tokens scored"] = table["tokens scored"].astype(int)
    return table, math.exp(nll_full.mean().item())


def free_running(model, prompts, n: int) -> list:
    """Greedy generation of ``n`` tokens with the contiguous and the int8 cache: for each prompt, the index of
    the first token where they differ (None if all n agree), and the two continuations."""
    from ..generate import generate

    free = {kind: generate(model, prompts, n, cache=kind) for kind in ("contiguous", "int8")}
    same = free["contiguous"] == free["int8"]  # (B, n)
    first = [None if row.all() else int(row.logical_not().int().argmax()) for row in same]
    return first, free


# --------------------------------------------------------------------------------------------
# The tools: transformers' quantized caches beside ours
# --------------------------------------------------------------------------------------------


def _hf_bytes(layer) -> int:
    """Bytes a transformers quantized cache layer holds for its quantized keys and values (data and scales)."""
    total = 0
    for q in (layer._quantized_keys, layer._quantized_values):
        if isinstance(q, tuple):  # fp8: (tensor, scale); HQQ: (tensor, meta with scale and zero)
            data, meta = q
            total += data.nbytes
            total += sum(t.nbytes for t in (meta.values() if isinstance(meta, dict) else [meta])
                         if isinstance(t, torch.Tensor))
        else:  # quanto: a packed tensor (its storage: two 4-bit numbers per byte) with its scale and shift
            data = q._data._data if hasattr(q._data, "_data") else q._data
            total += data.nbytes + q._scale.nbytes + q._shift.nbytes
    return total


class _PrefixThenChunk:
    """The cache seam for one chunk after a stored prefix: the prefix's K/V as given (per layer, (1, H_KV, P, D)),
    the chunk's own K/V exact, as transformers' integer backends return them; causal over the chunk."""

    def __init__(self, k, v):
        self.k, self.v = k, v

    def attend(self, layer, q, k, v):
        P, T = self.k[layer].shape[2], q.shape[2]
        k, v = torch.cat([self.k[layer], k.to(self.k[layer].dtype)], 2), torch.cat([self.v[layer], v.to(self.v[layer].dtype)], 2)
        mask = torch.ones(T, P + T, dtype=torch.bool, device=q.device).tril(diagonal=P)
        n_rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(n_rep, dim=1).to(q.dtype), v.repeat_interleave(n_rep, dim=1).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@torch.no_grad()
def _ours(model, prefix, chunk):
    """Our int8 cache on transformers' schedule: the prefix's K/V computed in full precision, then quantized per
    token into an Int8KVCache; the chunk attends over it either through the Int8KVCache (its own rows quantized
    too) or with its own rows exact. -> (logits chunk quantized, logits chunk exact, exact logits, bytes held)."""
    P, n = len(prefix), len(prefix) + len(chunk)
    full = KVCache.for_model(model, 1, n)
    model(torch.tensor([prefix], device=model.device), cache=full)
    q8 = Int8KVCache.for_model(model, 1, n)
    start = torch.zeros(1, dtype=torch.long, device=model.device)
    for i in range(model.config.n_layers):
        store_kv_int8_ref(q8.k[i], q8.k_scale[i], q8.v[i], q8.v_scale[i], full.k[i][:, :, :P], full.v[i][:, :, :P], start)
    q8.seq_lens[:] = P
    held = sum(t[:, :, :P].nbytes for t in q8.k + q8.v + q8.k_scale + q8.v_scale)
    deq = [[dequantize_int8(x[:, :, :P], s[:, :, :P, None]) for x, s in zip(xs, ss)]
           for xs, ss in ((q8.k, q8.k_scale), (q8.v, q8.v_scale))]
    c, pos = torch.tensor([chunk], device=model.device), torch.arange(P, n, device=model.device)[None]
    exact = model(c, positions=pos, cache=full)[0].float()
    chunk_exact = model(c, positions=pos, cache=_PrefixThenChunk(*deq))[0].float()
    return model(c, positions=pos, cache=q8)[0].float(), chunk_exact, exact, held


OURS_QUANT = "kvlib Int8KVCache (INT8, fp16 scale per token and head)"
OURS_EXACT = "kvlib Int8KVCache's prefix, chunk's own K/V exact"


@torch.no_grad()
def hf_side_by_side(hf, model, ids, starts, backends, prefix: int = 256, chunk: int = 64, share_prefix: bool = True):
    """For each start in ``starts``: a ``prefix``-token prefix of ``ids`` through each cache (stored quantized),
    then the next ``chunk`` tokens in one forward attending over it. ``backends``: {name: QuantizedCache kwargs}.
    Rows: bytes of the stored prefix per cached number (scales included), whether the chunk's own K/V are
    quantized, the mean KL divergence (nats per token) from the same model's exact cache, the greedy agreement
    with it, and the tokens scored.

    ``share_prefix``: a quantized cache's first ``update`` stores its quantized copy and hands the layer back the
    exact K/V it was given, so the prefix forward is the same computation whatever the cache; the prefix runs once,
    with the exact ``DynamicCache``, and each quantized cache is given that forward's K/V, layer by layer, through
    the same ``update`` call the forward makes (False: one prefix forward per cache; the tests check both give the
    same table)."""
    import warnings

    import pandas as pd
    from transformers import DynamicCache, QuantizedCache

    from ..bench.peers import quanto_unpack_in_pytorch

    quanto_unpack_in_pytorch()  # no C++ build at first use (a minute in a new environment); the same bytes

    cfg = hf.config
    n_numbers = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * prefix
    acc = {}

    def add(name, lg, ex, held, chunk_quantized):
        r = acc.setdefault(name, {"bytes per cached number": held / n_numbers, "chunk's own K/V": chunk_quantized,
                                  "kl": 0.0, "same": 0, "n": 0})
        r["kl"] += F.kl_div(lg.log_softmax(-1), ex.log_softmax(-1), log_target=True, reduction="sum").item()
        r["same"] += (lg.argmax(-1) == ex.argmax(-1)).sum().item()
        r["n"] += len(lg)

    for s0 in starts:
        p = torch.tensor([ids[s0:s0 + prefix]], device=hf.device)
        c = torch.tensor([ids[s0 + prefix:s0 + prefix + chunk]], device=hf.device)

        def run(cache, count=None, prefix_kv=None):
            with warnings.catch_warnings():  # transformers 5 renames past_key_values; 4.x knows only that name
                warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
                if prefix_kv is None:
                    hf(p, past_key_values=cache, use_cache=True)
                else:  # the exact prefix forward's K/V, handed to the cache as that forward hands them
                    for i, (k, v) in enumerate(prefix_kv):
                        cache.update(k, v, i)
                held = None if count is None else sum(count(layer) for layer in cache.layers)  # the prefix, stored
                return hf(c, past_key_values=cache, use_cache=True).logits[0].float(), held

        dynamic = DynamicCache(config=cfg)
        exact, _ = run(dynamic)
        prefix_kv = [(layer.keys[:, :, :prefix], layer.values[:, :, :prefix]) for layer in dynamic.layers]
        quant, chunk_exact, ours_exact, held = _ours(model, ids[s0:s0 + prefix], ids[s0 + prefix:s0 + prefix + chunk])
        add(OURS_QUANT, quant, ours_exact, held, "quantized")
        add(OURS_EXACT, chunk_exact, ours_exact, held, "exact")
        for name, kw in backends.items():
            logits, held = run(QuantizedCache(config=cfg, **kw), _hf_bytes, prefix_kv if share_prefix else None)
            add(name, logits, exact, held, "quantized" if kw.get("backend") == "fp8" else "exact")
    return pd.DataFrame({name: {"bytes per cached number": r["bytes per cached number"],
                                "chunk's own K/V": r["chunk's own K/V"], "mean KL (nats)": r["kl"] / r["n"],
                                "greedy agreement %": 100 * r["same"] / r["n"], "tokens scored": r["n"]}
                         for name, r in acc.items()}).T


def fp8_roundtrip(x, dim=-1):
    """e4m3 with one scale per row (dim=-1), per tensor (None), or none at all ("none": values as they are,
    clamped to ±448)."""
    if dim == "none":
        return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = amax.clamp(min=1e-12) / 448.0
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def fp8_table(named_layers):
    """``named_layers``: {(model, tensor): list of (H_KV, T, D)}. Mean relative error of INT8 and FP8 e4m3 per
    row, per tensor, and FP8 with no scale; and each tensor's median row max / rms."""
    import pandas as pd

    def mean(fn, Xs):
        return float(np.mean([fn(X) for X in Xs]))

    rows = {}
    for key, Xs in named_layers.items():
        rows[key] = {"int8 per-token": mean(lambda X: rel_error(X, roundtrip(X, -1)), Xs),
                     "fp8 e4m3 per-token": mean(lambda X: rel_error(X, fp8_roundtrip(X)), Xs),
                     "int8 per-tensor": mean(lambda X: rel_error(X, roundtrip(X, None)), Xs),
                     "fp8 e4m3 per-tensor": mean(lambda X: rel_error(X, fp8_roundtrip(X, None)), Xs),
                     "fp8 e4m3, no scale": mean(lambda X: rel_error(X, fp8_roundtrip(X, "none")), Xs),
                     "row max / rms": mean(lambda X: (X.abs().amax(-1) / X.pow(2).mean(-1).sqrt()).median().item(), Xs)}
    table = pd.DataFrame(rows).T
    table["fp8 / int8"] = table["fp8 e4m3 per-token"] / table["int8 per-token"]
    return table


# --------------------------------------------------------------------------------------------
# Lab 06's decision: along which axis to quantize K and V
# --------------------------------------------------------------------------------------------

AXES = ("per-token", "per-channel")


def axis_evidence(layers_k, layers_v):
    """What a learner decides from: for K and V, medians over (layer, head) of the largest channel max over the
    median channel max and of the largest token max over the median token max; and the mean relative error of
    INT8 per token and per channel (the outcome of each choice)."""
    import pandas as pd

    def token_ratio(X):  # (H_KV,) largest token max / median token max
        tmax = X.abs().amax(dim=2)  # (H_KV, T): each token's largest |value| over its channels
        return tmax.max(dim=1).values / tmax.median(dim=1).values

    rows = {}
    for name, Xs in (("K", layers_k), ("V", layers_v)):
        ratios = torch.stack([_ratio(X)[0] for X in Xs])
        rows[name] = {"largest / median channel max": ratios.median().item(),
                      "largest / median token max": torch.stack([token_ratio(X) for X in Xs]).median().item(),
                      "per-token error": float(np.mean([rel_error(X, roundtrip(X, -1)) for X in Xs])),
                      "per-channel error": float(np.mean([rel_error(X, roundtrip(X, 1)) for X in Xs]))}
    return pd.DataFrame(rows).T


def check_axis_choice(k_axis: str, v_axis: str, evidence) -> bool:
    """Lab 06's decision: the axis (``"per-token"`` or ``"per-channel"``) along which to give K and V their
    scales, given ``axis_evidence``. Prints yours vs the reference (the axis with the lower error, from the
    evidence); a wrong choice fails with its diagnosis."""
    from . import mistakes
    from .check import check_choice

    yours = {"K": str(k_axis).strip().lower(), "V": str(v_axis).strip().lower()}
    ref = {t: min(AXES, key=lambda a: evidence.loc[t, f"{a} error"]) for t in ("K", "V")}
    print(evidence.round(4).to_string() + "\n")
    return check_choice("axis for K and V", yours, ref, lambda: mistakes.axis_choice(yours, ref, evidence),
                        shown=(f"{yours['K']}, {yours['V']}", f"{ref['K']}, {ref['V']}"))


def gpu_reference(sweep: str = "int8") -> list[str]:
    """The int8 sweep's curves: this GPU's (GPU mode) or the committed ones (CPU mode), drawn; then chapter 03's
    detailed lines (the headline points' conditions, each kernel's median and min–max of % of copy bandwidth and
    of its ratio to the fp16 kernel, the points below the headline sizes) and, for committed results, the (B, S)
    of every headline point a median uses. No targets: they belong to the benchmarks."""
    from ..bench import results
    from .ch03 import gpu_reference as _gpu_reference

    lines = _gpu_reference(sweep, keep=lambda kernel: True, detail=True)
    if not lines or lines == [results.NO_REFERENCE] or runtime.mode() == "gpu":
        return lines
    _, rows = results.reference(sweep)
    points = sorted({(r["B"], r["S"]) for r in rows if r.get("sweep") == sweep and r.get("headline")
                     and r.get("kernel") and r.get("time_ms") is not None})
    return lines + ["headline points (B, S): " + ", ".join(f"({b}, {s:,})" for b, s in points)]
