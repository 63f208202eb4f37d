"""Chapter 04's plumbing: tables, the measurement harness and plot styling that leave the notebook's cells.

The chapter's teaching lives in ``kvlib.memory`` (the formula, the real configs, what fits) and in the
notebook; this module only formats and measures:

- ``GPUS``, ``ROOFLINE_GPUS``: datasheet constants, each with its source;
- ``model_table``, ``fit_frame``, ``longest_context_frame``, ``ridge_frame``: pandas tables;
- ``calculator``: the ipywidgets calculator (its static twin is ``fit_frame`` of the default setting);
- ``layout_frame``: the bytes every kvlib cache allocates for one config, counted from its tensors;
- ``measure_caches`` + ``plot_measured``: predicted vs measured bytes (the allocator or the OS reports);
- ``vllm_capacity``: the arithmetic behind vLLM's startup line "GPU KV cache size: N tokens";
- ``hf_cache_tensors``: the K/V tensors inside a ``transformers`` cache object (never imports transformers).
"""

from __future__ import annotations

import mmap

import torch

from kvlib import runtime
from kvlib.cache import KVCache
from kvlib.memory import (GiB, ModelSpec, REAL_MODELS, fit, kv_cache_bytes, kv_table, max_context,
                          measure_allocation, spec)

__all__ = ["GPUS", "GPU_SOURCES", "ROOFLINE_GPUS", "model_table", "fit_frame", "calculator", "longest_context_frame",
           "layout_frame", "measure_caches", "measured_what", "plot_measured", "ridge_frame", "vllm_capacity",
           "memory_ok", "hf_cache_tensors"]

# GPU memory as the datasheets give it ("GB"; what nvidia-smi shows as usable is a little lower).
GPUS = {"T4 16 GB": 16, "A100 40 GB": 40, "A100 / H100 80 GB": 80, "H200 141 GB": 141}
GPU_SOURCES = {
    "T4": "https://www.nvidia.com/en-us/data-center/tesla-t4/",
    "A100": "https://www.nvidia.com/en-us/data-center/a100/",
    "H100": "https://www.nvidia.com/en-us/data-center/h100/",
    "H200": "https://www.nvidia.com/en-us/data-center/h200/",
}
# Dense fp16 tensor-core FLOP/s and memory bandwidth (bytes/s), from the same datasheets (SXM parts; the larger
# tensor-core figures printed there assume 2:4 sparsity).
ROOFLINE_GPUS = {"A100 80GB SXM": (312e12, 2.039e12), "H100 SXM": (989e12, 3.35e12), "H200 SXM": (989e12, 4.8e12)}


def _pd():
    import pandas as pd

    return pd


def model_table(dtype="fp16"):
    """REAL_MODELS with their KV bytes per token and at full context, weights, and the GQA group (H / H_KV)."""
    df = _pd().DataFrame(kv_table(dtype))
    df["GQA group"] = df["n_heads"] // df["n_kv_heads"]
    cols = ["name", "n_layers", "n_heads", "n_kv_heads", "head_dim", "max_context", "GQA group", "kv_per_token_KiB",
            "kv_full_context_GiB", "weights_GiB"]
    return df[cols].round({"kv_per_token_KiB": 1, "kv_full_context_GiB": 2, "weights_GiB": 1}).set_index("name")


def _verdict(m: ModelSpec, f, context: int) -> str:
    if f.free_bytes <= 0:
        return "weights alone too big"
    if context > m.max_context:
        return "beyond the model's max context"
    if not f.fits:
        return f"cache {f.kv_bytes / f.free_bytes:.1f}x what is left"
    return f"fits ({f.kv_bytes / f.free_bytes:.0%} of what is left)"


def fit_frame(cases, reserve_gib: float = 2.0):
    """One row per (model name, GPU GiB, context, batch[, KV dtype]): ``kvlib.memory.fit``'s answer as a table."""
    rows = []
    for case in cases:
        name, gpu_gib, context, batch, *rest = case
        kv_dtype = rest[0] if rest else "fp16"
        m = spec(name)
        f = fit(m, int(gpu_gib * GiB), batch, context, kv_dtype, reserve_bytes=int(reserve_gib * GiB))
        rows.append({"model": m.name, "GPU GiB": gpu_gib, "batch": batch, "context": context, "KV dtype": kv_dtype,
                     "weights GiB": round(f.weight_bytes / GiB, 1), "KV GiB": round(f.kv_bytes / GiB, 2),
                     "left GiB": round(f.free_bytes / GiB, 2), "verdict": _verdict(m, f, context),
                     "max batch at this context": f.max_batch if context <= m.max_context else None,
                     "max context at this batch": f.max_context if f.free_bytes > 0 else None,
                     "context limited by": f.context_limit if f.free_bytes > 0 else None})
    df = _pd().DataFrame(rows).set_index("model")
    for col in ("max batch at this context", "max context at this batch"):
        df[col] = df[col].astype("Int64")  # whole numbers, blank where they do not apply
    return df


CALCULATOR_DEFAULT = dict(name="Llama-3-8B", gpu_gib=80, context=4096, batch=8, kv_dtype="fp16")


def calculator(**default):
    """The widget calculator: pick a model, a KV dtype and a GPU, drag batch and context (needs ipywidgets).
    Its output is ``fit_frame`` of the chosen setting; the default is ``CALCULATOR_DEFAULT``."""
    import ipywidgets as w
    from IPython.display import display

    d = {**CALCULATOR_DEFAULT, **default}
    ui = dict(
        name=w.Dropdown(options=[m.name for m in REAL_MODELS], value=d["name"], description="model"),
        kv_dtype=w.Dropdown(options=[("fp32", "fp32"), ("fp16", "fp16"), ("int8 + fp16 scales", "int8")],
                            value=d["kv_dtype"], description="KV dtype"),
        gpu_gib=w.Dropdown(options=[(k, v) for k, v in GPUS.items()] + [("RTX 4090 24 GB", 24)], value=d["gpu_gib"],
                           description="GPU"),
        batch=w.IntSlider(value=d["batch"], min=1, max=256, description="batch"),
        context=w.IntSlider(value=d["context"], min=256, max=131072, step=256, description="context"),
    )
    show = lambda name, gpu_gib, context, batch, kv_dtype: display(  # noqa: E731
        fit_frame([(name, gpu_gib, context, batch, kv_dtype)]).T)
    return w.interactive(show, **ui)


def longest_context_frame(m: ModelSpec, gpus=None, batches=(1, 16), dtype="fp16"):
    """The longest context each of ``batch`` sequences can hold on each GPU after ``m``'s weights (no reserve)."""
    gpus = gpus or GPUS
    rows = []
    for name, gib in gpus.items():
        row = {"GPU": name}
        for b in batches:
            row[f"batch {b}: max context"] = max_context(m, gib * GiB, b, dtype, dtype)
        rows.append(row)
    return _pd().DataFrame(rows).set_index("GPU")


def layout_frame(smol: ModelSpec, S: int = 256, block: int = 16):
    """Build every kvlib cache for ``smol``'s shape (S tokens) and count the bytes of every buffer it allocates."""
    from kvlib.paged import PagedKVCache  # chapter 05 builds it; here we only count its bytes
    from kvlib.quant import Int8KVCache  # chapter 06 builds it; here we only count its bytes

    L, H, D = smol.n_layers, smol.n_kv_heads, smol.head_dim
    layouts = {"KVCache fp32": (KVCache(L, 1, H, S, D, dtype=torch.float32), "fp32"),
               "KVCache fp16": (KVCache(L, 1, H, S, D, dtype=torch.float16), "fp16"),
               "Int8KVCache": (Int8KVCache(L, 1, H, S, D), "int8"),
               "PagedKVCache fp16": (PagedKVCache(L, S // block, block, H, D, dtype=torch.float16), "fp16")}
    rows = []
    for name, (cache, dtype) in layouts.items():
        buffers = cache.k + cache.v + getattr(cache, "k_scale", []) + getattr(cache, "v_scale", [])
        allocated = sum(t.numel() * t.element_size() for t in buffers)
        rows.append({"cache": name,
                     "one layer's buffers": ", ".join(sorted({f"{tuple(t.shape)} {str(t.dtype)[6:]}" for t in buffers})),
                     "buffers": len(buffers), "values alone (B/token)": kv_cache_bytes(L, H, D, 1, 1, dtype),
                     "predicted (B/token)": smol.kv_bytes_per_token(dtype), "allocated (B/token)": allocated // S,
                     "whole tokens": allocated % S == 0})
    return _pd().DataFrame(rows).set_index("cache")


def measured_what(device) -> str:
    return "torch.cuda.memory_allocated" if device == "cuda" else "the resident memory (RSS) of a fresh process"


def measure_caches(device, smol: ModelSpec, block: int = 16, progress=None):
    """Predicted vs measured bytes: a small Llama-style cache (4 layers, H_KV=8, D=64, batch 2, fp16) at growing
    context, then kvlib's caches for ``smol`` at its full context, each built and measured by
    ``kvlib.memory.measure_allocation`` (``progress``: e.g. ``tqdm.auto.tqdm``). Returns a DataFrame (None where the
    memory cannot be read)."""
    from kvlib.paged import PagedKVCache
    from kvlib.quant import Int8KVCache

    contexts = runtime.by_mode(cpu=[256, 1024, 4096, 16384], gpu=[1024, 4096, 16384, 65536, 262144])
    L, H, D, full = smol.n_layers, smol.n_kv_heads, smol.head_dim, smol.max_context
    rows = [(f"4 layers, batch 2, S={S:,}", S, (KVCache, (4, 2, 8, S, 64), dict(dtype=torch.float16, device=device)),
             kv_cache_bytes(4, 8, 64, S, 2, "fp16"), 8) for S in contexts]
    smol_builds = {"KVCache fp32": ((KVCache, (L, 1, H, full, D), dict(dtype=torch.float32, device=device)), "fp32", 2),
                   "KVCache fp16": ((KVCache, (L, 1, H, full, D), dict(dtype=torch.float16, device=device)), "fp16", 2),
                   "Int8KVCache": ((Int8KVCache, (L, 1, H, full, D), dict(device=device)), "int8", 4),
                   "PagedKVCache fp16": ((PagedKVCache, (L, full // block, block, H, D),
                                          dict(dtype=torch.float16, device=device)), "fp16", 2)}
    rows += [(f"{smol.name} {name}, S={full:,}", full, build, smol.kv_bytes_per_token(d) * full, n * L)
             for name, (build, d, n) in smol_builds.items()]
    grown = measure_allocation([r[2] for r in rows], device, progress=progress)
    if grown is None:
        return None
    table = _pd().DataFrame([{"cache": name, "tokens": S, "buffers": n, "predicted (bytes)": p, "measured (bytes)": g}
                             for (name, S, _, p, n), g in zip(rows, grown)]).set_index("cache")
    table["measured - predicted"] = table["measured (bytes)"] - table["predicted (bytes)"]
    table["per buffer"] = (table["measured - predicted"] / table["buffers"]).round().astype(int)
    table["relative (%)"] = (100 * table["measured - predicted"] / table["predicted (bytes)"]).round(3)
    return table


def memory_ok(table, device) -> bool:
    """Every cache took its formula's bytes, give or take the allocator's rounding: on a GPU at most 64 KiB
    more (512-byte blocks); on a CPU at most two pages per buffer plus 1 MiB of other objects."""
    page = mmap.PAGESIZE
    diff, n = table["measured - predicted"], table["buffers"]
    if device == "cuda":
        return bool(((diff >= 0) & (diff <= 2**16)).all())
    return bool((diff.abs() <= n * 2 * page + 2**20).all())


def plot_measured(table, device_name: str | None = None):
    """Left: predicted (line) and measured (markers) MiB against context for the small cache. Right: what the
    measurement added beyond the formula, per buffer, for every cache (bars), with one page marked."""
    import matplotlib.pyplot as plt

    small = table[table.index.str.startswith("4 layers")]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1, 1.3]})
    x, mib = small["tokens"].tolist(), (small["predicted (bytes)"] / 2**20).tolist()
    a.plot(x, mib, "-", color="#4C72B0", linewidth=2.5, label="predicted (formula)", zorder=1)
    a.plot(x, (small["measured (bytes)"] / 2**20).tolist(), "o", markersize=9, markerfacecolor="none",
           markeredgewidth=2, color="#C44E52", label="measured", zorder=2)
    a.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="KV cache (MiB)")
    a.set_xticks(x, [f"{c:,}" for c in x])
    a.set_yticks(mib, [f"{v:g}" for v in mib])
    a.xaxis.set_minor_formatter(plt.NullFormatter())
    a.yaxis.set_minor_formatter(plt.NullFormatter())
    a.set_title("4 layers, H_KV=8, D=64, batch 2, fp16", fontsize=10)
    a.legend(fontsize=8)
    a.grid(True, alpha=0.3)
    labels = [s.replace("SmolLM2-135M ", "").replace(", S=", "\nS=") for s in table.index]
    b.bar(range(len(table)), (table["per buffer"] / 1024).tolist(), color="#8172B3")
    b.axhline(mmap.PAGESIZE / 1024, color="#333333", linestyle="--", linewidth=1, label=f"one page ({mmap.PAGESIZE:,} B)")
    b.set_xticks(range(len(table)), labels, fontsize=6.5, rotation=35, ha="right")
    b.set_ylabel("measured - predicted, per buffer (KiB)")
    b.set_title("what the allocator added beyond the formula", fontsize=10)
    b.legend(fontsize=8)
    b.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Predicted vs measured KV bytes ({measured_what(runtime.DEVICE)})\n"
                 f"{device_name or runtime.device_name()}", fontsize=10)
    fig.tight_layout()
    return fig


def ridge_frame(models, gpus=None, dtype="fp16"):
    """For each GPU: its ridge point (FLOP/s over bytes/s) and, for each model, how many times slower recomputing
    a token's K/V (a forward pass over it, 2N FLOPs) is than reading its cached bytes."""
    gpus = gpus or ROOFLINE_GPUS
    rows = []
    for name, (flops, bw) in gpus.items():
        row = {"GPU": name, "TFLOP/s": flops / 1e12, "TB/s": bw / 1e12, "ridge point (FLOP/byte)": round(flops / bw)}
        for m in models:
            need = 2 * m.n_params / m.kv_bytes_per_token(dtype)  # FLOPs spent per byte of cache not read
            row[f"{m.name}: recompute / read"] = round(need / (flops / bw))
        rows.append(row)
    return _pd().DataFrame(rows).set_index("GPU")


def vllm_capacity(m: ModelSpec, gpu_bytes: int, utilization: float, max_model_len: int, kv_dtype="fp16",
                  weight_dtype="fp16", other_bytes: int = 0, block_size: int = 16) -> tuple[int, float]:
    """vLLM's startup arithmetic, as an upper bound: (KV cache size in tokens, maximum concurrency).

    vLLM gives the KV cache ``utilization x GPU memory`` minus the weights and what its startup profiling
    measures (activations, CUDA graphs: ``other_bytes`` here, 0 by default, so this is an upper bound), cuts it
    into blocks of ``block_size`` tokens, and logs blocks x block_size tokens and that over ``max_model_len``.
    """
    per_token = m.kv_bytes_per_token(kv_dtype)
    budget = int(utilization * gpu_bytes) - m.weight_bytes(weight_dtype) - other_bytes
    blocks = max(0, budget // (per_token * block_size))
    tokens = blocks * block_size
    return tokens, tokens / max_model_len


def hf_cache_tensors(cache) -> list:
    """The K and V tensors a ``transformers`` cache (``DynamicCache``, ``StaticCache``) holds, every layer:
    ``cache.layers[i].keys/.values`` in transformers 5, ``cache.key_cache/.value_cache`` in 4.x."""
    if hasattr(cache, "layers"):
        return [t for layer in cache.layers for t in (layer.keys, layer.values) if t is not None]
    return [t for t in list(cache.key_cache) + list(cache.value_cache) if t is not None]
