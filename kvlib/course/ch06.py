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

from ..cache import KVCache
from ..model import apply_rope
from ..quant import Int8KVCache, dequantize_int8, quantize_int8, store_kv_int8_ref

__all__ = ["RecordKV", "rel_error", "roundtrip", "GRANULARITY", "SHARED", "KIVI", "error_table", "channel_max",
           "rope_partners", "plot_channel_max", "record_real", "outlier_table", "plot_real_outliers",
           "static_vs_dynamic", "cache_bytes", "FakeQuantKV", "SCHEMES", "shared_scale", "kivi_granularity", "heldout_ids",
           "perplexity_change", "free_running", "hf_side_by_side", "fp8_roundtrip", "fp8_table",
           "gpu_reference", "axis_evidence", "check_axis_choice"]

GRANULARITY = {"per-tensor": None, "per-head": (1, 2), "per-token": -1, "per-channel": 1}  # for (H_KV, T, D)
SHARED = "per-tensor, K and V together (the source article)"
KIVI = "KIVI's grouping, INT8 (K per-channel, V per-token)"


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


def rel_error(x, x_hat) -> float:
    return ((x_hat - x).norm() / x.norm()).item()


def roundtrip(x, dim):
    return dequantize_int8(*quantize_int8(x, dim))


def _granularity_errors(K, V) -> dict:
    """Relative error of K and V, both (H_KV, T, D), at each granularity -> {granularity: (K error, V error)}."""
    both = roundtrip(torch.stack([K, V]), None)  # the source article: one max over K and V
    out = {SHARED: (rel_error(K, both[0]), rel_error(V, both[1]))}
    for name, dim in GRANULARITY.items():
        out[name] = (rel_error(K, roundtrip(K, dim)), rel_error(V, roundtrip(V, dim)))
    out[KIVI] = (out["per-channel"][0], out["per-token"][1])
    return out


def error_table(layers_k, layers_v):
    """Mean over layers of each granularity's relative error -> (DataFrame: K, V, mean of K and V; per-layer
    dicts)."""
    import pandas as pd

    per_layer = [_granularity_errors(k, v) for k, v in zip(layers_k, layers_v)]
    table = pd.DataFrame({g: np.mean([e[g] for e in per_layer], axis=0) for g in per_layer[0]}, index=["K", "V"]).T
    table["mean of K and V"] = table[["K", "V"]].mean(axis=1)
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
    """Static per-channel scales calibrated on ``calib``'s text vs dynamic per-token scales, on ``rec``'s text:
    relative error of each and the share of values clipped by the static scales, per (layer, tensor)."""
    import pandas as pd

    rows = []
    for layer in sorted(rec.k):
        for name, X, C in (("K", rec.k[layer], calib.k[layer]), ("V", rec.v[layer], calib.v[layer])):
            calibrated = C.abs().amax(dim=1, keepdim=True)  # (H_KV, 1, D) each channel's range, on the other text
            s_static = calibrated / 127
            x_static = torch.clamp(torch.round(X / s_static), -127, 127) * s_static
            rows.append({"layer": layer, "tensor": name, "static per-channel": rel_error(X, x_static),
                         "share clipped": (X.abs() > calibrated).float().mean().item(),
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
    the result. Every scale sees the whole text at once: a best case that a cache filled token by token lacks."""

    def __init__(self, fn):
        self.fn = fn

    def attend(self, layer, q, k, v):
        k_hat, v_hat = self.fn(k, v)  # (B, H_KV, T, D)
        n_rep = q.shape[1] // k.shape[1]
        k_hat, v_hat = k_hat.repeat_interleave(n_rep, dim=1), v_hat.repeat_interleave(n_rep, dim=1)
        return F.scaled_dot_product_attention(q, k_hat.to(q.dtype), v_hat.to(q.dtype), is_causal=True)


def shared_scale(k, v):
    """The first source article's INT8: one scale for a layer's K and V together, per sequence."""
    out = [roundtrip(torch.stack([k[b], v[b]]), None) for b in range(k.shape[0])]
    return torch.stack([o[0] for o in out]), torch.stack([o[1] for o in out])


def kivi_granularity(k, v):
    """Keys per channel (over tokens), values per token, each sequence on its own."""
    return roundtrip(k, 2), roundtrip(v, -1)


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
        nll.append(F.cross_entropy(logits[:, :-1].transpose(1, 2), chunk[:, 1:], reduction="none").cpu())
        top.append(logits[:, :-1].argmax(-1).cpu())
        del logits
    return torch.cat(nll), torch.cat(top)


SCHEMES = {"int8 cache (per-token)": lambda model, B, T: Int8KVCache.for_model(model, B, T),
           "source article (K+V one scale)": lambda model, B, T: FakeQuantKV(shared_scale),
           "KIVI's grouping, INT8": lambda model, B, T: FakeQuantKV(kivi_granularity)}


def perplexity_change(model, ids, window: int, n_windows: int, schemes=None, block: int = 64,
                      n_boot: int = 2000, seed: int = 0):
    """Teacher-forced perplexity of ``n_windows`` consecutive windows of ``window`` tokens, without a cache and
    through each quantized scheme in ``schemes``: {key of ``SCHEMES``: how many of the windows it scores (None: all)}
    (default: every scheme on every window). Per scheme: the change of perplexity, a 95% bootstrap interval over
    blocks of ``block`` consecutive scored tokens (resampled with replacement), the share of positions whose argmax
    is unchanged and the tokens scored. Returns (DataFrame, full-precision perplexity over all windows)."""
    import pandas as pd

    if len(ids) < window * n_windows:
        raise ValueError(f"{len(ids)} tokens hold fewer than {n_windows} windows of {window}")
    x = torch.tensor([ids[i * window:(i + 1) * window] for i in range(n_windows)], device=model.device)
    nll_full, top_full = _window_nll(model, x, None)
    gen, rows = torch.Generator().manual_seed(seed), {}
    for name, n in (schemes or dict.fromkeys(SCHEMES)).items():
        n = n_windows if n is None else min(n, n_windows)
        nll, top = _window_nll(model, x[:n], lambda batch, name=name: SCHEMES[name](model, batch, window))
        d = nll - nll_full[:n]  # (n, window - 1) per-token cost in nats
        n_blocks = d.shape[1] // block
        blocks = d[:, : n_blocks * block].reshape(-1, block).mean(dim=1)  # (n_windows * n_blocks,)
        pick = torch.randint(len(blocks), (n_boot, len(blocks)), generator=gen)
        boot = torch.expm1(blocks[pick].mean(dim=1)) * 100
        rows[name] = {"ppl change %": 100 * math.expm1(d.mean().item()),
                      "95% low %": boot.quantile(0.025).item(), "95% high %": boot.quantile(0.975).item(),
                      "top-1 agreement %": 100 * (top == top_full[:n]).float().mean().item(),
                      "tokens scored": d.numel()}
    table = pd.DataFrame(rows).T
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


@torch.no_grad()
def _ours(model, prefix, chunk):
    """Our int8 cache on the same schedule as transformers': the prefix's K/V computed in full precision, then
    quantized per token into an Int8KVCache; the chunk attends over it (its own rows quantized too)."""
    full = KVCache.for_model(model, 1, len(prefix) + len(chunk))
    model(torch.tensor([prefix], device=model.device), cache=full)
    q8 = Int8KVCache.for_model(model, 1, len(prefix) + len(chunk))
    start = torch.zeros(1, dtype=torch.long, device=model.device)
    P = len(prefix)
    for i in range(model.config.n_layers):
        store_kv_int8_ref(q8.k[i], q8.k_scale[i], q8.v[i], q8.v_scale[i], full.k[i][:, :, :P], full.v[i][:, :, :P], start)
    q8.seq_lens[:] = P
    held = sum(t[:, :, :P].nbytes for t in q8.k + q8.v + q8.k_scale + q8.v_scale)
    chunk_t = torch.tensor([chunk], device=model.device)
    positions = torch.arange(P, P + len(chunk), device=model.device)[None]
    exact = model(chunk_t, positions=positions, cache=full)[0].float()
    return model(chunk_t, positions=positions, cache=q8)[0].float(), exact, held


@torch.no_grad()
def hf_side_by_side(hf, model, prefix, chunk, backends):
    """The prefix through each cache (stored quantized), then the chunk in one forward attending over it.
    ``backends``: {name: QuantizedCache kwargs}. Rows: bytes of the stored prefix per cached number, the
    largest logit difference and the top-1 agreement on the chunk against the same model with an exact cache."""
    import warnings

    import pandas as pd
    from transformers import DynamicCache, QuantizedCache

    cfg = hf.config
    n_numbers = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * len(prefix)
    p, c = torch.tensor([prefix], device=hf.device), torch.tensor([chunk], device=hf.device)

    def run(cache, count=None):
        with warnings.catch_warnings():  # transformers 5 renames past_key_values to cache; 4.x knows only the former
            warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
            hf(p, past_key_values=cache, use_cache=True)
            held = None if count is None else sum(count(layer) for layer in cache.layers)  # the prefix, as stored
            return hf(c, past_key_values=cache, use_cache=True).logits[0].float(), held

    exact, _ = run(DynamicCache(config=cfg))
    rows = {}
    ours, ours_exact, held = _ours(model, prefix, chunk)
    rows["kvlib Int8KVCache (INT8, per-token scale)"] = (held, ours, ours_exact)
    for name, kw in backends.items():
        logits, held = run(QuantizedCache(config=cfg, **kw), _hf_bytes)
        rows[name] = (held, logits, exact)
    return pd.DataFrame({name: {"bytes per cached number": held / n_numbers,
                                "max |logit diff|": (lg - ex).abs().max().item(),
                                "top-1 agreement %": 100 * (lg.argmax(-1) == ex.argmax(-1)).float().mean().item()}
                         for name, (held, lg, ex) in rows.items()}).T


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
    from .check import CheckFailed

    yours = {"K": str(k_axis).strip().lower(), "V": str(v_axis).strip().lower()}
    ref = {t: min(AXES, key=lambda a: evidence.loc[t, f"{a} error"]) for t in ("K", "V")}
    print(evidence.round(4).to_string() + "\n")
    ok = yours == ref
    report = (f"axis for K and V: yours {yours['K']}, {yours['V']}  reference {ref['K']}, {ref['V']}  "
              + ("✓" if ok else "✗"))
    if ok:
        print(report + "\nPASS ✓")
        return True
    why = mistakes.axis_choice(yours, ref, evidence)
    raise CheckFailed(report + "\nFAIL ✗\n" + "\n".join(f"  {line}" for line in why))


def gpu_reference(sweep: str = "int8") -> list[str]:
    """The int8 sweep's curves: this GPU's (GPU mode) or the committed ones (CPU mode), and one line per kernel
    (chapter 03's ``gpu_reference``, every kernel of the sweep kept). No targets: they belong to the benchmarks."""
    from .ch03 import gpu_reference as _gpu_reference

    return _gpu_reference(sweep, keep=lambda kernel: True)
