"""Chapter 07's plumbing: tables, harnesses and plots that leave the notebook's cells.

The chapter's teaching lives in ``kvlib.gqa`` (``repeat_kv``, the grouped decode kernel, ``mha_to_gqa``) and
in the notebook; this module measures and formats:

- ``kind_table``: MHA / GQA / MQA of the real configs of chapter 04, with the saving (H - H_KV) / H;
- ``schedule_loads``, ``schedule_bytes``: what each decode schedule loads, counted from the schedule;
- ``kernel_errors``: the three schedules against the reference on one random GQA cache;
- ``measure_gqa_cache``: the bytes a GQA cache and its MHA twin really take (resident memory or the CUDA
  allocator, through chapter 04's ``measure_allocation``), beside the formula;
- ``CaptureQKV``, ``MappedAttention``: stand-in caches (chapter 03's seam) that record one layer's q/k/v, or make
  every layer read K/V heads through a given head map;
- ``next_token_scores``: loss and accuracy of the next tokens of a text under a head map;
- ``hf_twin``: SmolLM2 as a ``transformers`` model with the same weights, its GQA config and logits beside ours;
- ``lr_schedule``, ``finetune_scheduled``, ``conversion_quality``, ``budget_line``, ``plot_quality``: the MHA -> GQA
  conversion of the tiny model, fine-tuned with a warm-up and a decay, against a control fine-tuned alike;
- ``kernel_excerpt``, ``hf_gqa_branches``, ``grouped_vs_per_head``: the grouped kernel's source, transformers'
  GQA branches with their conditions, and the committed GPU timings of grouped vs per-query-head;
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
           "MappedAttention", "next_token_scores", "hf_twin", "hf_gqa_branches", "kernel_excerpt", "grouped_vs_per_head",
           "lr_schedule", "finetune_scheduled", "conversion_quality", "budget_line", "plot_quality", "tiny_train_log", "tp_table", "LAB_CHOICE",
           "kv_heads_evidence", "check_kv_heads_choice"]


def _pd():
    import pandas as pd

    return pd


def kind_table(dtype="fp16"):
    """One row per real config: H, H_KV, its kind, the saving (H - H_KV) / H and its KV bytes per token."""
    rows = []
    for m in REAL_MODELS:
        kind = "MHA" if m.n_kv_heads == m.n_heads else ("MQA" if m.n_kv_heads == 1 else "GQA")
        rows.append({"model": m.name, "H (query heads)": m.n_heads, "H_KV (K/V heads)": m.n_kv_heads, "kind": kind,
                     "saving (H-H_KV)/H": round((m.n_heads - m.n_kv_heads) / m.n_heads, 3),
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


def hf_twin(model, ids: torch.Tensor, folder=None):
    """``model``'s weights in a ``transformers`` ``LlamaForCausalLM`` (through ``kvlib.bench.peers``, SDPA
    attention), run on ``ids`` with a ``DynamicCache``. Returns (the twin's config, max |logits - ours|, the K
    tensor of its cache's first layer, how many attention calls took each of the SDPA path's three GQA branches),
    or None when transformers is not installed.

    ``folder``: where ``kvlib.model.save_hf`` already wrote ``model``'s checkpoint (``load_pretrained``'s converted
    copy): read from there instead of writing the same files again (the logits compared show it is the same model)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    import inspect

    from transformers import DynamicCache

    from kvlib.bench.peers import hf_model_from_kvlib

    from .ch04 import hf_cache_tensors

    if folder is None:
        hf = hf_model_from_kvlib(model)
    else:
        from kvlib.bench.peers import _quiet_transformers

        with _quiet_transformers():
            hf = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                               attn_implementation="sdpa").eval()
    cache = DynamicCache()
    arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"  # 5.x / 4.x
    with torch.no_grad(), _count_gqa_branches() as branches:
        theirs = hf(ids.cpu(), use_cache=True, **{arg: cache}).logits
    with torch.no_grad():
        ours = model(ids)
    k0 = hf_cache_tensors(cache)[0]
    return hf.config, (theirs - ours.cpu()).abs().max().item(), k0, branches


class _count_gqa_branches:
    """Counts, while active, the calls of transformers' SDPA path that take each GQA branch: ``enable_gqa``
    (``use_gqa_in_sdpa`` said yes), ``pack_gqa`` (a one-token query) or ``repeat_kv`` (the copy)."""

    def __enter__(self):
        self.counts = {"enable_gqa": 0, "pack_gqa": 0, "repeat_kv": 0}
        try:
            from transformers.integrations import sdpa_attention as mod
        except ImportError:
            self.mod = None
            return self.counts
        self.mod, self.saved = mod, {n: getattr(mod, n, None) for n in ("use_gqa_in_sdpa", "repeat_kv")}
        use, rep, counts = self.saved["use_gqa_in_sdpa"], self.saved["repeat_kv"], self.counts

        def use_gqa(*a, **kw):
            yes = use(*a, **kw)
            counts["enable_gqa" if yes else "pack_gqa"] += 1  # corrected below for the calls that copy
            return yes

        def repeat(x, n, *a, **kw):
            counts["repeat_kv"] += 1  # key and value: two per call
            return rep(x, n, *a, **kw)

        if use is not None and rep is not None:
            mod.use_gqa_in_sdpa, mod.repeat_kv = use_gqa, repeat
        return self.counts

    def __exit__(self, *exc):
        if self.mod is not None:
            for name, fn in self.saved.items():
                if fn is not None:
                    setattr(self.mod, name, fn)
            copies = self.counts["repeat_kv"] // 2
            self.counts.update(repeat_kv=copies, pack_gqa=self.counts["pack_gqa"] - copies)
        return False


def hf_gqa_branches() -> str | None:
    """The lines of the installed transformers' SDPA path that choose how the query heads read the shared K/V heads
    (the ``if``/``elif``/``else`` and what each does), followed by ``use_gqa_in_sdpa``'s condition; None where this
    version keeps them elsewhere or transformers is not installed."""
    import inspect

    try:
        from transformers.integrations import sdpa_attention as mod
    except ImportError:
        return None
    lines = inspect.getsource(mod.sdpa_attention_forward).splitlines()
    try:
        first = next(i for i, line in enumerate(lines) if "num_key_value_groups" in line and line.strip().startswith("if"))
        last = max(i for i, line in enumerate(lines) if "repeat_kv(value" in line)
    except (StopIteration, ValueError):
        return None
    chosen = [line for line in lines[first: last + 1] if line.strip()]
    if hasattr(mod, "use_gqa_in_sdpa"):
        cond = inspect.getsource(mod.use_gqa_in_sdpa).splitlines()
        chosen += ["", "# use_gqa_in_sdpa(attention_mask, key, value):"] + [
            line for line in cond[1:] if line.strip().startswith(("if", "elif", "return", "#"))]
    return "\n".join(chosen)


def kernel_excerpt() -> str:
    """Three excerpts of ``kvlib.gqa._grouped_decode_kernel``: the group's query rows loaded as one (GROUP, D) tile
    with the padding rows masked, the loop over the cached positions (online softmax, one row per query head),
    and the store of the group's rows, each separated by a ``...`` line."""
    import inspect

    import kvlib.gqa

    src = inspect.getsource(kvlib.gqa._grouped_decode_kernel.fn).splitlines()

    def span(first, last):
        i = next(n for n, line in enumerate(src) if line.strip().startswith(first))
        j = next(n for n in range(i, len(src)) if src[n].strip().startswith(last))
        return src[i: j + 1]

    parts = [span("g = tl.arange(0, GROUP)", "mask=g_ok[:, None] & dim_ok"), span("for pos0", "m_i = m_new"),
             span("out_rows =", "mask=g_ok[:, None] & dim_ok")]
    return "\n    ...\n".join("\n".join(p) for p in parts)


def grouped_vs_per_head(rows=None, label=None, at_most: float = 1.1) -> list[str]:
    """From the ``grouped`` sweep's rows (default: the committed GPU results, ``kvlib.bench.results.reference``):
    per head layout, the grouped kernel's speed over the per-query-head kernel's (time per-query-head / time
    grouped) at each size, as its range, and the sizes where it is at most ``at_most`` times as fast."""
    import statistics

    if rows is None:
        from kvlib.bench import results

        label, rows = results.reference("grouped")
        if not rows:
            return [results.NO_REFERENCE]
        label = label.split(",")[0] + ", " + label.rsplit(",", 1)[-1].strip()
    times = {(r["kernel"], r["H"], r["H_KV"], r["B"], r["S"]): r["time_ms"] for r in rows
             if r.get("sweep") == "grouped" and r.get("time_ms")}
    lines = []
    for H, H_KV in sorted({(k[1], k[2]) for k in times}):
        pts = sorted((B, S, times[("per-query-head decode", H, H_KV, B, S)] / times[("grouped decode", H, H_KV, B, S)])
                     for (kern, h, hk, B, S) in times if (h, hk) == (H, H_KV) and kern == "grouped decode"
                     and ("per-query-head decode", H, H_KV, B, S) in times)
        if not pts:
            continue
        speed = [p[2] for p in pts]
        slow = ", ".join(f"B={B} S={S:,} ({x:.2f}x)" for B, S, x in pts if x <= at_most) or "none"
        lines.append(f"{label}: {H}/{H_KV} heads, grouped vs per-query-head speed over {len(pts)} sizes: "
                     f"{min(speed):.2f}-{max(speed):.2f}x (median {statistics.median(speed):.2f}x); "
                     f"at most {at_most:.1f}x at: {slow}")
    return lines


def lr_schedule(step: int, steps: int, peak_lr: float, end_lr: float, warmup: int) -> float:
    """The learning rate of fine-tune step ``step`` (0-based) of ``steps``: a linear warm-up over ``warmup`` steps
    to ``peak_lr``, then a cosine decay that reaches ``end_lr`` at the last step (the shape of a pre-training
    schedule; kvlib.train's schedule has the same shape)."""
    import math

    if step < warmup:
        return peak_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup - 1)
    return end_lr + (peak_lr - end_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def finetune_scheduled(model, train_ids, steps=100, batch=8, seq_len=128, peak_lr=5e-4, end_lr=5e-5, warmup=10,
                       seed=0, progress=False) -> list[float]:
    """``kvlib.gqa.finetune`` (AdamW, the same seeded windows) with the rate set before every step by
    ``lr_schedule``; with peak_lr == end_lr and warmup=0 it is that function exactly. Returns the batch losses."""
    return finetune(model, train_ids, steps=steps, batch=batch, seq_len=seq_len, lr=peak_lr, seed=seed,
                    progress=progress, lr_at=lambda step: lr_schedule(step, steps, peak_lr, end_lr, warmup))


def conversion_quality(model, train_ids, val_ids, heads=(4, 2, 1), *, steps=100, batch=8, seq=128, peak_lr=5e-4,
                       end_lr=5e-5, warmup=10, windows=None, progress=False):
    """The MHA ``model`` converted by mean-pooling (``mha_to_gqa``) to g K/V heads for each g of ``heads``, each
    fine-tuned ``steps`` steps by ``finetune_scheduled`` (warm-up to ``peak_lr``, cosine decay to ``end_lr``),
    beside a control: the MHA model fine-tuned the same way on the same batches (seed 0). Held-out loss
    (nats/byte over ``windows`` evenly spaced windows of 128 bytes; None: every window) before and after, greedy
    agreement with the original on a held-out window of 512 bytes, and the change after the fine-tune against
    the original and against the control. Returns a DataFrame, one row per model: original, control, conversions;
    its attrs hold the protocol (``windows`` evaluated of ``all_windows``)."""
    probe = val_ids[:513][None]
    with torch.no_grad():
        ref_next = model(probe).argmax(-1)
    all_windows = (len(val_ids) - 1) // 128
    n_windows = all_windows if windows is None else min(windows, all_windows)
    tune = dict(steps=steps, batch=batch, seq_len=seq, peak_lr=peak_lr, end_lr=end_lr, warmup=warmup, progress=progress)

    def loss(m):
        return evaluate(m, val_ids, 128, max_windows=n_windows)

    def scores(m):  # after a fine-tune: the loss and the agreement with the original
        with torch.no_grad():
            agree = (m(probe).argmax(-1) == ref_next).float().mean().item()
        return loss(m), agree

    loss0 = loss(model)  # each model is evaluated once per state; the original agrees with itself by definition
    H = model.config.n_kv_heads
    rows = [dict(model=f"original (MHA, {H} K/V heads)", kv_heads=H, before=loss0, after=loss0, agreement=1.0)]
    control = copy.deepcopy(model)
    finetune_scheduled(control, train_ids, **tune)
    rows.append(dict(model="control (MHA, fine-tuned alike)", kv_heads=H, before=loss0,
                     **dict(zip(("after", "agreement"), scores(control)))))
    for g in heads:
        torch.manual_seed(0)
        converted = mha_to_gqa(model, g)
        before = loss(converted)
        finetune_scheduled(converted, train_ids, **tune)
        rows.append(dict(model=f"{'MQA' if g == 1 else 'GQA'}, {g} K/V heads", kv_heads=g, before=before,
                         **dict(zip(("after", "agreement"), scores(converted)))))
    table = _pd().DataFrame(rows).set_index("model")
    table.columns = ["K/V heads", "val loss before", "val loss after", "agreement after"]
    control_loss = table["val loss after"].iloc[1]
    table["after vs original (%)"] = 100 * (table["val loss after"] - loss0) / loss0
    table["after vs control (%)"] = 100 * (table["val loss after"] - control_loss) / control_loss
    table.attrs.update(steps=steps, batch=batch, seq=seq, peak_lr=peak_lr, end_lr=end_lr, warmup=warmup,
                       windows=n_windows, all_windows=all_windows)
    return table


def budget_line(table, log) -> str:
    """Three lines: the fine-tune's budget beside the pre-training's (``tiny_train_log``): steps, bytes, their
    share; the rate schedule and the held-out windows; and how many steps of this batch the GQA paper's uptraining share (5% of the pre-training steps,
    with the pre-training batch) would take."""
    a = table.attrs
    every = a.get("all_windows", a["windows"])
    held = (f"all {every} windows of 128 bytes" if a["windows"] == every else
            f"{a['windows']} evenly spaced of its {every} windows of 128 bytes")
    tuned = a["steps"] * a["batch"] * a["seq"]
    pre = log["steps"] * log["batch"] * log["seq_len"]
    paper_steps = round(PAPER_UPTRAIN_SHARE * pre / (a["batch"] * a["seq"]))
    return (f"budget: {a['steps']} steps of {a['batch']} x {a['seq']} bytes = {100 * tuned / pre:.2f}% of the "
            f"pre-training bytes ({log['steps']:,} steps of {log['batch']} x {log['seq_len']})\n"
            f"rate: warm-up {a['warmup']} steps to {a['peak_lr']:.0e}, cosine decay to {a['end_lr']:.0e}; "
            f"held out: {held}\n"
            f"the GQA paper's uptraining ({PAPER_UPTRAIN_SHARE:.0%} of the pre-training steps at the pre-training "
            f"batch) would be {paper_steps:,} steps of this batch")


# The GQA paper's uptraining (Ainslie et al. 2023, section 2.1): 5% of the original pre-training steps.
PAPER_UPTRAIN_SHARE = 0.05


def tiny_train_log() -> dict:
    """The tiny model's training log (``kvlib/assets/tiny/train_log.json``), with ``final_lr``: the learning rate
    its cosine schedule ended at (``kvlib.train.lr_at`` at the last step)."""
    import json
    from pathlib import Path

    from kvlib.train import lr_at

    log = json.loads((Path(__file__).resolve().parents[1] / "assets" / "tiny" / "train_log.json").read_text())
    return {**log, "final_lr": lr_at(log["steps"], log["steps"], log["peak_lr"], 0)}


def plot_quality(table, unigram: float | None = None):
    """Held-out loss against K/V heads: right after pooling and after the fine-tune, the original and the control
    as horizontal lines, and the unigram baseline (a model that ignores context)."""
    import matplotlib.pyplot as plt

    conv = table[table.index.str.contains("GQA|MQA")]
    a = table.attrs
    fig, ax = plt.subplots(figsize=(8.5, 4.6))
    ax.plot(conv["K/V heads"].tolist(), conv["val loss before"].tolist(), "o--", color="#C44E52",
            label="converted, right after mean-pooling")
    tuned = f"{a.get('steps', '?')} steps, warm-up to {a.get('peak_lr', float('nan')):.0e}, decay to {a.get('end_lr', float('nan')):.0e}"
    ax.plot(conv["K/V heads"].tolist(), conv["val loss after"].tolist(), "o-", color="#4C72B0", linewidth=2,
            markersize=8, label=f"converted, after the fine-tune ({tuned})")
    ax.axhline(table["val loss after"].iloc[0], color="#222222", linewidth=1.2, label="original MHA model")
    ax.axhline(table["val loss after"].iloc[1], color="#55A868", linestyle=":", linewidth=1.8,
               label="MHA control, fine-tuned alike")
    if unigram is not None:
        ax.axhline(unigram, color="#BBBBBB", linestyle="--", linewidth=1, label="unigram baseline (no context)")
    heads = sorted(set(conv["K/V heads"].tolist()) | {int(table["K/V heads"].iloc[0])})
    ax.set_xscale("log", base=2)
    ax.set_xticks(heads, [str(h) for h in heads])
    ax.minorticks_off()
    ax.invert_xaxis()
    ax.set(xlabel="K/V heads (8 query heads; 8 is the original MHA)", ylabel="held-out loss (nats/byte)",
           title="The tiny model converted from MHA to GQA/MQA: held-out loss")
    ax.set_ylim(bottom=0.85 * float(table["val loss after"].min()))  # the original and the control off the axis
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

# A new model's shape and its serving target: 64 sequences of 8,192 tokens, fp16 cache, on an 80 GiB GPU. The
# weights take weights_gib with one K/V head per query head (MHA); each layer's wk and wv are
# (n_kv_heads * head_dim, d_model), so every K/V head given up takes 2 * d_model * head_dim numbers off each layer.
LAB_CHOICE = dict(n_layers=32, d_model=4096, n_heads=32, head_dim=128, batch=64, seq_len=8192, dtype="fp16",
                  weight_bytes=2, gpu_gib=80, weights_gib=15, reserve_gib=2)


def kv_heads_evidence(c=None):
    """For every K/V head count that divides the query heads: the weights with that many K/V heads (wk and wv
    shrink with them), what the GPU has left for the cache, the cache, and whether it fits. In whole MiB
    (1 GiB = 1,024 MiB): every figure here is an exact multiple of one, so nothing is rounded."""
    MiB = 2**20
    c = c or LAB_CHOICE
    per_head_weights = c["n_layers"] * 2 * c["d_model"] * c["head_dim"] * c["weight_bytes"]  # wk + wv rows, bytes
    rows = []
    for g in [d for d in range(c["n_heads"], 0, -1) if c["n_heads"] % d == 0]:
        weights = c["weights_gib"] * 1024 * MiB - (c["n_heads"] - g) * per_head_weights
        left = (c["gpu_gib"] - c["reserve_gib"]) * 1024 * MiB - weights
        cache = kv_cache_bytes(c["n_layers"], g, c["head_dim"], c["seq_len"], c["batch"], c["dtype"])
        rows.append({"K/V heads": g, "weights (MiB)": weights // MiB, "left for the cache (MiB)": left // MiB,
                     "cache (MiB)": cache // MiB, "fits": cache <= left})
    return _pd().DataFrame(rows).set_index("K/V heads")


def check_kv_heads_choice(yours) -> None:
    """Lab 07's decision: the largest number of K/V heads whose cache fits beside that model's own weights. Prints
    yours vs the reference, then the evidence; a wrong choice fails with the reason for it. Returns nothing (a
    notebook cell that ends with it shows no stray value)."""
    from . import mistakes
    from .check import CheckFailed

    evidence = kv_heads_evidence()
    ref = int(evidence.index[evidence["fits"]].max())
    ok = isinstance(yours, int) and not isinstance(yours, bool) and yours == ref
    print(f"K/V heads: yours {yours!r}  reference {ref}  " + ("✓" if ok else "✗"))
    print(evidence.to_string())
    if ok:
        print("PASS ✓")
        return None
    why = mistakes.kv_heads_choice(evidence)
    if isinstance(yours, int) and not isinstance(yours, bool) and yours >= 1 and LAB_CHOICE["n_heads"] % yours == 0:
        reason = why.get(yours, "not the largest count whose cache fits what the GPU has left")
    else:
        reason = why["not a divisor"]
    raise CheckFailed(f"FAIL ✗\n  {reason}")
