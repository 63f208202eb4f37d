"""Chapter 07's plumbing: tables, harnesses and plots that leave the notebook's cells.

The chapter's teaching lives in ``kvlib.gqa`` (``repeat_kv``, the grouped decode kernel, ``mha_to_gqa``) and
in the notebook; this module measures and formats:

- ``kind_table``: MHA / GQA / MQA of the real configs of chapter 04, with the saving (h - g) / h;
- ``schedule_loads``, ``schedule_bytes``: what each decode schedule loads, counted from the schedule;
- ``kernel_errors``: the three schedules against the reference on one random GQA cache;
- ``measure_gqa_cache``: the bytes a GQA cache and its MHA twin really take (resident memory or the CUDA
  allocator, through chapter 04's ``measure_allocation``), beside the formula;
- ``CaptureQKV``, ``MappedAttention``: stand-in caches (chapter 03's seam) that record one layer's q/k/v, or make
  every layer read K/V heads through a given head map;
- ``next_token_scores``: loss and accuracy of the next tokens of a text under a head map;
- ``hf_twin``: SmolLM2 as a ``transformers`` model with the same weights, its GQA config and logits beside ours;
- ``conversion_quality`` + ``plot_quality``: the MHA -> GQA conversion of the tiny model, fine-tuned, against
  controls, as a table and a figure;
- ``tp_table``: the K/V heads each GPU holds under tensor parallelism, by vLLM's and SGLang's rule;
- ``LAB_CHOICE``, ``kv_heads_evidence``, ``check_kv_heads_choice``: lab 07's decision (how many K/V heads).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from kvlib import runtime
from kvlib.attention import attention_ref
from kvlib.cache import KVCache, decode_attention, decode_attention_ref
from kvlib.gqa import finetune, grouped_decode_attention, mha_to_gqa, repeat_kv
from kvlib.memory import REAL_MODELS, kv_cache_bytes, measure_allocation
from kvlib.train import evaluate

__all__ = ["kind_table", "schedule_loads", "schedule_bytes", "kernel_errors", "measure_gqa_cache", "CaptureQKV",
           "MappedAttention", "next_token_scores", "hf_twin", "conversion_quality", "plot_quality", "tiny_train_log", "tp_table", "LAB_CHOICE",
           "kv_heads_evidence", "check_kv_heads_choice"]


def _pd():
    import pandas as pd

    return pd


def kind_table(dtype="fp16"):
    """One row per real config: h, g, its kind, the saving (h - g) / h and its KV bytes per token."""
    rows = []
    for m in REAL_MODELS:
        kind = "MHA" if m.n_kv_heads == m.n_heads else ("MQA" if m.n_kv_heads == 1 else "GQA")
        rows.append({"model": m.name, "h (query heads)": m.n_heads, "g (K/V heads)": m.n_kv_heads, "kind": kind,
                     "saving (h-g)/h": round((m.n_heads - m.n_kv_heads) / m.n_heads, 3),
                     f"KV per token, {dtype} (KiB)": m.kv_bytes_per_token(dtype) / 1024})
    return _pd().DataFrame(rows).set_index("model")


def schedule_loads(H: int, H_KV: int) -> dict[str, tuple[int, int]]:
    """(K/V head loads, K/V head copies written) of one decode step, per schedule, for one sequence and layer."""
    return {"repeat K/V": (H_KV + H, H), "per query head": (H, 0), "grouped": (H_KV, 0)}


def schedule_bytes(H: int, H_KV: int, D: int, S: int, elem_bytes: int = 2) -> dict[str, int]:
    """Bytes each schedule moves per decode step and layer for one sequence: every load and every write of one
    K/V head's S positions (K and V, D numbers each)."""
    head = 2 * S * D * elem_bytes  # K and V of one head
    return {name: (loads + writes) * head for name, (loads, writes) in schedule_loads(H, H_KV).items()}


def kernel_errors(B=2, H=32, H_KV=8, S=100, D=64, lens=(100, 37), seed=0) -> dict[str, float]:
    """max |out - decode_attention_ref| of the grouped kernel, chapter 03's per-query-head kernel and repeat K/V
    followed by that kernel, on one random GQA cache with ragged lengths (in the interpreter on a CPU)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g).to(runtime.DEVICE) for shape in
               ((B, H, D), (B, H_KV, S, D), (B, H_KV, S, D)))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=runtime.DEVICE)
    ref = decode_attention_ref(q, k, v, seq_lens)
    n_rep = H // H_KV
    outs = {"grouped kernel": grouped_decode_attention(q, k, v, seq_lens),
            "per-query-head kernel": decode_attention(q, k, v, seq_lens),
            "repeat K/V + per-query-head kernel": decode_attention(q, repeat_kv(k, n_rep).contiguous(),
                                                                   repeat_kv(v, n_rep).contiguous(), seq_lens)}
    return {name: (out - ref).abs().max().item() for name, out in outs.items()}


def measure_gqa_cache(config, seq_len: int = 1024, dtype=torch.float16):
    """A ``KVCache`` for ``config``'s shape (its K/V heads) and one for its MHA twin (a K/V head per query head),
    each built in turn and measured by ``kvlib.memory.measure_allocation`` (resident memory of a fresh process
    on a CPU, ``torch.cuda.memory_allocated`` on a GPU), beside ``kv_cache_bytes``. Returns a DataFrame, or None
    where the memory cannot be read."""
    device = "cuda" if runtime.mode() == "gpu" else "cpu"
    L, D = config.n_layers, config.head_dim
    shapes = {f"GQA, {config.n_kv_heads} K/V heads": config.n_kv_heads, f"MHA twin, {config.n_heads} K/V heads": config.n_heads}
    builds = [(KVCache, (L, 1, h_kv, seq_len, D), dict(dtype=dtype, device=device)) for h_kv in shapes.values()]
    grown = measure_allocation(builds, device)
    if grown is None:
        return None
    rows = [{"cache": name, "tokens": seq_len, "buffers": 2 * L,
             "predicted (bytes)": kv_cache_bytes(L, h_kv, D, seq_len, 1, dtype), "measured (bytes)": got}
            for (name, h_kv), got in zip(shapes.items(), grown)]
    table = _pd().DataFrame(rows).set_index("cache")
    table["measured - predicted"] = table["measured (bytes)"] - table["predicted (bytes)"]
    return table


class CaptureQKV:
    """A stand-in cache: records one layer's q, k, v (after RoPE) and attends over the tokens given."""

    def __init__(self, layer):
        self.layer, self.qkv = layer, None

    def attend(self, layer_idx, q, k, v):
        if layer_idx == self.layer:
            self.qkv = q, k, v  # (B, H, T, D), (B, H_KV, T, D), (B, H_KV, T, D)
        return attention_ref(q, k, v, causal=True)


class MappedAttention:
    """A stand-in cache: in every layer, query head h reads K/V head head_map[h]."""

    def __init__(self, head_map):
        self.head_map = list(head_map)

    def attend(self, layer_idx, q, k, v):
        return attention_ref(q, k[:, self.head_map], v[:, self.head_map], causal=True)


@torch.no_grad()
def next_token_scores(model, ids: torch.Tensor, head_map=None) -> tuple[float, float]:
    """(loss in nats/token, share of next tokens predicted) of ``model`` on ``ids`` (1, T); with ``head_map``,
    every layer's query head h reads K/V head head_map[h]."""
    cache = None if head_map is None else MappedAttention(head_map)
    logits = model(ids, cache=cache)[0, :-1]
    targets = ids[0, 1:]
    return F.cross_entropy(logits, targets).item(), (logits.argmax(-1) == targets).float().mean().item()


def hf_twin(model, ids: torch.Tensor):
    """``model``'s weights in a ``transformers`` ``LlamaForCausalLM`` (through ``kvlib.bench.peers``), run on
    ``ids`` with a ``DynamicCache``. Returns (the twin's config, max |logits - ours|, the K tensor of its cache's
    first layer), or None when transformers is not installed."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    from transformers import DynamicCache

    from kvlib.bench.peers import hf_model_from_kvlib

    from .ch04 import hf_cache_tensors

    import inspect

    hf = hf_model_from_kvlib(model)
    cache = DynamicCache()
    arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"  # 5.x / 4.x
    with torch.no_grad():
        theirs = hf(ids.cpu(), use_cache=True, **{arg: cache}).logits
        ours = model(ids)
    k0 = hf_cache_tensors(cache)[0]
    return hf.config, (theirs - ours.cpu()).abs().max().item(), k0


def conversion_quality(model, train_ids, val_ids, runs=((4, 5e-5), (2, 5e-5), (1, 5e-5), (4, 5e-4)), *,
                       control_lrs=(5e-4, 5e-5), steps=100, batch=8, seq=128, windows=32, progress=False):
    """The MHA ``model`` converted by mean-pooling (``mha_to_gqa``) to g K/V heads and fine-tuned ``steps`` steps at
    learning rate lr, for each (g, lr) of ``runs``, beside controls: the MHA model fine-tuned the same way (seed 0,
    the same batches) at each rate of ``control_lrs``. Held-out loss (nats/byte over ``windows`` windows of 128
    bytes) before and after, and greedy agreement with the original on a held-out window of 512 bytes.
    Returns a DataFrame, one row per model, the original first."""
    probe = val_ids[:513][None]
    with torch.no_grad():
        ref_next = model(probe).argmax(-1)

    def scores(m):
        with torch.no_grad():
            agree = (m(probe).argmax(-1) == ref_next).float().mean().item()
        return evaluate(m, val_ids, 128, max_windows=windows), agree

    loss0, _ = scores(model)
    H = model.config.n_kv_heads
    rows = [dict(model=f"original (MHA, {H} K/V heads)", kv_heads=H, lr=float("nan"), before=loss0, after=loss0,
                 agreement=1.0)]
    for lr in control_lrs:
        control = copy.deepcopy(model)
        finetune(control, train_ids, steps=steps, batch=batch, seq_len=seq, lr=lr, progress=progress)
        rows.append(dict(model=f"control (MHA), lr {lr:.0e}", kv_heads=H, lr=lr, before=loss0,
                         **dict(zip(("after", "agreement"), scores(control)))))
    for g, lr in runs:
        torch.manual_seed(0)
        converted = mha_to_gqa(model, g)
        before = scores(converted)[0]
        finetune(converted, train_ids, steps=steps, batch=batch, seq_len=seq, lr=lr, progress=progress)
        rows.append(dict(model=f"{'MQA' if g == 1 else 'GQA'}, {g} K/V heads, lr {lr:.0e}", kv_heads=g, lr=lr,
                         before=before, **dict(zip(("after", "agreement"), scores(converted)))))
    table = _pd().DataFrame(rows).set_index("model")
    table.columns = ["K/V heads", "fine-tune lr", "val loss before", "val loss after", "agreement after"]
    table["after vs original (%)"] = 100 * (table["val loss after"] - loss0) / loss0
    return table


def tiny_train_log() -> dict:
    """The tiny model's training log (``kvlib/assets/tiny/train_log.json``), with ``final_lr``: the learning rate
    its cosine schedule ended at (``kvlib.train.lr_at`` at the last step)."""
    import json
    from pathlib import Path

    from kvlib.train import lr_at

    log = json.loads((Path(__file__).resolve().parents[1] / "assets" / "tiny" / "train_log.json").read_text())
    return {**log, "final_lr": lr_at(log["steps"], log["steps"], log["peak_lr"], 0)}


def plot_quality(table, unigram: float | None = None):
    """Held-out loss against K/V heads: right after pooling and after each fine-tune (one line per learning rate),
    the original and each control as horizontal lines, and the unigram baseline (a model that ignores context)."""
    import matplotlib.pyplot as plt

    conv = table[table.index.str.contains("GQA|MQA")]
    fig, ax = plt.subplots(figsize=(8.5, 4.6))
    first = conv[conv["fine-tune lr"] == conv["fine-tune lr"].iloc[0]]
    ax.plot(first["K/V heads"].tolist(), first["val loss before"].tolist(), "o--", color="#C44E52",
            label="converted, right after mean-pooling")
    colors = ["#4C72B0", "#8172B3"]
    for i, (lr, rows) in enumerate(conv.groupby("fine-tune lr", sort=False)):
        ax.plot(rows["K/V heads"].tolist(), rows["val loss after"].tolist(), "o-" if len(rows) > 1 else "s",
                color=colors[i % 2], linewidth=2, markersize=8, label=f"converted, after the fine-tune at lr {lr:.0e}")
    original = table["val loss after"].iloc[0]
    ax.axhline(original, color="#222222", linewidth=1.2, label="original MHA model")
    for i, (name, row) in enumerate(table[table.index.str.startswith("control")].iterrows()):
        ax.axhline(row["val loss after"], color="#55A868", linestyle=[":", "-."][i % 2], linewidth=1.5,
                   label=f"MHA control, fine-tuned at lr {row['fine-tune lr']:.0e}")
    if unigram is not None:
        ax.axhline(unigram, color="#BBBBBB", linestyle="--", linewidth=1, label="unigram baseline (no context)")
    heads = sorted(set(conv["K/V heads"].tolist()) | {int(table["K/V heads"].iloc[0])})
    ax.set_xscale("log", base=2)
    ax.set_xticks(heads, [str(h) for h in heads])
    ax.minorticks_off()
    ax.invert_xaxis()
    ax.set(xlabel="K/V heads (8 query heads; 8 is the original MHA)", ylabel="held-out loss (nats/byte)",
           title="The tiny model converted from MHA to GQA/MQA: held-out loss")
    ax.legend(fontsize=7.5, loc="upper left")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig


def tp_table(m, tps=(1, 2, 4, 8, 16), dtype="fp16"):
    """Tensor parallelism over ``tps`` GPUs: the query heads and the K/V heads each GPU holds, by the rule vLLM and
    SGLang apply to ``num_key_value_heads`` (``get_num_kv_heads``: max(1, H_KV // TP), so a K/V head is copied
    onto several GPUs once TP passes H_KV), and the cache bytes per token per GPU and in all."""
    rows = []
    for tp in tps:
        kv = max(1, m.n_kv_heads // tp)
        per_gpu = kv_cache_bytes(m.n_layers, kv, m.head_dim, 1, 1, dtype)
        rows.append({"TP (GPUs)": tp, "query heads per GPU": m.n_heads // tp, "K/V heads per GPU": kv,
                     "KV bytes/token per GPU": per_gpu, "KV bytes/token, all GPUs": per_gpu * tp,
                     "copies of each K/V head": max(1, tp // m.n_kv_heads)})
    return _pd().DataFrame(rows).set_index("TP (GPUs)")


# --------------------------------------------------------------------------------------------
# Lab 07's decision: how many K/V heads
# --------------------------------------------------------------------------------------------

# A new model's shape and its serving target: 64 sequences of 8,192 tokens, fp16 cache, on an 80 GiB GPU.
LAB_CHOICE = dict(n_layers=32, n_heads=32, head_dim=128, batch=64, seq_len=8192, dtype="fp16", gpu_gib=80,
                  weights_gib=15, reserve_gib=2)


def kv_heads_evidence(c=None):
    """For every K/V head count that divides the query heads: the cache's GiB and whether it fits what is left."""
    from kvlib.memory import GiB

    c = c or LAB_CHOICE
    left = c["gpu_gib"] - c["weights_gib"] - c["reserve_gib"]
    rows = []
    for g in [d for d in range(c["n_heads"], 0, -1) if c["n_heads"] % d == 0]:
        cache = kv_cache_bytes(c["n_layers"], g, c["head_dim"], c["seq_len"], c["batch"], c["dtype"]) / GiB
        cache = int(cache) if cache.is_integer() else round(cache, 2)  # whole GiB here: printed as exact integers
        rows.append({"K/V heads": g, "cache (GiB)": cache, "left for it (GiB)": left, "fits": cache <= left})
    return _pd().DataFrame(rows).set_index("K/V heads")


def check_kv_heads_choice(yours) -> bool:
    """Lab 07's decision: the largest number of K/V heads whose cache fits. Prints yours vs the reference, then
    the evidence; a wrong choice fails with the reason for it."""
    from . import mistakes
    from .check import CheckFailed

    evidence = kv_heads_evidence()
    ref = int(evidence.index[evidence["fits"]].max())
    ok = isinstance(yours, int) and not isinstance(yours, bool) and yours == ref
    print(f"K/V heads: yours {yours!r}  reference {ref}  " + ("✓" if ok else "✗"))
    print(evidence.to_string())
    if ok:
        print("PASS ✓")
        return True
    why = mistakes.kv_heads_choice()
    if isinstance(yours, int) and not isinstance(yours, bool) and yours >= 1 and LAB_CHOICE["n_heads"] % yours == 0:
        reason = why.get(yours, "not the largest count whose cache fits what the GPU has left")
    else:
        reason = why["not a divisor"]
    raise CheckFailed(f"FAIL ✗\n  {reason}")
