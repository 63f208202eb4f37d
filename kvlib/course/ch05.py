"""Chapter 05's harnesses: the tables, plots, checks and lab tooling the notebook's cells call.

The notebook keeps what it teaches (the block tables, the slot mapping, the source article's sketch, the
kernels); what it measures with is here:
- ``state`` / ``server_view`` / ``policy_table`` / ``length_histogram``: the pool's bookkeeping, the simulator's
  runs as a server holds them (whole pool, mean and peak) and in the vLLM paper's terms, as a table;
- ``arrival_table``: thrashing's condition (a queue of waiting requests) at several arrival rates;
- ``watermark_runs`` / ``watermark_table`` / ``watermark_seeds`` / ``plot_watermarks``: the admission watermark
  swept, on one seed and on several;
- ``batch_savings``: the first source article's "30-50% when lengths differ by more than 4x", on random batches;
- ``paged_decode_minimal``: the smallest paged decode kernel (chapter 03's per-head decode kernel with one
  change: each position's address comes from the block table), and ``kernel_checks``: the library's kernel
  against the reference at block sizes 1, 5, 16 and 128 (fp32, and fp16 at 5 and 16);
- ``gpu_reference``: the committed GPU measurement of the paged kernel against the contiguous one;
- ``hf_paged``: transformers' own paged cache (continuous batching) on the same model, side by side;
- ``summary``: what the chapter measured, as one table;
- lab 05: ``replay_allocator``, ``allocator_error_cases``, ``check_slot_guess``, ``block_size_evidence`` (over
  several seeds), ``check_prediction``, ``check_block_size_choice``.
"""

from __future__ import annotations

import bisect
import functools
import random
from contextlib import contextmanager

import torch

from .. import runtime
from ..paged import (BlockAllocator, OutOfBlocksError, _paged_decode_minimal_kernel, paged_decode_attention,  # noqa: F401
                     paged_decode_attention_ref, paged_decode_minimal)

__all__ = ["state", "length_histogram", "server_view", "policy_table", "arrival_table", "watermark_runs",
           "watermark_table", "watermark_seeds", "plot_watermarks",
           "batch_savings", "paged_decode_minimal", "kernel_checks", "gpu_reference", "hf_paged", "summary",
           "replay_allocator", "allocator_error_cases", "BLOCK_CHOICES", "SEEDS", "WORKLOADS", "TOLERANCE",
           "block_size_runs", "block_size_evidence", "block_size_answer", "tolerance_range", "check_prediction",
           "check_block_size_choice", "check_slot_guess"]


def state(cache):
    """A copy of everything a refused call must leave alone: (lengths, block tables, reference counts)."""
    return dict(cache.lens), {s: list(t) for s, t in cache.tables.items()}, list(cache.allocator.refcount)


# --------------------------------------------------------------------------------------------
# Section 3: the simulator
# --------------------------------------------------------------------------------------------


def length_histogram(lengths):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.hist(lengths, bins=60)
    ax.set(xlabel="prompt + output length (tokens)", ylabel="requests",
           title="Sampled request lengths (log-normal, seed 0; simulated, no device)")
    return fig


@contextmanager
def _counting(requests):
    """While active, ``pool_sim.simulate(..., record=True)`` keeps, per iteration, only what ``server_view`` needs
    (tokens stored, slots reserved for tokens still to come, slots past each sequence's final length, requests
    waiting) instead of a picture of the pool: ``pool_sim._snapshot`` is swapped for a counter while it runs."""
    from .. import pool_sim

    arrivals = sorted(r.arrival for r in requests)
    rows, finished = [], [0]

    def count(running, generated, tables, rows_, paged, num_blocks, block_size, capacity_tokens, max_len):
        t = len(rows)
        arrived = bisect.bisect_right(arrivals, t)  # requests that have arrived by iteration t
        stored = sum(r.prompt_len + generated[r.rid] for r in running)
        to_come = sum(r.output_len - generated[r.rid] for r in running)
        past_end = sum(max_len - r.prompt_len - r.output_len for r in running)
        rows.append((stored, to_come, past_end, len(running), arrived - finished[0] - len(running)))
        finished[0] += sum(generated[r.rid] == r.output_len for r in running)
        return None, None

    saved = pool_sim._snapshot
    pool_sim._snapshot = count
    try:
        yield rows
    finally:
        pool_sim._snapshot = saved


def server_view(requests, capacity, policy, **kw):
    """``simulate(requests, capacity, policy, **kw)`` and, beside its result, the measures a server's operator reads
    off the whole pool (a vLLM server allocates its pool at start-up, so free blocks are memory held too):
    - ``pool mean`` / ``pool peak``: tokens stored / the whole pool's slots, time-averaged over every iteration
      (the same as the result's ``pool_usage``) and at the fullest iteration;
    - ``reserved`` / ``never written`` (contiguous): the shares of the allocated slots that are reserved for tokens
      the sequence will still write, and that lie past its final length, never written (the vLLM paper's
      *internal fragmentation*, Figure 2), time-averaged as ``reserved_waste`` is (their sum);
    - ``waiting``: requests that have arrived and are not running (queued or preempted), mean over iterations.
    Returns (SimResult, dict)."""
    from ..pool_sim import simulate

    with _counting(requests) as rows:
        r = simulate(requests, capacity, policy, record=True, **kw)
    r.snapshots = r.snapshot_fill = None  # (the counter left nothing to draw)
    bs, max_len = kw.get("block_size", 16), kw.get("max_len", 2048)
    pool_slots = (capacity // bs) * bs if policy == "paged" else (capacity // max_len) * max_len
    busy = [x for x in rows if x[3]]
    extra = {"pool mean": sum(x[0] for x in rows) / pool_slots / len(rows),
             "pool peak": max(x[0] for x in rows) / pool_slots,
             "reserved": 0.0, "never written": 0.0,
             "waiting": sum(x[4] for x in rows) / len(rows)}
    if policy == "contiguous":
        extra["reserved"] = sum(x[1] / (x[3] * max_len) for x in busy) / len(busy)
        extra["never written"] = sum(x[2] / (x[3] * max_len) for x in busy) / len(busy)
    return r, extra


def policy_table(results):
    """One row per simulated policy, from ``{name: (SimResult, server_view's dict)}``: the pool as a server holds it
    (mean and peak), the shares of the allocated memory in the vLLM paper's terms, the batch, preemption and time."""
    import pandas as pd

    rows = [{"policy": name, "pool holding tokens, mean": x["pool mean"], "pool holding tokens, peak": x["pool peak"],
             "tokens / allocated": r.utilization, "reserved (tokens to come)": x["reserved"],
             "internal fragmentation": x["never written"] if r.policy == "contiguous" else r.internal_fragmentation,
             "mean running": r.mean_running, "preemptions": r.preemptions,
             "tokens prefilled again": r.recomputed_tokens,
             "prefill steps": r.prefill_steps, "steps to finish": r.steps}
            for name, (r, x) in results.items()]
    return pd.DataFrame(rows).set_index("policy").round(3)


def arrival_table(capacity, rates, n=1000, seed=0, block_size=16):
    """Thrashing's condition: the block-16 pool with no watermark, fed by Poisson arrivals at each of ``rates``
    requests per step (``None``: all at step 0), the same lengths' distribution and seed. One row per rate: the
    requests waiting on average, preemptions and the tokens prefilled again against the prompt tokens."""
    import pandas as pd

    from ..pool_sim import sample_requests

    rows = []
    for rate in rates:
        reqs = sample_requests(n, seed=seed, arrival_rate=rate)
        r, x = server_view(reqs, capacity, "paged", block_size=block_size)
        rows.append({"arrivals per step": "all at step 0" if rate is None else rate,
                     "requests waiting, mean": x["waiting"], "mean running": r.mean_running,
                     "preemptions": r.preemptions,
                     "again / prompt tokens": r.recomputed_tokens / sum(q.prompt_len for q in reqs)})
    return pd.DataFrame(rows).set_index("arrivals per step").round(3)


def watermark_runs(requests, capacity, watermarks, block_size=16):
    """{watermark: SimResult} with prefill charged (the default rate), and the same runs with prefill free."""
    from ..pool_sim import simulate

    charged = {w: simulate(requests, capacity, "paged", block_size=block_size, watermark=w) for w in watermarks}
    free = {w: simulate(requests, capacity, "paged", block_size=block_size, watermark=w, prefill_tokens_per_step=None)
            for w in watermarks}
    return charged, free


def watermark_table(runs, free, prompt_tokens, num_blocks):
    import pandas as pd

    return pd.DataFrame([{
        "watermark": w, "blocks kept free": int(w * num_blocks), "preemptions": r.preemptions,
        "tokens prefilled again": r.recomputed_tokens, "again / prompt tokens": r.recomputed_tokens / prompt_tokens,
        "mean running": r.mean_running, "tokens / allocated": r.utilization, "pool holding tokens": r.pool_usage,
        "prefill steps": r.prefill_steps, "steps to finish": r.steps, "steps, prefill free": free[w].steps,
    } for w, r in runs.items()]).set_index("watermark").round(3)


def watermark_seeds(capacity, watermarks, seeds, n=1000, block_size=16, seed0=None):
    """The watermark sweep's steps to finish on several workload seeds (the same lengths' distribution, all at
    step 0, prefill charged): a DataFrame, one row per seed, one column per watermark, each run's steps divided
    by the same seed's steps with no watermark. ``seed0``: seed 0's runs already made ({watermark: SimResult})."""
    import pandas as pd

    from ..pool_sim import sample_requests, simulate

    rows = {}
    for seed in seeds:
        if seed == 0 and seed0 is not None:
            steps = {w: seed0[w].steps for w in watermarks}
        else:
            reqs = sample_requests(n, seed=seed)
            steps = {w: simulate(reqs, capacity, "paged", block_size=block_size, watermark=w).steps for w in watermarks}
        rows[seed] = {w: steps[w] / steps[watermarks[0]] for w in watermarks}
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name, table.columns.name = "seed", f"steps / steps at watermark {watermarks[0]}"
    return table.round(3)


def plot_watermarks(runs, free, prompt_tokens, title):
    import matplotlib.pyplot as plt

    from ..pool_sim import PREFILL_TOKENS_PER_STEP

    ws = list(runs)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 3.8))
    xlabel = "watermark (share of blocks kept free)"
    ax1.plot(ws, [runs[w].recomputed_tokens / 1000 for w in ws], marker="o", label="tokens prefilled again")
    ax1.axhline(prompt_tokens / 1000, color="grey", linestyle=":", label="the workload's prompt tokens")
    ax1.set(xlabel=xlabel, ylabel="thousands of tokens", title="Tokens prefilled again")
    ax1.legend(fontsize=8)
    ax2.plot(ws, [runs[w].preemptions for w in ws], marker="s", color="C1")
    ax2.set(xlabel=xlabel, ylabel="preemptions (count)", title="Preemptions")
    ax3.plot(ws, [runs[w].steps for w in ws], marker="o", label=f"prefill charged ({PREFILL_TOKENS_PER_STEP} tokens/step)")
    ax3.plot(ws, [free[w].steps for w in ws], marker="s", label="prefill free")
    ax3.set(xlabel=xlabel, ylabel="steps to finish all requests", title="Time to serve the workload")
    ax3.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig


def batch_savings(lengths, batch: int = 8, draws: int = 2000, min_ratio: float = 4.0, seed: int = 0):
    """Savings of paging (block 16) over padding for random batches of ``batch`` lengths whose longest is more
    than ``min_ratio`` times the shortest: a numpy array, one saving per kept batch."""
    import numpy as np

    from ..pool_sim import padded_batch_savings

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(draws):
        s = padded_batch_savings(rng.choice(lengths, size=batch, replace=False).tolist(), block_size=16)
        if s["max_over_min"] > min_ratio:
            out.append(s["saving"])
    return np.array(out)


# --------------------------------------------------------------------------------------------
# Section 6: the smallest paged kernel, and the library's
# --------------------------------------------------------------------------------------------


def scattered_inputs(lens, block_size, H=8, H_KV=2, D=32, spare=4, seed=0, dtype=torch.float32):
    """q (B, H, D), pools and block tables for sequences of ``lens`` positions whose blocks are scattered at
    random over a pool with ``spare`` unused blocks; -1 past each sequence's blocks."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(n_blocks) + spare, generator=g)
    tables = torch.full((len(lens), max(n_blocks)), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(n_blocks):
        tables[b, :n] = perm[start:start + n]
        start += n
    dev = runtime.DEVICE
    k, v = (torch.randn(len(perm), block_size, H_KV, D, generator=g).to(dev, dtype) for _ in range(2))
    q = torch.randn(len(lens), H, D, generator=g).to(dev, dtype)
    return q, k, v, tables.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev)


def kernel_checks(lens=(1, 40, 100), block_sizes=(1, 5, 16, 128), splits=(1, 4), fp16_block_sizes=(5, 16)):
    """The library's paged kernel (chapter 07's grouped kernel, PAGED=True) against the reference at each block
    size and number of splits, the blocks scattered, in fp32; and in fp16 at ``fp16_block_sizes`` (the reference
    computed in fp32 from the same fp16 inputs). A table of the largest differences, with the tolerance each
    dtype is held to (fp16 output rounds to 11 significant bits)."""
    import pandas as pd

    rows = []
    cases = [(bs, torch.float32) for bs in block_sizes] + [(bs, torch.float16) for bs in fp16_block_sizes]
    for bs, dtype in cases:
        q, k, v, tables, seq_lens = scattered_inputs(list(lens), bs, dtype=dtype)
        ref = paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, seq_lens)
        for n in splits:
            out = paged_decode_attention(q, k, v, tables, seq_lens, num_splits=n).float()
            rows.append({"dtype": str(dtype).removeprefix("torch."), "block size": bs, "splits": n,
                         "max |kernel - reference|": (out - ref).abs().max().item(),
                         "tolerance": KERNEL_TOLERANCE[dtype]})
    return pd.DataFrame(rows).set_index(["dtype", "block size", "splits"])


KERNEL_TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3}  # fp16: a few units in the last place of outputs ~1


def gpu_reference() -> list[str]:
    """The paged kernel against the contiguous one on a GPU: this GPU's sweep in GPU mode, the committed results
    otherwise (drawn). Lines: the headline points' conditions (dtype, D, B, S), then per kernel the median and
    min–max over those points, and the ratio below the headline sizes. No targets: they belong to the benchmarks."""
    from .ch03 import gpu_reference as _reference

    return _reference("paged", keep=lambda k: k.startswith("paged block") or k == "contiguous decode", detail=True)


# --------------------------------------------------------------------------------------------
# Section 8: transformers' paged cache on the same model
# --------------------------------------------------------------------------------------------


def hf_paged(real, prompts, n: int, page_size: int = 16):
    """transformers' continuous batching on SmolLM2's weights (its own ``PagedAttentionCache``), beside kvlib's
    paged cache: ``generate(..., cache_implementation="paged")`` for the first prompt, ``generate_batch`` for all.
    Returns (table, None), or (None, why it was skipped) when transformers or its continuous batching is missing."""
    import pandas as pd

    from ..generate import generate

    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed (pip install transformers): this comparison is skipped"
    if not hasattr(transformers, "ContinuousBatchingConfig"):
        return None, (f"transformers {transformers.__version__} has no ContinuousBatchingConfig "
                      "(continuous batching): this comparison is skipped")
    from ..bench import peers

    hf = peers.hf_model_from_kvlib(real)
    num_blocks = sum(-(-(len(p) + n) // page_size) for p in prompts) + 4
    cb = transformers.ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=256,
                                               max_requests_per_batch=len(prompts), auto_switch_to_flash=False)
    ours = [row.tolist() for row in generate(real, prompts, n, cache="paged")]
    gen = dict(max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with peers._quiet_transformers():
        one = hf.generate(torch.tensor([prompts[0]]), cache_implementation="paged", continuous_batching_config=cb, **gen)
        batch = hf.generate_batch(prompts, generation_config=transformers.GenerationConfig(**gen),
                                  continuous_batching_config=cb)
    batch = [list(r.generated_tokens) for r in batch.values()]  # in prompt order
    rows = [{"call": 'generate(..., cache_implementation="paged")', "prompts": 1,
             "same tokens as kvlib": f"{int(one[0, 0, len(prompts[0]):].tolist() == ours[0])}/1"},
            {"call": "generate_batch(...)", "prompts": len(prompts),
             "same tokens as kvlib": f"{sum(a == b for a, b in zip(batch, ours))}/{len(prompts)}"}]
    table = pd.DataFrame(rows).set_index("call")
    table["page_size"], table["num_blocks"] = cb.page_size, cb.num_blocks
    return table, None


# --------------------------------------------------------------------------------------------
# What we measured
# --------------------------------------------------------------------------------------------


def summary(contiguous, paged16, w0, wv, wm_seeds, savings, worst_sketch, kernel_err, same_generation, prompt_tokens):
    """The chapter's measurements in one table (the conditions in the 'under' column). ``contiguous``, ``paged16``:
    (SimResult, server_view's dict); ``wm_seeds``: ``watermark_seeds``' table."""
    import numpy as np
    import pandas as pd

    (c, cx), (p16, px) = contiguous, paged16
    from ..pool_sim import PREFILL_TOKENS_PER_STEP

    small = wm_seeds[[w for w in wm_seeds.columns if 0 < w <= 0.05]]
    seeds = f"seeds {min(wm_seeds.index)}–{max(wm_seeds.index)}"
    rows = [
        ("whole pool holding tokens, mean (peak): max-length reservation / paged, block 16",
         f"{cx['pool mean']:.1%} ({cx['pool peak']:.1%}) / {px['pool mean']:.1%} ({px['pool peak']:.1%})",
         "simulated, 1,000 requests at step 0, 64K positions, max_len 2,048, no watermark"),
        ("allocated memory holding tokens: reservation / paged, block 16",
         f"{c.utilization:.1%} / {p16.utilization:.1%}",
         "the same; a share of the allocated slots, not of the pool"),
        ("reservation's allocated slots: reserved / internal fragmentation",
         f"{cx['reserved']:.1%} / {cx['never written']:.1%}", "the same (the vLLM paper's terms)"),
        ("requests running at once: reservation / paged", f"{c.mean_running:.1f} / {p16.mean_running:.1f}", "the same"),
        ("tokens prefilled again, no watermark / watermark 0.01",
         f"{w0.recomputed_tokens:,} / {wv.recomputed_tokens:,}",
         f"the same burst (a queue of waiting requests); the prompts hold {prompt_tokens:,} tokens"),
        ("steps to finish, watermark 0.01–0.05 / none", f"{small.min().min():.2f}–{small.max().max():.2f}",
         f"{seeds}, prefill at {PREFILL_TOKENS_PER_STEP} tokens/step; time until the last request finishes"),
        ("saving of paging over padding (median)", f"{np.median(savings):.0%}", "batches of 8, max/min > 4"),
        ("per-block softmax sketch, closest variant: max error", f"{worst_sketch:.3f}", "one head, 14 positions"),
        ("paged kernel vs reference: max difference (fp32)", f"{kernel_err:.1e}",
         f"{runtime.mode()} mode; block sizes 1, 5, 16, 128 (fp16 within its tolerance)"),
        ("paged generation == naive loop", str(same_generation), "tiny model, greedy and sampled"),
    ]
    return pd.DataFrame(rows, columns=["what", "measured", "under"]).set_index("what")


# --------------------------------------------------------------------------------------------
# Lab 05: exercise 1's replay, exercise 5's decision
# --------------------------------------------------------------------------------------------


def _outcome(call):
    """What a call returned, or the name of the exception it raised (a stub's NotImplementedError goes through)."""
    try:
        return repr(call())
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 - the outcome is the exception's name
        return type(err).__name__


def _first_difference(mine, reference, name, calls):
    from . import mistakes
    from .check import CheckFailed

    bad = [i for i, (m, r) in enumerate(zip(mine, reference)) if m != r]
    print(f"{name}: {len(reference) - len(bad)} of {len(reference)} agree")
    if bad:
        i = bad[0]
        m, r = mine[i], reference[i]
        why = (mistakes.allocator_step(calls[i], m[0], r[0]) if m[0] != r[0] else
               "the same result, but not the same state after it (refcounts, num_free); a refused call changes nothing")
        raise CheckFailed(f"{name}: first difference at step {i}, {calls[i]}\n  yours     {m}\n  reference {r}\n"
                          "FAIL ✗" + (f"\nDiagnosis: {why}" if why else ""))
    return True


def replay_allocator(cls, n_blocks: int = 8, steps: int = 300, seed: int = 5) -> bool:
    """Lab 05, exercise 1: one seeded random sequence of calls (allocate a few blocks, share or free one in use,
    now and then an id that is free or not in the pool) on ``cls(n_blocks)`` and on ``BlockAllocator``; after every
    call, compare what it returned (or raised), the reference counts and ``num_free``. Raises ``CheckFailed`` at
    the first difference, with a diagnosis."""
    rng = random.Random(seed)
    mine, ref = cls(n_blocks), BlockAllocator(n_blocks)
    calls, out_mine, out_ref = [], [], []
    for _ in range(steps):
        op = rng.choice(["allocate", "allocate", "share", "free", "free", "free", "free"])
        in_use = [b for b in range(n_blocks) if ref.refcount[b] > 0]
        if op == "allocate":
            arg = rng.randint(1, 3)  # sometimes more than is free
        elif in_use and rng.random() < 0.85:
            arg = rng.choice(in_use)
        else:
            arg = rng.randint(-1, n_blocks)  # may be free or not an id at all
        calls.append(f"{op}({arg})")
        for alloc, out in ((mine, out_mine), (ref, out_ref)):
            out.append((_outcome(lambda: getattr(alloc, op)(arg)), list(alloc.refcount), alloc.num_free))
    for kind in ("allocate", "share", "free"):  # what the replay exercised, per kind of call
        results = [o[0] if o[0].endswith("Error") else "ok" for c, o in zip(calls, out_ref) if c.startswith(kind)]
        print(f"  {kind:8s}", {r: results.count(r) for r in sorted(set(results))})
    return _first_difference(out_mine, out_ref, "(outcome, refcounts, num_free) after each call", calls)


ERROR_CASES = {
    "allocate(4), 3 free": lambda a: a.allocate(4),
    "allocate(3), 3 free": lambda a: a.allocate(3),
    "free(8), no such id": lambda a: a.free(8),
    "free(-1), no such id": lambda a: a.free(-1),
    "free(6), a free block": lambda a: a.free(6),
    "share(7), a free block": lambda a: a.share(7),
    "free(2) twice": lambda a: (a.free(2), a.free(2)),
    "share(2), free(2) twice": lambda a: (a.share(2), a.free(2), a.free(2)),
}


def allocator_error_cases(cls) -> bool:
    """Lab 05, exercise 1: each error case on a fresh pair of allocators of 8 blocks with blocks 0-4 in use; then
    the message of a refused ``allocate(6)`` must name both numbers (6 asked, 3 free)."""
    from .check import CheckFailed

    yours, reference = [], []
    for what, call in ERROR_CASES.items():
        a, r = cls(8), BlockAllocator(8)
        a.allocate(5)
        r.allocate(5)
        yours.append((_outcome(lambda: call(a)), list(a.refcount), a.num_free))
        reference.append((_outcome(lambda: call(r)), list(r.refcount), r.num_free))
        print(f"  {what:26s} yours {yours[-1][0]:17s} reference {reference[-1][0]:17s} "
              + ("✓" if yours[-1] == reference[-1] else "✗"))
    _first_difference(yours, reference, "error cases (outcome, refcounts, num_free)", list(ERROR_CASES))
    a = cls(8)
    a.allocate(5)
    try:
        a.allocate(6)
        message = "(nothing raised)"
    except OutOfBlocksError as err:
        message = str(err)
    print("your message:", message)
    if "6" not in message or "3" not in message:
        raise CheckFailed("FAIL ✗ the message should say how many blocks were asked for (6) and how many are free (3)")
    return True


BLOCK_CHOICES = (8, 16, 32, 64, 128, 256)  # the block sizes exercise 5 chooses among
SEEDS = (0, 1, 2, 3, 4)  # exercise 5's evidence: the same workload drawn with each seed, steps averaged
TOLERANCE = 0.03  # "as fast": mean steps at most this share above the fastest candidate's
# exercise 5's two workloads: 300 requests each, all at step 0, watermark 0.01 (vLLM's default); both keep the pool
# busy for several rounds of requests, so no single long request decides when a run ends
WORKLOADS = {
    "short chat": dict(requests=dict(n=300, mean_prompt=40, mean_output=60, max_len=512),
                       capacity_tokens=8 * 1024, max_len=512),
    "long answers": dict(requests=dict(n=300, mean_prompt=400, mean_output=600, sigma=0.5, max_len=4096),
                         capacity_tokens=64 * 1024, max_len=4096),
}


def block_size_runs(workload: str, block_sizes=BLOCK_CHOICES, seeds=SEEDS):
    """{seed: {block size: SimResult}} for one of ``WORKLOADS``: the same requests for every block size."""
    from ..pool_sim import sample_requests, simulate

    w = WORKLOADS[workload]
    out = {}
    for seed in seeds:
        requests = sample_requests(seed=seed, **w["requests"])
        out[seed] = {bs: simulate(requests, w["capacity_tokens"], "paged", block_size=bs, max_len=w["max_len"],
                                  watermark=0.01) for bs in block_sizes}
    return out


def block_size_evidence(workload: str, block_sizes=BLOCK_CHOICES, seeds=SEEDS):
    """A copy of ``_evidence``'s table (computed once per workload, block sizes and seeds: the runs are
    deterministic)."""
    return _evidence(workload, tuple(block_sizes), tuple(seeds)).copy()


@functools.lru_cache(maxsize=8)
def _evidence(workload: str, block_sizes, seeds):
    """The simulator's verdict on each block size for one of ``WORKLOADS``, over ``seeds``: mean steps to finish,
    their excess over the fastest candidate's mean, the range of that excess seed by seed (each seed against its
    own fastest), and the means of internal fragmentation, requests running at once and preemptions."""
    import statistics

    import pandas as pd

    runs = block_size_runs(workload, block_sizes, seeds)
    mean = {bs: statistics.mean(runs[s][bs].steps for s in seeds) for bs in block_sizes}
    fastest = min(mean.values())
    per_seed = {bs: [runs[s][bs].steps / min(r.steps for r in runs[s].values()) - 1 for s in seeds]
                for bs in block_sizes}
    return pd.DataFrame([{
        "block size": bs, "steps to finish (mean)": mean[bs], "vs fastest": mean[bs] / fastest - 1,
        "vs fastest, seed min": min(per_seed[bs]), "vs fastest, seed max": max(per_seed[bs]),
        "internal fragmentation": statistics.mean(runs[s][bs].internal_fragmentation for s in seeds),
        "mean running": statistics.mean(runs[s][bs].mean_running for s in seeds),
        "preemptions": statistics.mean(runs[s][bs].preemptions for s in seeds),
    } for bs in block_sizes]).set_index("block size").round(3)


def block_size_answer(evidence, tolerance: float = TOLERANCE) -> int:
    """The largest block size whose mean steps are within ``tolerance`` of the fastest candidate's."""
    return int(max(bs for bs, x in evidence["vs fastest"].items() if x <= tolerance))


def tolerance_range(evidence) -> tuple[float, float]:
    """The tolerances that give the same answer as TOLERANCE: from the answer's own excess up to (not including)
    the smallest excess of a larger candidate (inf if none)."""
    ref = block_size_answer(evidence)
    larger = [x for bs, x in evidence["vs fastest"].items() if bs > ref]
    return float(evidence.loc[ref, "vs fastest"]), float(min(larger)) if larger else float("inf")


def check_prediction(yours) -> bool:
    """Lab 05, exercise 5's first question: which workload tolerates the larger block (before the evidence)."""
    from .check import CheckFailed

    ref = "long answers"
    if yours not in WORKLOADS:
        raise CheckFailed(f"FAIL ✗ name one of {list(WORKLOADS)}, got {yours!r}")
    report = f"the workload that tolerates the larger block: yours {yours!r}  reference {ref!r}  "
    if yours == ref:
        print(report + "✓\nPASS ✓")
        return True
    raise CheckFailed(report + "✗\nFAIL ✗\nDiagnosis: a block's unused tail is up to block_size − 1 slots whatever "
                      "the sequence's length; against a sequence of about a hundred tokens that is a large share of "
                      "its memory, against one of about a thousand a small one")


def check_block_size_choice(workload: str, yours) -> bool:
    """Lab 05's decision: which block size to configure for ``workload``. Prints the evidence (over SEEDS), then
    yours vs the reference and the tolerances that give the same answer; a wrong choice fails with a diagnosis."""
    from . import mistakes
    from .check import CheckFailed

    evidence = block_size_evidence(workload)
    ref = block_size_answer(evidence)
    lo, hi = tolerance_range(evidence)
    print(f"{workload}: the simulator on each candidate, seeds {SEEDS[0]}–{SEEDS[-1]} (watermark 0.01)\n"
          f"{evidence.to_string()}\n")
    try:
        yours = int(yours)
    except (TypeError, ValueError):
        raise CheckFailed(f"FAIL ✗ a block size is one of {BLOCK_CHOICES}, got {yours!r}") from None
    ok = yours == ref
    report = f"{workload}: yours {yours}  reference {ref}  " + ("✓" if ok else "✗")
    if ok:
        print(report + f"\n(any tolerance from {lo:.1%} to under {hi:.1%} gives this choice)\nPASS ✓")
        return True
    raise CheckFailed(report + "\nFAIL ✗\nDiagnosis: " + mistakes.block_size_choice(evidence, yours, ref, TOLERANCE))


def check_slot_guess(cache, seq, pos: int, yours) -> bool:
    """Lab 05, exercise 2's first question: the slot of position ``pos`` of sequence ``seq``, read off the picture.
    Prints yours vs the cache's own answer; a wrong number fails with what it means."""
    from . import mistakes
    from .check import CheckFailed

    table, bs = cache.tables[seq], cache.block_size
    ref = table[pos // bs] * bs + pos % bs
    ok = yours == ref
    report = f"slot of position {pos} of {seq!r}: yours {yours}  reference {ref}  " + ("✓" if ok else "✗")
    if ok:
        print(report + "\nPASS ✓")
        return True
    why = mistakes.slot_by_hand(table, pos, bs, yours)
    raise CheckFailed(report + "\nFAIL ✗" + (f"\nDiagnosis: {why}" if why else ""))
