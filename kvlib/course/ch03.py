"""Chapter 03's harnesses: the timings, counts and tables the notebook's cells call.

The notebook keeps what it teaches (the cache, the kernels, the checks); what it measures with is here:
- ``time_generators`` / ``plot_speedup``: the naive loop against the cached one, per number of new tokens;
- ``flop_counts``: chapter 02's FLOP model applied to both loops;
- ``count_ops`` / ``step_costs``: what one decode step runs (ATen operators) and costs (TTFT, TPOT, a
  one-token forward without a cache);
- ``forward_vs_tokens`` / ``plot_forward_vs_tokens``: one forward pass's time against its token count;
- ``StaticCache`` / ``decode_step`` / ``compile_comparison``: gpt-fast's recipe (fixed shapes, a position
  tensor) so that ``torch.compile`` can take the whole decode step, timed against the same step eager;
- ``store_is_a_copy``, ``gpu_reference``: the store kernel's exactness, the committed GPU curves;
- SmolLM2: ``cache_table``, ``tokens_per_s``, ``decode_step_bytes``, ``matvec_stream``.

Times are wall-clock (``time.perf_counter``) unless a function says it uses the thread's CPU time
(``time.thread_time``: what this thread ran on a core, which leaves out waiting for a busy core).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from .. import bench, runtime
from ..cache import KVCache, store_kv, store_kv_ref
from ..generate import generate, generate_naive

__all__ = ["time_generators", "readable_axes", "plot_speedup", "flop_counts", "CountOps", "count_ops",
           "step_costs", "forward_vs_tokens", "plot_forward_vs_tokens", "StaticCache", "decode_step",
           "compile_comparison", "store_is_a_copy", "gpu_reference", "cache_table",
           "tokens_per_s", "decode_step_bytes", "matvec_stream", "cpu_flags", "lab_decode", "MERGES",
           "merge_cases", "merge_evidence", "check_merge_choice"]


def _median(xs):
    return float(statistics.median(xs))


# --------------------------------------------------------------------------------------------
# Section 5: naive vs cached
# --------------------------------------------------------------------------------------------


def time_generators(model, prompt: list[int], lengths, budget_s: float = 1.0, max_rep: int = 10):
    """Wall times (s) of ``generate_naive`` and ``generate`` for each number of new tokens, the two alternating
    run by run (so both see the same background load): at least 3 runs each, more while ``budget_s`` lasts.
    Returns (naive runs per length, cached runs per length, whether their tokens agreed at every length: the
    first timed run of each loop is also the comparison, so no run is spent on the check alone)."""
    from tqdm.auto import tqdm

    t_naive, t_cached, same = [], [], True
    for n in tqdm(lengths, desc="naive vs cached"):
        runs, first = {generate_naive: [], generate: []}, {}
        start = time.perf_counter()
        while len(runs[generate]) < 3 or (len(runs[generate]) < max_rep and time.perf_counter() - start < budget_s):
            for fn, out in runs.items():
                t0 = time.perf_counter()
                tokens = fn(model, [prompt], n)
                out.append(time.perf_counter() - t0)
                first.setdefault(fn, tokens)
        same &= torch.equal(first[generate_naive], first[generate])
        t_naive.append(runs[generate_naive])
        t_cached.append(runs[generate])
    return t_naive, t_cached, same


def readable_axes(ax, xs):
    """Plain-number ticks: one per measured x (log base 2), and 1-2-5 steps on a log y axis."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xticks(xs)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    if ax.get_yscale() == "log":
        lo, hi = ax.get_ylim()
        if hi / lo >= 10:  # a decade or more: 1-2-5 steps
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5), numticks=30))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        else:  # a narrow range: four ticks spread inside it, at three significant digits
            ticks = sorted({float(f"{lo * (hi / lo) ** f:.3g}") for f in (0.1, 0.37, 0.63, 0.9)})
            ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
            ax.set_ylim(lo, hi)
        ax.yaxis.set_minor_formatter(NullFormatter())


def plot_speedup(lengths, t_naive, t_cached):
    """Left: total time of both loops (median, and the band from the fastest to the slowest run); right:
    the ratio of the medians. Returns the figure."""
    import matplotlib.pyplot as plt

    med = lambda runs: [_median(r) for r in runs]  # noqa: E731
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.2))
    bench.plot_curves(lengths, {"naive (chapter 02)": med(t_naive), "KV cache": med(t_cached)}, xlabel="new tokens",
                      ylabel="total time (s), median of the runs", title="Generation time, tiny model, batch 1", ax=ax1)
    for runs, color in ((t_naive, "C0"), (t_cached, "C1")):
        ax1.fill_between(lengths, [min(r) for r in runs], [max(r) for r in runs], color=color, alpha=0.2)
    speedup = [a / b for a, b in zip(med(t_naive), med(t_cached))]
    bench.plot_curves(lengths, {"naive / cached": speedup}, xlabel="new tokens", ylabel="speed-up (x), wall time",
                      title="Speed-up of the KV cache", ax=ax2, logy=False)
    for ax in (ax1, ax2):
        readable_axes(ax, lengths)
    return fig


def flop_counts(model, prompt_len: int, n: int) -> tuple[float, float]:
    """FLOPs of generating ``n`` tokens after a ``prompt_len``-token prompt: (naive loop, cached loop).

    Chapter 02's model: a forward over t tokens does 2 FLOPs per matrix parameter per token (embedding
    table left out) and 4·L·t·(H·D) per query row for attention over t keys. The naive loop runs forwards
    over p, p+1, ..., p+n-1 tokens; the cached loop one prefill over p, then n-1 one-token steps whose
    single query attends over the p+1, ..., p+n-1 positions held.
    """
    c = model.config
    matmul = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "tok_emb" not in name)
    width, L = c.n_heads * c.head_dim, c.n_layers

    def forward(t_new, t_keys):  # t_new query rows, each attending over t_keys keys
        return 2 * matmul * t_new + 4 * L * t_new * t_keys * width

    naive = sum(forward(t, t) for t in range(prompt_len, prompt_len + n))
    cached = forward(prompt_len, prompt_len) + sum(forward(1, t + 1) for t in range(prompt_len, prompt_len + n - 1))
    return float(naive), float(cached)


# --------------------------------------------------------------------------------------------
# Section 6: what a step runs and costs
# --------------------------------------------------------------------------------------------


def CountOps():
    """A dispatch mode that counts the ATen operators run inside it (``with counter: ...``; ``counter.n``):
    on a GPU each is at least one kernel launch, on a CPU one operator call with its fixed cost."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    return _CountOps()


def count_ops(fn) -> int:
    """How many ATen operators ``fn()`` runs."""
    counter = CountOps()
    with torch.no_grad(), counter:
        fn()
    return counter.n


def step_costs(model, prompt: list[int], steps: int = 200, budget_s: float = 1.0) -> dict:
    """Wall times (ms) on this device: ``ttft`` (a prefill of the prompt, the cache allocated inside) and
    ``naive`` (a forward over the prompt + ``steps`` tokens: a naive step at that depth), alternating; then
    ``tpot`` (each of ``steps`` cached decode steps, 1 to ``steps`` positions past the prompt) and ``forward1``
    (a one-token forward without a cache), alternating step by step; and the operators a cached step and a
    one-token forward run."""
    dev = model.device
    ids = torch.tensor([prompt], device=dev)
    one = torch.tensor([[prompt[-1]]], device=dev)
    deep = torch.randint(0, model.config.vocab_size, (1, len(prompt) + steps), device=dev)

    def ms(fn):
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    out = {"ttft": [], "naive": [], "tpot": [], "forward1": []}
    with torch.no_grad():
        start = time.perf_counter()
        while len(out["ttft"]) < 3 or (len(out["ttft"]) < 50 and time.perf_counter() - start < budget_s):
            out["ttft"].append(ms(lambda: model(ids, cache=KVCache.for_model(model, 1, len(prompt) + steps + 1))))
            out["naive"].append(ms(lambda: model(deep)))
        cache = KVCache.for_model(model, 1, len(prompt) + steps + 1)
        model(ids, cache=cache)
        for _ in range(steps):
            out["tpot"].append(ms(lambda: model(one, positions=cache.next_positions(), cache=cache)))
            out["forward1"].append(ms(lambda: model(one)))
        cache = KVCache.for_model(model, 1, len(prompt) + 2)
        model(ids, cache=cache)
        out["ops_cached"] = count_ops(lambda: model(one, positions=cache.next_positions(), cache=cache))
        out["ops_forward1"] = count_ops(lambda: model(one))
    return out


def forward_vs_tokens(model, Ts, budget_s: float = 0.25, min_rep: int = 5) -> list[list[float]]:
    """Wall times (ms) of one forward pass (no cache) over T random tokens, for each T: round after round, one
    timed call per T after an untimed one (so every T sees the same background load, with warm caches), at
    least ``min_rep`` rounds and more while ``budget_s`` per T lasts (at most 50)."""
    from tqdm.auto import tqdm

    xs = [torch.randint(0, model.config.vocab_size, (1, T), device=model.device) for T in Ts]
    runs = [[] for _ in Ts]
    start = time.perf_counter()
    with torch.no_grad(), tqdm(desc="forward pass vs tokens, rounds", total=50) as bar:
        while len(runs[0]) < min_rep or (len(runs[0]) < 50 and time.perf_counter() - start < budget_s * len(Ts)):
            for x, r in zip(xs, runs):
                model(x)  # untimed: the previous call (another T) left other data in the CPU's caches
                t0 = time.perf_counter()
                model(x)
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                r.append((time.perf_counter() - t0) * 1e3)
            bar.update(1)
    return runs


def plot_forward_vs_tokens(Ts, runs):
    """Left: time per call (median, band from fastest to slowest); right: time per token. Returns the figure."""
    import matplotlib.pyplot as plt

    med = [_median(r) for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.2))
    bench.plot_curves(Ts, {"one forward pass": med}, xlabel="tokens in one forward pass",
                      ylabel="time per call (ms), median", title="Tiny model: time per call", ax=ax1)
    ax1.fill_between(Ts, [min(r) for r in runs], [max(r) for r in runs], alpha=0.2)
    bench.plot_curves(Ts, {"per token": [1e3 * m / T for m, T in zip(med, Ts)]}, xlabel="tokens in one forward pass",
                      ylabel="time per token (µs)", title="Tiny model: time per token", ax=ax2)
    for ax in (ax1, ax2):
        readable_axes(ax, Ts)
    return fig


# --------------------------------------------------------------------------------------------
# The cure for a launch-bound step: one compiled graph (gpt-fast's recipe)
# --------------------------------------------------------------------------------------------


class StaticCache:
    """gpt-fast's cache: buffers of one fixed shape, written at a position *tensor*, read whole under a mask.

    Nothing in a step depends on a Python number that changes (no ``int(seq_lens)``, no slice to the current
    length), so every step has the same shapes and ``torch.compile`` traces it once. ``pos`` (T,): the
    positions of the tokens this call writes, set by :func:`decode_step`.
    """

    def __init__(self, model, max_len: int):
        c = model.config
        shape = (1, c.n_kv_heads, max_len, c.head_dim)  # (B=1, H_KV, S_max, D)
        self.k = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.n_layers)]
        self.v = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.n_layers)]
        self.slots = torch.arange(max_len, device=model.device)  # (S_max,)
        self.pos = torch.zeros(1, dtype=torch.long, device=model.device)

    def attend(self, layer_idx, q, k, v):
        self.k[layer_idx].index_copy_(2, self.pos, k)  # write at the positions, whatever they are
        self.v[layer_idx].index_copy_(2, self.pos, v)
        mask = self.slots[None, :] <= self.pos[:, None]  # (T, S_max): each query sees the positions up to its own
        return F.scaled_dot_product_attention(q, self.k[layer_idx], self.v[layer_idx], attn_mask=mask,
                                              enable_gqa=True)  # (B, H, T, D)


def decode_step(model, cache: StaticCache, ids, pos):
    """The model's forward without its argument checks (they read numbers back to Python): ids (1, T) at
    positions pos (T,) -> the last position's logits (1, 1, V)."""
    cache.pos = pos
    x = model.tok_emb(ids)  # (1, T, C)
    cos, sin = model.rope(pos[None], x.dtype)
    for layer in model.layers:
        x = layer(x, cos, sin, None, cache)
    return model.lm_head(model.norm(x[:, -1:])).float()


def _greedy_static(step, model, prompt, n, max_len):
    """n greedy tokens with a StaticCache of ``max_len`` positions and ``step`` (eager or compiled); thread CPU
    time (ms) per token of the n - 1 decode steps."""
    cache = StaticCache(model, max_len)
    with torch.no_grad():
        logits = decode_step(model, cache, torch.tensor([prompt]), torch.arange(len(prompt)))  # prefill, eager
        tokens = [int(logits[0, -1].argmax())]
        t0 = time.thread_time()
        for p in range(len(prompt), len(prompt) + n - 1):
            logits = step(model, cache, torch.tensor([[tokens[-1]]]), torch.tensor([p]))
            tokens.append(int(logits[0, -1].argmax()))
        return tokens, (time.thread_time() - t0) * 1e3 / (n - 1)


def compile_comparison(model, prompt: list[int], n: int = 32, runs: int = 5, mode: str = "reduce-overhead") -> dict:
    """The decode step eager and compiled with ``torch.compile(decode_step, mode=mode, fullgraph=True)``, on the
    CPU (the model is used as it is: put it on the CPU first). Alternating runs of ``n`` greedy tokens, every
    run with a cache of the same ``len(prompt) + n`` positions (one shape: one compilation); each run's thread
    CPU time per decode step (ms). Returns {"compile_s" (wall time of the first call: trace + build), "eager",
    "compiled" (lists of ms per step), "same_tokens" (every run equal to ``generate``'s tokens)}."""
    compiled = torch.compile(decode_step, mode=mode, fullgraph=True)
    max_len = len(prompt) + n
    t0 = time.perf_counter()
    first, _ = _greedy_static(compiled, model, prompt, 2, max_len)  # the first compiled step compiles
    compile_s = time.perf_counter() - t0
    ref = generate(model, [prompt], n)[0].tolist()
    out = {"compile_s": compile_s, "eager": [], "compiled": [], "same_tokens": first == ref[:2]}
    for _ in range(runs):
        for name, step in (("eager", decode_step), ("compiled", compiled)):
            tokens, ms = _greedy_static(step, model, prompt, n, max_len)
            out[name].append(ms)
            out["same_tokens"] &= tokens == ref
    return out


# --------------------------------------------------------------------------------------------
# Lab 03: the host side of the learner's kernel, and the decision exercise's evidence
# --------------------------------------------------------------------------------------------


def lab_decode(kernel):
    """The host side of lab 03's ``decode_loop_kernel``: returns ``decode_triton(q, k_cache, v_cache, seq_lens,
    tile_n=16)``, which checks the inputs (fp32, power-of-two D, H_KV dividing H), launches one program per
    (sequence, query head) and returns the (B, H, D) output (the PyTorch reference where Triton cannot run)."""
    import math

    from ..cache import decode_attention_ref

    def decode_triton(q, k_cache, v_cache, seq_lens, tile_n: int = 16):
        B, H, D = q.shape
        H_KV, S_max = k_cache.shape[1], k_cache.shape[2]
        if not (q.dtype == k_cache.dtype == v_cache.dtype == torch.float32) or D & (D - 1) or H % H_KV:
            raise ValueError("this exercise takes fp32 tensors, a power-of-two D, and H_KV dividing H")
        if not runtime.require_triton("lab 03 decode kernel", q=q, k_cache=k_cache, v_cache=v_cache,
                                      seq_lens=seq_lens):
            return decode_attention_ref(q, k_cache, v_cache, seq_lens)
        q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
        out = torch.empty_like(q)
        kernel[(B * H,)](q, k_cache, v_cache, out, seq_lens, H, H // H_KV, S_max, 1 / math.sqrt(D), D=D, TILE_N=tile_n)
        return out

    return decode_triton


def _w(x):
    return x[..., None]  # (...,) -> (..., 1): a weight per row, broadcast over D


MERGES = {  # lab 03's candidate merges of two partial results: (formula, merge(o1, lse1, o2, lse2, n1, n2))
    "A": ("(o1 + o2) / 2", lambda o1, l1, o2, l2, n1, n2: (o1 + o2) / 2),
    "B": ("(exp(lse1) o1 + exp(lse2) o2) / (exp(lse1) + exp(lse2))",
          lambda o1, l1, o2, l2, n1, n2: (_w(l1.exp()) * o1 + _w(l2.exp()) * o2) / _w(l1.exp() + l2.exp())),
    "C": ("(n1 o1 + n2 o2) / (n1 + n2), n_i = positions in range i",
          lambda o1, l1, o2, l2, n1, n2: (n1 * o1 + n2 * o2) / (n1 + n2)),
    "D": ("(o1 + exp(lse2 - lse1) o2) / (1 + exp(lse2 - lse1))",
          lambda o1, l1, o2, l2, n1, n2: (o1 + _w((l2 - l1).exp()) * o2) / _w(1 + (l2 - l1).exp())),
    "E": ("(exp(lse1 - m) o1 + exp(lse2 - m) o2) / (exp(lse1 - m) + exp(lse2 - m)), m = max(lse1, lse2)",
          lambda o1, l1, o2, l2, n1, n2: (_w((l1 - torch.maximum(l1, l2)).exp()) * o1
                                          + _w((l2 - torch.maximum(l1, l2)).exp()) * o2)
          / _w((l1 - torch.maximum(l1, l2)).exp() + (l2 - torch.maximum(l1, l2)).exp())),
}


def merge_cases():
    """The three inputs the decision is checked on: {name: (scores (H, L), v (H, L, D), split)}: ordinary
    scores (fp32); the second range's scores 100 higher (fp32); every score 1000 higher (fp64)."""
    g = torch.Generator().manual_seed(0)
    H, L, D, split = 4, 40, 16, 16
    scores, v = torch.randn(H, L, generator=g), torch.randn(H, L, D, generator=g)
    lift = torch.cat([torch.zeros(H, split), torch.full((H, L - split), 100.0)], dim=-1)
    return {"ordinary scores (fp32)": (scores, v, split),
            "2nd range +100 (fp32)": (scores + lift, v, split),
            "every score +1000 (fp64)": (scores.double() + 1000, v.double(), split)}


def merge_evidence():
    """Each candidate on each case: "exact" (within 1e-5 of attention over all positions), "wrong" (finite,
    off) or "overflows" (nan or inf). A table of words, the same on every machine."""
    import pandas as pd

    table = {}
    for case, (x, v, split) in merge_cases().items():
        full = torch.softmax(x, -1)[:, None, :] @ v
        parts = [(torch.softmax(s, -1)[:, None, :] @ vv)[:, 0] for s, vv in ((x[:, :split], v[:, :split]),
                                                                            (x[:, split:], v[:, split:]))]
        lses = torch.logsumexp(x[:, :split], -1), torch.logsumexp(x[:, split:], -1)
        col = {}
        for name, (_, fn) in MERGES.items():
            out = fn(parts[0], lses[0], parts[1], lses[1], split, x.shape[1] - split)
            col[name] = ("overflows" if not torch.isfinite(out).all() else
                         "exact" if torch.allclose(out, full[:, 0], atol=1e-5, rtol=1e-5) else "wrong")
        table[case] = col
    return pd.DataFrame(table)


def check_merge_choice(yours) -> bool:
    """Lab 03's decision: which candidate merges are exact on every input. Prints the evidence (each candidate
    on each case), then yours vs the reference; a wrong choice fails with the reason for each letter."""
    from . import mistakes
    from .check import CheckFailed

    evidence = merge_evidence()
    ref = {name for name in MERGES if (evidence.loc[name] == "exact").all()}
    yours = {str(c).strip().upper() for c in yours}
    print("each candidate merge, on three inputs:\n" + evidence.to_string() + "\n")
    ok = yours == ref
    report = f"exact on every input: yours {sorted(yours)}  reference {sorted(ref)}  " + ("✓" if ok else "✗")
    if ok:
        print(report + "\nPASS ✓")
        return True
    why = mistakes.exact_merges()
    lines = [f"  {c}: {why.get(c, 'not one of the candidates A-E')}" for c in sorted(yours ^ ref)]
    raise CheckFailed(report + "\nFAIL ✗\n" + "\n".join(lines))


# --------------------------------------------------------------------------------------------
# Section 7: the kernels, exactness and the committed GPU curves
# --------------------------------------------------------------------------------------------


def store_is_a_copy() -> tuple[bool, int]:
    """``store_kv`` (the Triton kernel: in the interpreter on a CPU) against ``store_kv_ref`` (slice
    assignment) in fp32 and fp16, 2 sequences x 2 K/V heads, 37 new rows at ragged offsets, head dim 48
    (not a power of two). A copy moves bits: the two caches must be identical. Returns (identical,
    elements compared)."""
    g = torch.Generator().manual_seed(0)
    same, n = True, 0
    for dtype in (torch.float32, torch.float16):
        new = [torch.randn(2, 2, 37, 48, generator=g).to(runtime.DEVICE, dtype) for _ in range(2)]
        start = torch.tensor([3, 50], device=runtime.DEVICE)
        caches = [torch.randn(2, 2, 100, 48, generator=g).to(runtime.DEVICE, dtype) for _ in range(2)]
        ref = [c.clone() for c in caches]
        store_kv(*caches, *new, start)
        store_kv_ref(*ref, *new, start)
        same &= all(torch.equal(a, b) for a, b in zip(caches, ref))
        n += sum(c.numel() for c in caches)
    return same, n


def _span(values, fmt) -> str:
    """'a' or 'a–b' for the sorted distinct values."""
    vals = sorted(set(values))
    return fmt(vals[0]) if len(vals) == 1 else f"{fmt(vals[0])}–{fmt(vals[-1])}"


def _headline_rule(sweep: str, pts) -> str:
    """What made these points the headline points (the rule of ``kvlib.bench.sweeps``)."""
    from ..bench import sweeps

    if sweep == "store":
        return f"T ≥ {min(r['T'] for r in pts):,} new rows"
    if sweep == "prefill":
        return f"S ≥ {min(r['S'] for r in pts):,}"
    return f"K/V read ≥ {sweeps.HEADLINE_KV_BYTES // 10**6} MB"


def _detail_lines(rows, sweep: str, keep, label: str) -> list[str]:
    """One line per kernel and head layout over the headline points (median and min–max of % of copy bandwidth
    and of the ratio to the baseline), a line naming the points' conditions, and, where there are timed points
    below the headline sizes, the ratio's range there."""
    timed = [r for r in rows if r.get("sweep") == sweep and r.get("kernel") and keep(r["kernel"])
             and r.get("time_ms") is not None and r.get("pct_copy_bw") is not None]
    head = [r for r in timed if r.get("headline")]
    if not head:
        return []
    size = "T" if sweep == "store" else "S"
    lines = [f"{label}, headline points ({_headline_rule(sweep, head)}): {_span([r['dtype'] for r in head], str)}, "
             f"D={_span([r['D'] for r in head], str)}, B {_span([r['B'] for r in head], str)}, "
             f"{size} {_span([r[size] for r in head], lambda v: f'{v:,}')}"]
    layouts = sorted({(r.get("H"), r.get("H_KV")) for r in head}, key=lambda x: (x[0] or 0, x[1] or 0))
    for kernel in sorted({r["kernel"] for r in head}, key=lambda k: (k == "SDPA" or "slice" in k, k)):
        for H, H_KV in layouts:
            pts = [r for r in head if r["kernel"] == kernel and (r.get("H"), r.get("H_KV")) == (H, H_KV)]
            if not pts:
                continue
            pct = sorted(r["pct_copy_bw"] for r in pts)
            ratio = sorted(r["vs_baseline"] for r in pts if r.get("vs_baseline") is not None)
            where = f", {H}/{H_KV} heads" if H and len(layouts) > 1 else ""
            text = f"{kernel}{where}: {statistics.median(pct):.0f}% of copy bandwidth ({pct[0]:.0f}–{pct[-1]:.0f}%)"
            if ratio:
                text += f", {statistics.median(ratio):.2f}x {pts[0]['baseline']} ({ratio[0]:.2f}–{ratio[-1]:.2f}x)"
            lines.append(f"{text}, {len(pts)} points")
    small = [r for r in timed if not r.get("headline") and r.get("vs_baseline") is not None]
    for kernel in sorted({r["kernel"] for r in small}):
        ratio = sorted(r["vs_baseline"] for r in small if r["kernel"] == kernel)
        sizes = _span([r[size] for r in small if r["kernel"] == kernel], lambda v: f"{v:,}")
        lines.append(f"{kernel} below the headline sizes ({size} {sizes}): {ratio[0]:.2f}–{ratio[-1]:.2f}x "
                     f"{small[0]['baseline']}, {len(ratio)} points")
    return lines


def gpu_reference(sweep: str, keep, detail: bool = False) -> list[str]:
    """CPU mode: draw the committed GPU results of ``sweep`` for the kernels ``keep(name)`` selects and return one
    short line per kernel (median % of the copy bandwidth over its headline points). GPU mode: run the sweep
    here, draw it and return its lines the same way. ``detail``: instead, a line naming the headline points'
    conditions, then one line per kernel and head layout with the median and the min–max range, and the ratio's
    range below the headline sizes. No targets: they belong to the benchmarks."""
    import matplotlib.pyplot as plt

    from ..bench import results, sweeps

    if runtime.mode() == "gpu":
        rows = sweeps.run([sweep])
        label = runtime.device_name()
        results.show(rows, sweep, keep)
    else:
        label, rows = results.reference(sweep)
        if not rows:
            return [results.NO_REFERENCE]
        results.plot_sweep([r for r in rows if r.get("kernel") and keep(r["kernel"])], sweep)
        plt.show()
        label = label.split(",")[0] + ", " + label.rsplit(",", 1)[-1].strip()  # the GPU and the date
    if detail:
        return _detail_lines(rows, sweep, keep, label)
    lines = []
    for row in results.headline_table(rows):
        if row["sweep"] == sweep and keep(row["kernel"]) and row["pct_copy_bw"] is not None:
            ratio = "" if row["vs_baseline"] is None else f", {row['vs_baseline'][0]:.2f}x {row['baseline']}"
            lines.append(f"{label}: {row['kernel']}: {row['pct_copy_bw'][0]:.0f}% of copy bandwidth{ratio} "
                         f"(median of {row['points']} points)")
    return lines


# --------------------------------------------------------------------------------------------
# Section 8: SmolLM2 beside transformers
# --------------------------------------------------------------------------------------------


def cache_table(ours: KVCache, hf_caches):
    """One row per cache after the same generation: its class, layers, one layer's K buffer shape
    (B, H_KV, positions, D), positions held and positions allocated. ``hf_caches``: transformers caches."""
    import pandas as pd

    rows = [{"cache": "kvlib KVCache", "layers": len(ours.k), "K buffer, one layer": str(tuple(ours.k[0].shape)),
             "held": ours.held(0), "allocated": ours.max_len}]
    for c in hf_caches:
        k = c.layers[0].keys
        rows.append({"cache": f"transformers {type(c).__name__}", "layers": len(c.layers),
                     "K buffer, one layer": str(tuple(k.shape)), "held": int(c.get_seq_length()),
                     "allocated": int(k.shape[2])})
    return pd.DataFrame(rows).set_index("cache")


def timed(fn):
    """(fn(), its wall time in ms): a run whose result is used and whose time is reported too."""
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def tokens_per_s(fn, n: int, budget_s: float, max_rep: int = 5):
    """(tokens per second from the median wall time of ``fn()``, which makes ``n`` tokens; the run times in ms)."""
    runs = bench.time_runs(fn, budget_s=budget_s, min_rep=1, max_rep=max_rep, warmup=0)
    return n / (_median(runs) / 1e3), runs


def with_dtype(model, dtype):
    """A copy of ``model`` with its weights in ``dtype`` (``model`` untouched): the same model that
    ``load_pretrained(..., dtype=dtype)`` reads from the same fp32 checkpoint, without reading it again."""
    import copy

    return copy.deepcopy(model).to(dtype)


def decode_step_bytes(m, depth: int, context: list[int]):
    """Wall times (ms) of cached decode steps from ``depth`` cached positions on, and the bytes one step
    reads: every weight once (the tied embedding counted once) + the K/V held, at the steps' mean depth."""
    c = KVCache.for_model(m, 1, depth + 64)
    ids = (context * (depth // len(context) + 1))[:depth]  # any depth tokens will do for timing
    with torch.no_grad():
        m(torch.tensor([ids], device=m.device), cache=c)  # prefill
        tok_in = torch.tensor([[context[-1]]], device=m.device)
        step = lambda: m(tok_in, positions=c.next_positions(), cache=c)  # noqa: E731
        times = bench.time_runs(step, budget_s=1, min_rep=5, max_rep=40)  # at most 41 steps: fits the cache
    weights = sum(p.numel() * p.element_size() for p in m.parameters())
    mean_depth = depth + (1 + len(times)) / 2  # the cache grows by one position per step
    kv = 2 * m.config.n_layers * m.config.n_kv_heads * m.config.head_dim * mean_depth * c.k[0].element_size()
    return times, weights + kv


def cpu_flags(wanted=("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")) -> dict:
    """Which of these instruction-set extensions this CPU has ({} where /proc/cpuinfo does not exist)."""
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    if not info.exists():
        return {}
    line = next((x for x in info.read_text().splitlines() if x.startswith(("flags", "Features"))), "")
    flags = set(line.split(":", 1)[-1].split())
    return {f: f in flags for f in wanted}


def matvec_stream(shape, total_bytes: int = 512 * 2**20, budget_s: float = 2.0) -> dict:
    """One token's vector times many weight matrices of ``shape`` (together ``total_bytes`` of fp32, more than
    the CPU's caches, so the weights stream from memory), in fp32 and bf16: {dtype: (GB/s of weights, runs ms)}."""
    n_mats = -(-total_bytes // (shape[0] * shape[1] * 4))
    g = torch.Generator().manual_seed(0)
    mats32 = [torch.randn(shape, generator=g).to(runtime.DEVICE) for _ in range(n_mats)]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        mats = mats32 if dtype == torch.float32 else [m.to(dtype) for m in mats32]
        x1 = torch.randn(1, shape[1], generator=g).to(device=runtime.DEVICE, dtype=dtype)
        runs = bench.time_runs(lambda: [F.linear(x1, m) for m in mats], budget_s=budget_s, min_rep=3, max_rep=10)
        out[dtype] = (bench.gbps(sum(m.numel() * m.element_size() for m in mats), _median(runs)), runs)
        del mats
    return out
