"""Chapter 04's pictures: the KV memory formula's factors for a real config, and KV bytes against context.

What you will see:

- :func:`formula` draws ``2 x layers x K/V heads x head dim x bytes per element x tokens x batch`` for a live
  config (a row of ``kvlib.memory.REAL_MODELS``, a ``kvlib.model.ModelConfig``, a Hugging Face config
  object, or a ``kvlib.cache.KVCache`` itself): one labelled block per factor, its width growing with the
  factor's log2 and its value written inside, and the product, which is ``kv_cache_bytes(...)``. Beneath,
  greyed out, what is *not* a factor: the query heads and the model width.
- :func:`kv_vs_context` plots the cache's GiB against context length for real model configs at two
  batch sizes, with the GPUs' memory sizes as horizontal lines (and, dashed, what is left of each after
  one model's weights).

Every factor block carries the gid ``"factor"`` and its value text the gid ``"value"``; the product's text
has the gid ``"product"``, each greyed-out block ``"absent"``. A test reads them back and multiplies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvlib.memory import GiB, ModelSpec, dtype_bytes, kv_cache_bytes

from . import COLORS, label, new_figure

__all__ = ["Factor", "factors", "formula", "kv_vs_context"]


@dataclass(frozen=True)
class Factor:
    name: str  # what the factor counts, in words
    value: int  # its value for this config
    source: str  # where the number comes from (a config.json key, the dtype, or the workload)
    color: str  # a key of COLORS


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "") if not isinstance(dtype, str) else dtype


_CONFIG_KEYS = ("num_hidden_layers", "num_key_value_heads", "head_dim")  # config.json's names for L, H_KV, D


def _shape_of(obj):
    """(name, (L, H_KV, D), where each comes from, dtype or None, seq_len or None, batch or None, absent)."""
    if isinstance(obj, ModelSpec):
        absent = [("query heads", obj.n_heads, "num_attention_heads"), ("model width", obj.hidden_size, "hidden_size")]
        return obj.name, (obj.n_layers, obj.n_kv_heads, obj.head_dim), _CONFIG_KEYS, None, None, None, absent
    if hasattr(obj, "k") and isinstance(getattr(obj, "k"), list) and hasattr(obj, "max_len"):  # a KVCache
        if hasattr(obj, "k_scale"):
            raise ValueError(f"{type(obj).__name__} stores scales beside its values: its bytes are "
                             "kv_cache_bytes(..., scale_bytes=...), not this product of seven factors")
        B, H_kv, S, D = obj.k[0].shape  # (B, H_KV, S_max, D)
        return (type(obj).__name__, (len(obj.k), H_kv, D), ("len(cache.k)", "k.shape[1]", "k.shape[3]"),
                obj.k[0].dtype, S, B, [])
    if hasattr(obj, "num_hidden_layers"):  # a Hugging Face config (LlamaConfig, AutoConfig, ...)
        heads = obj.num_attention_heads
        d = getattr(obj, "head_dim", None) or obj.hidden_size // heads
        kv = getattr(obj, "num_key_value_heads", None) or heads
        absent = [("query heads", heads, "num_attention_heads"), ("model width", obj.hidden_size, "hidden_size")]
        return type(obj).__name__, (obj.num_hidden_layers, kv, d), _CONFIG_KEYS, None, None, None, absent
    if hasattr(obj, "n_layers") and hasattr(obj, "n_kv_heads"):  # kvlib.model.ModelConfig
        absent = [("query heads", obj.n_heads, "n_heads"), ("model width", obj.dim, "dim")]
        return (type(obj).__name__, (obj.n_layers, obj.n_kv_heads, obj.head_dim), ("n_layers", "n_kv_heads", "head_dim"),
                None, None, None, absent)
    raise TypeError(f"cannot read a KV cache's shape from a {type(obj).__name__}: pass a ModelSpec, a ModelConfig, "
                    "a Hugging Face config or a KVCache")


def factors(obj, seq_len: int | None = None, batch: int | None = None, dtype=None) -> list[Factor]:
    """The seven factors of the KV cache's size for ``obj`` holding ``seq_len`` tokens for ``batch`` sequences.

    A KVCache gives its own dtype, capacity (max_len) and batch unless they are passed; a config needs
    ``seq_len`` (default: a ModelSpec's maximum context) and takes batch 1 and fp16 by default.
    """
    name, (L, H_kv, D), (src_l, src_h, src_d), own_dtype, own_S, own_B, _ = _shape_of(obj)
    live = own_S is not None  # a cache: the workload numbers come from its tensors too
    dtype = dtype if dtype is not None else (own_dtype if own_dtype is not None else "fp16")
    if seq_len is None:
        seq_len = own_S if live else getattr(obj, "max_context", None)
    if seq_len is None:
        raise ValueError(f"{name}: say how many tokens the cache holds (seq_len)")
    batch = batch if batch is not None else (own_B if live else 1)
    return [
        Factor("K and V", 2, "K, V", "key"),
        Factor("layers", L, src_l, "query"),
        Factor("K/V heads", H_kv, src_h, "value"),
        Factor("head dim", D, src_d, "filled"),
        Factor("bytes per number", dtype_bytes(dtype), _dtype_name(dtype), "new"),
        Factor("tokens", seq_len, "k.shape[2]" if live else "context length", "filled"),
        Factor("sequences", batch, "k.shape[0]" if live else "batch", "weight"),
    ]


def _width(value: int) -> float:
    """A block's width in inches: grows with log2(value), so 2 and 8,192 both fit on one line."""
    return 0.65 + 0.13 * math.log2(max(1, value))


def _bytes_text(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:,.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:,.2f} MiB"
    return f"{n / 2**10:,.2f} KiB"


def _row(ax, x0: float, y: float, title: str, fs: list[Factor], absent) -> int:
    """Draw one config's factors from (x0, y), y the blocks' lower edge; return their product."""
    from matplotlib.patches import Rectangle

    h = 0.55
    label(ax, x0, y + h + 0.55, title, fontsize=10, fontweight="bold")
    x, product = x0, 1
    for i, f in enumerate(fs):
        w = _width(f.value)
        ax.add_patch(Rectangle((x, y), w, h, facecolor=COLORS[f.color], edgecolor="white", gid="factor"))
        ax.text(x + w / 2, y + h / 2, f"{f.value:,}", ha="center", va="center", fontsize=9, color="white",
                fontweight="bold", gid="value")
        label(ax, x + w / 2, y - 0.14, f.name, ha="center", fontsize=7.5)
        label(ax, x + w / 2, y + h + 0.16, f.source, ha="center", fontsize=6.5, color="#666666", style="italic")
        product *= f.value
        x += w
        if i < len(fs) - 1:
            label(ax, x + 0.12, y + h / 2, "×", ha="center", fontsize=12)
            x += 0.24
    label(ax, x + 0.15, y + h / 2, "=", ha="center", fontsize=12)
    ax.text(x + 0.35, y + h / 2, f"{product:,} bytes\n= {_bytes_text(product)}", ha="left", va="center",
            fontsize=9, color=COLORS["text"], gid="product")
    if absent:
        ax_y = y - 0.75
        label(ax, x0, ax_y + 0.17, "not factors:", fontsize=7.5, color="#666666")
        xa = x0 + 0.8
        for name, value, source in absent:
            w = _width(value)
            ax.add_patch(Rectangle((xa, ax_y), w, 0.34, facecolor=COLORS["empty"], edgecolor=COLORS["masked"],
                                   hatch="///", gid="absent"))
            ax.text(xa + w / 2, ax_y + 0.17, f"{value:,}", ha="center", va="center", fontsize=8, color="#666666")
            label(ax, xa + w + 0.08, ax_y + 0.17, f"{name} ({source})", fontsize=7, color="#666666")
            xa += w + 2.7
    return product


def formula(objs, seq_len: int | None = None, batch: int | None = None, dtype=None, *, title: str | None = None):
    """Draw the KV cache's size as a product of labelled blocks, one row per config (or cache) in ``objs``.

    ``objs``: one object or a list of them (see :func:`factors` for what each may be); ``seq_len``,
    ``batch`` and ``dtype`` apply to every row. Returns the matplotlib Figure.
    """
    objs = list(objs) if isinstance(objs, (list, tuple)) else [objs]
    rows = []
    for obj in objs:
        fs = factors(obj, seq_len, batch, dtype)
        name, *_, absent = _shape_of(obj)
        rows.append((name, fs, absent))
    widest = max(sum(_width(f.value) for f in fs) + 0.24 * (len(fs) - 1) for _, fs, _ in rows)
    row_h = [2.2 if absent else 1.5 for *_, absent in rows]
    width, height = math.ceil((widest + 2.4) * 10) / 10, round(sum(row_h) + 0.2, 1)  # whole pixels at 100 dpi
    fig, ax = new_figure(width, height)
    y = height
    for (name, fs, absent), rh in zip(rows, row_h):
        y -= rh
        n = next(f.value for f in fs if f.name == "tokens")
        b = next(f.value for f in fs if f.name == "sequences")
        _row(ax, 0.1, y + (0.95 if absent else 0.3), f"{name}: {n:,} tokens x {b} sequence{'s' * (b > 1)}", fs,
             absent)
    if title:
        ax.set_title(title, fontsize=11)
    return fig


def kv_vs_context(models, *, batches=(1, 16), gpus: dict, weights_of: ModelSpec | None = None, dtype="fp16",
                  contexts=None):
    """KV cache GiB against context length for each model in ``models`` (rows of REAL_MODELS), one panel per
    batch size; each line ends at the model's maximum context. ``gpus``: {label: GiB} drawn as horizontal
    lines; with ``weights_of``, each GPU also gets a dashed line at its memory minus that model's weights
    (in ``dtype``). Returns the Figure. Each model's line has the gid ``"kv:<name>:<batch>"``."""
    import matplotlib.pyplot as plt

    contexts = contexts or [2**k for k in range(10, 18)]  # 1K .. 128K tokens
    fig, axes = plt.subplots(1, len(batches), figsize=(6.2 * len(batches), 4.6), sharey=True)
    axes = [axes] if len(batches) == 1 else list(axes)
    grey = ["#999999", "#777777", "#555555", "#333333", "#111111"]
    lo, hi = math.inf, 0.0
    for ax, batch in zip(axes, batches):
        for m in models:
            xs = [c for c in contexts if c < m.max_context] + [m.max_context]
            ys = [kv_cache_bytes(m.n_layers, m.n_kv_heads, m.head_dim, c, batch, dtype) / GiB for c in xs]
            lo, hi = min(lo, min(ys)), max(hi, max(ys))
            (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=f"{m.name} (H_KV={m.n_kv_heads})")
            line.set_gid(f"kv:{m.name}:{batch}")
            ax.plot(xs[-1:], ys[-1:], marker="|", markersize=12, color=line.get_color())  # its maximum context
        for (name, gib), c in zip(gpus.items(), grey):
            ax.axhline(gib, color=c, linewidth=1.2, gid=f"gpu:{name}")
            ax.text(contexts[0], gib * 1.06, name, fontsize=7, color=c, va="bottom")
            if weights_of is not None and gib * GiB > weights_of.weight_bytes(dtype):
                left = (gib * GiB - weights_of.weight_bytes(dtype)) / GiB
                ax.axhline(left, color=c, linewidth=1.0, linestyle="--", gid=f"left:{name}")
                ax.text(contexts[-1], left / 1.06, f"{name} minus weights", fontsize=6.5, color=c, ha="right",
                        va="top")
                lo = min(lo, left)
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c // 1024}K" for c in contexts])
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens per sequence)")
        ax.set_title(f"batch {batch}", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    ticks = [t for t in (0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000) if lo / 2 <= t <= hi * 2 or t == 100]
    axes[0].set_yticks(ticks, [f"{t:g}" for t in ticks])
    axes[0].yaxis.set_minor_formatter(plt.NullFormatter())
    axes[0].set_ylim(lo / 1.5, max(hi, max(gpus.values())) * 1.5)
    axes[0].set_ylabel(f"KV cache ({dtype}), GiB")
    axes[0].legend(fontsize=7, loc="lower right")
    where = f"; dashed: left after {weights_of.name}'s {dtype} weights" if weights_of is not None else ""
    fig.suptitle(f"KV cache vs context (formula on config.json values); grey lines: GPU memory{where}", fontsize=10)
    fig.tight_layout()
    return fig
