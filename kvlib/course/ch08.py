"""Chapter 08's harnesses, shared by its two sittings (08a: serving many requests; 08b: the prefix cache).

The notebooks keep what they teach (the engine's rules, what each run shows); what they measure with is here:
- the trace: ``make_trace`` (Poisson arrivals, log-normal lengths), ``trace_lines``, ``plot_trace``;
- the two servers on one clock: ``run_static`` (static batching with ``kvlib.generate.generate``, counted in the
  engine's steps) and ``replay`` (a fresh ``Engine`` fed the trace as its clock reaches each arrival; with
  ``record=True`` it keeps, per step, the one forward's layout: which requests, how many tokens, which slots);
- ``summarize`` / ``steps_table`` / ``wall_table``: TTFT and TPOT in steps and in seconds; ``step_layout``;
- ``engine_grid`` / ``plot_kv_memory`` / ``plot_cdfs``: the timeline rebuilt from ``engine.events``, the KV memory
  each server holds, the latency distributions;
- 08a: ``ordering_table`` (the source article's "balance sequence-length similarity"), ``preemption_table``,
  ``watermark_table``, ``budget_table``, ``time_recompute_swap`` / ``plot_crossover``, ``capped_demo``, ``check_alone``;
- the deep dive: ``GPUS`` / ``preempt_costs`` / ``crossover_at`` / ``gpu_table`` / ``plot_n_star`` (the crossover
  of recompute and swap on a GPU, calculated from datasheet figures in the efficiency ratio r);
- 08b: ``rag_workload`` / ``rag_table`` / ``all_cached_demo`` / ``tier_runs`` / ``tier_table``, ``failing_step_demo`` /
  ``damaged_disk_demo`` (faults that move no request), ``serve_chats`` / ``live_demo`` (SmolLM2), ``side_by_side_trials`` /
  ``floor_line`` / ``profile_engines`` (beside transformers);
- labs 08a and 08b: ``toy_model``, ``admission_trace``, ``preemption_trace``, ``chunk_case``, ``measured_costs`` and
  ``check_preemption_choice``; ``prefix_cases``, ``host_tier_runs`` and ``check_host_tier_choice``.
- ``summary_a`` / ``summary_b``: what each sitting measured, as one table.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import shutil
import tempfile
import time

import numpy as np
import torch

from ..engine import Engine
from ..generate import generate

__all__ = ["BLOCK", "B", "BUDGET", "ORDERS", "WAIT", "PREFILL", "DECODE", "IDLE", "PREEMPT", "make_trace",
           "trace_lines", "plot_trace", "run_static", "replay", "summarize", "steps_table", "wall_table",
           "step_layout", "engine_grid", "plot_kv_memory", "plot_cdfs", "ordering_table",
           "preemption_table", "watermark_table", "budget_table", "time_recompute_swap", "plot_crossover",
           "capped_demo", "check_alone", "GPUS", "MODELS", "RATIOS", "preempt_costs", "recompute_window",
           "crossover_at", "gpu_table", "plot_n_star", "rag_workload", "rag_table", "all_cached_demo", "tier_runs",
           "tier_table", "failing_step_demo", "damaged_disk_demo", "serve_chats", "live_demo",
           "floor_line", "profile_engines", "summary_a", "summary_b"]

BLOCK, B, BUDGET = 16, 8, 128  # block size (positions), most requests at once, most tokens per step
ORDERS = ["arrival", "prompt length", "output length", "prompt + output length"]  # how static batches are picked
WAIT, PREFILL, DECODE, IDLE, PREEMPT = 1, 2, 3, 4, 5  # what a request does in a step (0: not there)
KIND_NAMES = ["waiting", "prefill", "decode", "done, row still decoding", "preempted"]


# --------------------------------------------------------------------------------------------
# The trace
# --------------------------------------------------------------------------------------------


def make_trace(n, rate, seed, prompt_median=48, output_median=24, sigma=0.8, all_at_once=False):
    """n requests: Poisson arrivals (``rate`` per step, the first at step 0), log-normal prompt and output lengths,
    random printable-byte prompts for the tiny byte-level model. Seeded."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, n)
    arrivals = np.zeros(n, int) if all_at_once else np.floor(np.cumsum(gaps) - gaps[0]).astype(int)
    p_len = np.clip(rng.lognormal(np.log(prompt_median), sigma, n), 4, 320).astype(int)
    o_len = np.clip(rng.lognormal(np.log(output_median), sigma, n), 2, 160).astype(int)
    return [dict(arrival=int(a), prompt=rng.integers(32, 127, int(p)).tolist(), max_new=int(o))
            for a, p, o in zip(arrivals, p_len, o_len)]


def trace_lines(trace, rate):
    p = np.array([len(r["prompt"]) for r in trace])
    o = np.array([r["max_new"] for r in trace])
    t = p + o
    return [f"{len(trace)} requests arriving over steps 0..{trace[-1]['arrival']} (rate {rate} per step)",
            f"prompt tokens: median {np.median(p):.0f}, max {p.max()}, sum {p.sum():,}",
            f"output tokens: median {np.median(o):.0f}, max {o.max()}, sum {o.sum():,}",
            f"prompt + output: shortest {t.min()}, longest {t.max()} ({t.max() / t.min():.0f}x apart)"]


def plot_trace(trace, seed):
    import matplotlib.pyplot as plt

    p = [len(r["prompt"]) for r in trace]
    o = [r["max_new"] for r in trace]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3))
    axes[0].hist(p, bins=20)
    axes[0].set(xlabel="prompt length (tokens)", ylabel="requests")
    axes[1].hist(o, bins=20, color="C1")
    axes[1].set(xlabel="output length (tokens)", ylabel="requests")
    axes[2].step([r["arrival"] for r in trace], np.arange(1, len(trace) + 1), where="post")
    axes[2].set(xlabel="arrival (engine step)", ylabel="requests arrived so far")
    fig.suptitle(f"The trace: {len(trace)} requests, seed {seed} (generated, no device)")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------
# Static batching, on the engine's clock
# --------------------------------------------------------------------------------------------


class Timed:
    """The model, as ``generate`` sees it, noting the time at which each forward call ends."""

    def __init__(self, model):
        self.model, self.ends = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kw):
        out = self.model(*args, **kw)
        if out.is_cuda:
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())
        return out


def _static_order(trace, waiting, order):
    keys = {"prompt length": lambda i: len(trace[i]["prompt"]), "output length": lambda i: trace[i]["max_new"],
            "prompt + output length": lambda i: len(trace[i]["prompt"]) + trace[i]["max_new"]}
    return sorted(waiting, key=keys[order]) if order in keys else waiting


def run_static(model, trace, order="arrival", batch_size=B, budget=BUDGET):
    """Static batching: when the server is free it takes up to ``batch_size`` waiting requests (in ``order``), runs
    them with ``generate`` to the end of the longest, and only then looks at the queue again.

    Counted on the engine's clock: the batch's prefill takes ceil(prompt tokens / budget) steps (its measured time
    spread evenly over them), each decode pass one step. ``grid`` (requests, steps) says what each request did in
    each step (WAIT, PREFILL, DECODE, IDLE: its answer is complete but its row still decodes); ``kv_positions``
    the KV positions reserved (generate's contiguous cache: one row of longest prompt + output per request),
    ``kv_holding`` those holding a token; ``wasted`` the decode slots spent on finished rows."""
    n = len(trace)
    started, outputs, recs = [False] * n, {}, {}
    step_s, cols, reserved, holding = [], [], [], []
    wasted, clock = 0, 0
    while len(outputs) < n:
        waiting = [i for i in range(n) if not started[i] and trace[i]["arrival"] <= clock]
        if not waiting:  # nothing to do until the next arrival: a step that costs nothing
            step_s.append(0.0), cols.append(np.zeros(n, int)), reserved.append(0), holding.append(0)
            clock += 1
            continue
        batch = _static_order(trace, waiting, order)[:batch_size]
        for i in batch:
            started[i] = True
        prompts = [trace[i]["prompt"] for i in batch]
        new = max(trace[i]["max_new"] for i in batch)
        timed = Timed(model)
        t0 = time.perf_counter()
        out = generate(timed, prompts, new)
        n_prefill = -(-sum(map(len, prompts)) // budget)
        prefill_end = timed.ends[len(batch) - 1]  # one prefill call per prompt, then new - 1 decode calls
        durations = [(prefill_end - t0) / n_prefill] * n_prefill + list(np.diff([prefill_end] + timed.ends[len(batch):]))
        first = clock + n_prefill - 1  # the step that gives every request of the batch its first token
        for b, i in enumerate(batch):
            outputs[i] = out[b, : trace[i]["max_new"]].tolist()
            recs[i] = dict(arrival=trace[i]["arrival"], first=first, finish=first + trace[i]["max_new"] - 1,
                           n=trace[i]["max_new"])
            wasted += new - trace[i]["max_new"]
        rows = len(batch) * (max(map(len, prompts)) + new)
        prompt_tokens = sum(map(len, prompts))
        for s, d in enumerate(durations):
            col = np.zeros(n, int)
            for i in range(n):
                if not started[i] and trace[i]["arrival"] <= clock + s:
                    col[i] = WAIT
            k = s - n_prefill + 1  # decode pass k (k <= 0: still prefilling)
            for i in batch:
                col[i] = PREFILL if k <= 0 else (DECODE if k < trace[i]["max_new"] else IDLE)
            step_s.append(d), cols.append(col), reserved.append(rows)
            holding.append(prompt_tokens * (s + 1) / n_prefill if k <= 0 else prompt_tokens + len(batch) * k)
        clock += len(durations)
    return dict(name=f"static, {order}", outputs=outputs, recs=[recs[i] for i in range(n)], step_s=step_s,
                grid=np.array(cols).T, kv_positions=reserved, kv_holding=holding, wasted=wasted)


# --------------------------------------------------------------------------------------------
# Continuous batching: the engine fed the same trace
# --------------------------------------------------------------------------------------------


def _recorder(engine, views):
    """Wrap ``engine.cache.ragged`` (the one forward's seam) to note, per step, the forward's layout."""
    cache, ragged = engine.cache, engine.cache.ragged

    def noting(seq_ids, new_tokens):
        view = ragged(seq_ids, new_tokens)
        reqs = [engine.requests[s] for s in view.seq_ids]
        views[engine.clock] = dict(
            step=engine.clock, seq_ids=list(view.seq_ids), counts=list(view.counts), start=list(view.start),
            slots=[int(x) for x in view.slots.tolist()], block_size=cache.block_size,
            num_blocks=cache.allocator.num_blocks,
            decode=[r.pending == 1 for r in reqs],  # the engine's own rule: one token pending = decoding
            samples=[r.computed + n == len(r.tokens) for r, n in zip(reqs, view.counts)],
            held={r.id: list(cache.tables[r.id]) for r in engine.running},  # every running request's blocks
            cached=list(cache.cached))
        return view

    cache.ragged = noting


def replay(model, trace, record=False, **engine_kw):
    """A fresh Engine; request i is added when the engine's clock reaches its arrival step. Returns the run: the
    engine, ids, per-request records (steps), outputs, per-step wall time and KV positions held, the blocks swapped
    out; with ``record``, ``views``: {step: the one forward's layout} (see ``_recorder``)."""
    engine = Engine(model, **engine_kw)
    views = {}
    if record:
        _recorder(engine, views)
    ids, k, swapped_blocks = {}, 0, 0
    while k < len(trace) or engine.has_unfinished():
        while k < len(trace) and trace[k]["arrival"] <= engine.clock:
            ids[k] = engine.add_request(trace[k]["prompt"], trace[k]["max_new"])
            k += 1
        ev = engine.step()
        swapped_blocks += sum(r.host[0][0].shape[0] for r in engine.swapped if r.id in ev["preempted"])
    recs = []
    for i in range(len(trace)):
        r = engine.requests[ids[i]]
        recs.append(dict(arrival=r.arrival_step, first=r.first_token_step, finish=r.finish_step, n=len(r.output)))
    return dict(name=f"continuous ({engine.config.preemption})", engine=engine, ids=ids, recs=recs, views=views,
                outputs={i: engine.requests[ids[i]].output for i in range(len(trace))},
                step_s=[ev["wall_s"] for ev in engine.events],
                kv_positions=[(engine.config.num_blocks - ev["free_blocks"]) * engine.config.block_size
                              for ev in engine.events],
                swapped_blocks=swapped_blocks, wasted=0)


def summarize(run):
    """TTFT (arrival up to and including the step of the first token) and TPOT (between first and last token), in
    steps and, with each step costing its measured compute time, in seconds; throughput."""
    recs, step_s = run["recs"], np.asarray(run["step_s"])
    cum = np.concatenate([[0.0], np.cumsum(step_s)])  # cum[s]: compute time before step s
    multi = [r for r in recs if r["n"] > 1]
    ttft = [r["first"] - r["arrival"] + 1 for r in recs]
    tpot = [(r["finish"] - r["first"]) / (r["n"] - 1) for r in multi]
    ttft_s = [cum[r["first"] + 1] - cum[r["arrival"]] for r in recs]
    tpot_s = [(cum[r["finish"] + 1] - cum[r["first"] + 1]) / (r["n"] - 1) for r in multi]
    tokens = sum(r["n"] for r in recs)
    return dict(policy=run["name"], steps=len(step_s), tokens_per_step=tokens / len(step_s),
                ttft_p50=np.percentile(ttft, 50), ttft_p99=np.percentile(ttft, 99),
                tpot_p50=np.percentile(tpot, 50), tpot_p99=np.percentile(tpot, 99), wasted_slots=run["wasted"],
                wall_s=cum[-1], tokens_per_s=tokens / cum[-1],
                ttft_ms_p50=1e3 * np.percentile(ttft_s, 50), ttft_ms_p99=1e3 * np.percentile(ttft_s, 99),
                tpot_ms_p50=1e3 * np.percentile(tpot_s, 50), tpot_ms_p99=1e3 * np.percentile(tpot_s, 99),
                ttft_steps=ttft, ttft_s=ttft_s, tpot_s=tpot_s)


STEPS_COLS = ["steps", "tokens_per_step", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "wasted_slots"]
WALL_COLS = ["wall_s", "tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99"]


def steps_table(summ):
    import pandas as pd

    return pd.DataFrame([{k: s[k] for k in ["policy"] + STEPS_COLS} for s in summ.values()]).set_index("policy")


def wall_table(runs):
    """Seconds on this machine: compute time of the steps (idle steps cost nothing), and the median step time of
    the engine's steps that only decode and of those that also carried a prefill chunk."""
    import pandas as pd

    rows = []
    for name, run in runs.items():
        s = summarize(run)
        row = {"run": name, **{k: s[k] for k in WALL_COLS}}
        if "engine" in run:
            evs = run["engine"].events
            dec = [1e3 * ev["wall_s"] for ev in evs if ev["decode_tokens"] and not ev["prefill_tokens"]]
            mix = [1e3 * ev["wall_s"] for ev in evs if ev["decode_tokens"] and ev["prefill_tokens"]]
            row.update({"decode-only step ms": np.median(dec) if dec else np.nan,
                        "mixed step ms": np.median(mix) if mix else np.nan})
        rows.append(row)
    return pd.DataFrame(rows).set_index("run")


def _compute_steps(run) -> int:
    """The steps of a run that computed anything (a step in which nothing runs costs nothing, in either policy)."""
    if "engine" in run:
        return sum(1 for ev in run["engine"].events if ev["scheduled"])
    return int(sum(1 for s in run["step_s"] if s > 0))


def ab_trials(model, trace, engine_kw, trials=3, first=None):
    """Static batching (arrival order) and continuous batching on the same trace, ``trials`` times each, alternating
    (static first in even trials, continuous first in odd ones) so that a change of load on the machine falls on both.
    One clock: the wall clock (``time.perf_counter``) of the steps that compute, as in ``summarize``. Returns a
    DataFrame, one row per run: trial, policy, tokens/s, seconds, steps that computed, ms per such step.

    ``first``: (static run, continuous run) already made back to back in that order, on this trace with these
    ``engine_kw`` (``run_static(model, trace, "arrival")``, then ``replay(model, trace, **engine_kw)``, recorded or
    not: the recorder's own work is about 0.1 ms of a step's 15 or more): trial 0's pair, so the trace is not run
    once more for it."""
    import pandas as pd

    if first is not None and (first[0].get("name") != "static, arrival" or "engine" not in first[1]
                              or len(first[0]["recs"]) != len(trace) or len(first[1]["recs"]) != len(trace)):
        raise ValueError("first must be (run_static(model, trace, 'arrival'), replay(model, trace, **engine_kw))")
    rows = []
    for t in range(trials):
        for policy in ("static", "continuous") if t % 2 == 0 else ("continuous", "static"):
            if t == 0 and first is not None:
                run = first[0] if policy == "static" else first[1]
            elif policy == "static":
                run = run_static(model, trace, "arrival")
            else:
                run = replay(model, trace, **engine_kw)
            s, busy = summarize(run), _compute_steps(run)
            rows.append(dict(trial=t, policy=policy, tokens_per_s=s["tokens_per_s"], wall_s=s["wall_s"],
                             compute_steps=busy, ms_per_step=1e3 * s["wall_s"] / busy))
    return pd.DataFrame(rows)


def ab_ranges(df):
    """Min and max over the trials of ``ab_trials``: tokens/s and ms per computing step per policy, and the
    continuous / static tokens/s ratio of each trial (the two runs of one trial ran back to back)."""
    wide = df.pivot(index="trial", columns="policy", values="tokens_per_s")
    ratio = wide["continuous"] / wide["static"]
    out = {p: dict(tps=(g["tokens_per_s"].min(), g["tokens_per_s"].max()),
                   ms=(g["ms_per_step"].min(), g["ms_per_step"].max()), ms_median=g["ms_per_step"].median(),
                   steps=int(g["compute_steps"].iloc[0]))
           for p, g in df.groupby("policy")}
    out["ratio"] = (ratio.min(), ratio.max())
    return out


def step_layout(view):
    """The one forward of a recorded step as a table: request, tokens in the forward, role, whether it draws."""
    import pandas as pd

    return pd.DataFrame([{"request": rid, "tokens in the forward": n, "role": "decode" if d else "prefill chunk",
                          "positions": f"{s}..{s + n - 1}", "draws a token": smp}
                         for rid, n, d, s, smp in zip(view["seq_ids"], view["counts"], view["decode"], view["start"],
                                                      view["samples"])])


# --------------------------------------------------------------------------------------------
# Pictures of a run
# --------------------------------------------------------------------------------------------


def engine_grid(engine, views=None):
    """(requests, steps): what each request did in each step, rebuilt from ``engine.events`` alone (recompute
    preemption drops a request's K/V; a request that finds blocks in the prefix cache when it is admitted again
    needs ``views``, a recorded run's layouts, which say where each step's tokens start)."""
    reqs = engine.requests
    grid = np.zeros((len(reqs), len(engine.events)), int)
    computed, emitted = {i: 0 for i in reqs}, {i: 0 for i in reqs}
    for ev in engine.events:
        s = ev["step"]
        for i, r in reqs.items():
            if r.arrival_step <= s <= (r.finish_step if r.finish_step is not None else s):
                grid[i, s] = WAIT
        for i in ev["preempted"]:
            grid[i, s] = PREEMPT
            if engine.config.preemption == "recompute":
                computed[i] = 0  # its K/V are dropped: all of it is prefilled again
        decodes = 0
        if views is not None and s in views:
            for i, start in zip(views[s]["seq_ids"], views[s]["start"]):
                computed[i] = start
        for i, n in ev["scheduled"].items():
            tokens = len(reqs[i].prompt) + emitted[i]
            is_decode = tokens - computed[i] == 1  # the engine's own rule: one token pending = decoding
            grid[i, s] = DECODE if is_decode else PREFILL
            decodes += is_decode
            computed[i] += n
            emitted[i] += computed[i] == tokens
        if decodes != ev["decode_tokens"]:
            raise RuntimeError(f"step {s}: the rebuilt timeline has {decodes} decodes, the engine's event "
                               f"{ev['decode_tokens']}")
    return grid


def plot_kv_memory(static_run, cont_run, pool_positions):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(13, 3.5))
    ax.plot(static_run["kv_positions"], label="static: reserved", color="C3")
    ax.plot(static_run["kv_holding"], label="static: holding tokens", color="C3", ls=":")
    ax.plot(cont_run["kv_positions"], label="continuous: blocks held × block size", color="C2")
    ax.axhline(pool_positions, color="k", lw=0.8, ls="--", label="pool size")
    ax.set(xlabel="engine step", ylabel="KV positions (tokens)", title="KV memory over time (same trace)")
    ax.legend(fontsize=8)
    return fig


def plot_cdfs(summ, names, device):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for name, color in zip(names, ("C3", "C2")):
        s = summ[name]
        for ax, data in zip(axes, (s["ttft_steps"], 1e3 * np.array(s["ttft_s"]), 1e3 * np.array(s["tpot_s"]))):
            x = np.sort(data)
            ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=name, color=color)
    cdf = "fraction of requests with at most x"
    axes[0].set(xlabel="TTFT (engine steps)", ylabel=cdf, title="TTFT in steps (same on every machine)")
    axes[1].set(xlabel="TTFT (ms)", ylabel=cdf, title=f"TTFT (ms), {device}")
    axes[2].set(xlabel="TPOT (ms per token)", ylabel=cdf, title=f"TPOT (ms per token), {device}")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------
# 08a: ordering, admission, budget, preemption, caps, correctness
# --------------------------------------------------------------------------------------------


def ordering_table(summ_online, summ_offline):
    """Steps and wasted decode slots per static order and continuous batching, arriving over time and all at once."""
    import pandas as pd

    rows = []
    for where, summ in (("arriving over time", summ_online), ("all at step 0", summ_offline)):
        for name, s in summ.items():
            rows.append({"trace": where, "policy": name, "steps": s["steps"], "wasted_slots": s["wasted_slots"],
                         "ttft_p99": s["ttft_p99"]})
    return pd.DataFrame(rows).set_index(["trace", "policy"])


def _block_bytes(engine):
    c = engine.cache
    return len(c.k) * 2 * c.k[0][0].numel() * c.k[0].element_size()  # K and V of every layer


def prefill_computed(engine) -> int:
    """Prompt positions the engine computed (again, after a recompute preemption): every token it computed less one
    decode per generated token but the last. Exact, unlike the events' ``prefill_tokens``, which counts a request's
    last prompt chunk as a decode when it is a single token (the engine's rule: one token pending = decoding)."""
    computed = sum(sum(ev["scheduled"].values()) for ev in engine.events)
    return computed - sum(max(0, len(r.output) - 1) for r in engine.requests.values())


def preemption_table(runs, prompt_tokens):
    """Per run: steps, preemptions, prefill tokens, tokens recomputed, tokens found cached, blocks swapped, MiB
    copied, TTFT and TPOT p99 in steps."""
    import pandas as pd

    rows = []
    for name, run in runs.items():
        e = run["engine"]
        prefilled = prefill_computed(e)
        found = sum(r.cached_tokens for r in e.requests.values())
        s = summarize(run)
        rows.append({"run": name, "steps": len(e.events), "preemptions": sum(len(ev["preempted"]) for ev in e.events),
                     "prefill tokens": prefilled, "recomputed": prefilled + found - prompt_tokens,
                     "found cached": found,
                     "blocks swapped out": run["swapped_blocks"],
                     "MiB copied (out + in)": round(2 * run["swapped_blocks"] * _block_bytes(e) / 2**20, 2),
                     "ttft_p99": s["ttft_p99"], "tpot_p99": s["tpot_p99"]})
    return pd.DataFrame(rows).set_index("run")


def watermark_table(model, trace, engine_kw, watermarks):
    """The same trace on the same (small) pool at several admission watermarks, in steps (recorded runs)."""
    import pandas as pd

    prompt_tokens = sum(len(r["prompt"]) for r in trace)
    rows, runs = [], {}
    for w in watermarks:
        run = runs[w] = replay(model, trace, record=True, **{**engine_kw, "watermark": w})
        e, s = run["engine"], summarize(run)
        rows.append({"watermark": w, "blocks kept free": int(w * e.config.num_blocks),
                     "preemptions": sum(len(ev["preempted"]) for ev in e.events),
                     "recomputed": prefill_computed(e) + sum(r.cached_tokens for r in e.requests.values()) - prompt_tokens,
                     "mean running": np.mean([ev["running"] for ev in e.events]), "steps": s["steps"],
                     "ttft_p50": s["ttft_p50"], "ttft_p99": s["ttft_p99"]})
    return pd.DataFrame(rows).set_index("watermark"), runs


def budget_table(model, trace, engine_kw, budgets, given=None):
    """The same trace at several token budgets per step (chunk sizes): steps, TTFT and TPOT in steps, the most
    tokens in one step and the median wall time of a mixed step. ``given``: {budget: a run already made}."""
    import pandas as pd

    rows, runs = [], {}
    for b in budgets:
        run = runs[b] = (given or {}).get(b) or replay(model, trace, **{**engine_kw, "max_batched_tokens": b})
        e, s = run["engine"], summarize(run)
        mix = [1e3 * ev["wall_s"] for ev in e.events if ev["decode_tokens"] and ev["prefill_tokens"]]
        rows.append({"max_batched_tokens": b, "steps": s["steps"], "ttft_p50": s["ttft_p50"],
                     "ttft_p99": s["ttft_p99"], "tpot_p99": s["tpot_p99"],
                     "most tokens in a step": max(ev["prefill_tokens"] + ev["decode_tokens"] for ev in e.events),
                     "mixed step ms (median)": np.median(mix) if mix else np.nan})
    return pd.DataFrame(rows).set_index("max_batched_tokens"), runs


def time_recompute_swap(model, lengths, block_size=BLOCK):
    """For a sequence of n tokens: the time to recompute its K/V (a prefill of n tokens through the paged cache)
    against the time to swap it (copy its blocks, every layer's K and V, out to host memory and back, the two copies
    the engine's swap makes). Medians; pinned host memory on a GPU."""
    import pandas as pd

    from .. import bench
    from ..paged import PagedKVCache

    cache = PagedKVCache.for_model(model, num_blocks=-(-max(lengths) // block_size), block_size=block_size)
    pin = cache.k[0].is_cuda

    def recompute(n):
        ids = torch.randint(32, 127, (1, n), device=model.device)

        def run():
            with torch.no_grad():
                cache.add_sequence("r")
                model(ids, cache=cache.batch(["r"]))
                cache.free_sequence("r")
        return run

    def swap(n):
        idx = torch.arange(-(-n // block_size), device=cache.k[0].device)

        def run():
            host = [tuple(torch.empty((len(idx),) + p.shape[1:], dtype=p.dtype, pin_memory=pin).copy_(p[idx])
                          for p in pair) for pair in zip(cache.k, cache.v)]  # out: per layer (K, V)
            for (hk, hv), k, v in zip(host, cache.k, cache.v):  # and back in
                k[idx] = hk.to(k.device, non_blocking=True)
                v[idx] = hv.to(v.device, non_blocking=True)
        return run

    t_re = [float(np.median(bench.time_runs(recompute(n), budget_s=0.3, min_rep=3))) for n in lengths]
    t_sw = [float(np.median(bench.time_runs(swap(n), budget_s=0.1, min_rep=5))) for n in lengths]
    df = pd.DataFrame({"n tokens": lengths, "recompute (ms)": t_re, "swap out + in (ms)": t_sw})
    df["recompute / swap"] = df["recompute (ms)"] / df["swap out + in (ms)"]
    df["cheaper"] = np.where(df["recompute / swap"] > 1, "swap", "recompute")
    return df


def plot_crossover(df, device):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.loglog(df["n tokens"], df["recompute (ms)"], "o-", label="recompute (prefill of n tokens)")
    ax.loglog(df["n tokens"], df["swap out + in (ms)"], "s-", label="swap (copy out + back in)")
    ax.set(xlabel="sequence length n (tokens)", ylabel="time per sequence (ms), median",
           title=f"Recompute vs swap, tiny model, {device}")
    ax.set_xticks(list(df["n tokens"]), [str(n) for n in df["n tokens"]])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.legend()
    return fig


def capped_demo(model, block_size=BLOCK):
    """The engine's hard caps: two requests refused up front (past the context; bigger than the pool), four served
    under max_num_seqs=3 and max_batched_tokens=32. Returns (refusal messages, engine, {name: (id, prompt, n)})."""
    engine = Engine(model, num_blocks=16, block_size=block_size, max_num_seqs=3, max_batched_tokens=32)
    ctx = model.config.max_seq_len
    asks = {"short": ([65] * 20, 10), "past the context": ([66] * (ctx - 24), 100),
            "bigger than the pool": ([67] * 250, 20), "short too": ([68] * 30, 12), "and another": ([69] * 9, 6),
            "and a fourth": ([70] * 40, 8)}
    refused, ok = [], {}
    for name, (prompt, n) in asks.items():
        try:
            ok[name] = (engine.add_request(prompt, n), prompt, n)
        except ValueError as err:
            refused.append(f"refused ({name}): {err}")
    engine.run()
    return refused, engine, ok


def check_alone(model, groups):
    """Every request of every run against ``generate`` alone (each distinct request generated once). groups:
    [(runs {name: run}, trace)]. Returns (outputs checked, runs, mismatches [(run, request)])."""
    alone = {}
    checked, n_runs, bad = 0, 0, []
    for runs, trace in groups:
        for r in trace:
            key = (tuple(r["prompt"]), r["max_new"])
            if key not in alone:
                alone[key] = generate(model, [r["prompt"]], r["max_new"])[0].tolist()
        for name, run in runs.items():
            n_runs += 1
            for i, r in enumerate(trace):
                checked += 1
                if run["outputs"][i] != alone[(tuple(r["prompt"]), r["max_new"])]:
                    bad.append((name, i))
    return checked, n_runs, bad


# --------------------------------------------------------------------------------------------
# The deep dive: recompute vs swap on a GPU, calculated in the efficiency ratio r
# --------------------------------------------------------------------------------------------

GPUS = {  # peak dense fp16/bf16 tensor FLOP/s, host link bytes/s per direction, HBM bytes/s (the datasheets)
    "A100 SXM (PCIe Gen4)": (312e12, 32e9, 2.039e12),
    "H100 SXM (PCIe Gen5)": (989e12, 64e9, 3.35e12),
}
MODELS = ("Llama-2-7B", "Llama-3-8B", "SmolLM2-135M")
RATIOS = (1.0, 0.5 / 0.8)  # r = e_F / e_W: equal fractions of peak; 50% of peak FLOP/s against 80% of the link


def preempt_costs(m, F, W):
    """Seconds at the peak rates: recompute of n tokens = a·n + b·n² + h, swap = c·n. ``m``: a kvlib.memory spec."""
    head = m.vocab_size * m.hidden_size  # the output head's weights (the embedding table too, where tied)
    body = m.n_params - (1 if m.tie_embeddings else 2) * head  # what every token multiplies: no table, no head
    a = 2 * body / F  # weights' matrix products, per token
    b = 2 * m.n_layers * m.n_heads * m.head_dim / F  # causal attention (QKᵀ and PV, n²/2 each), per token²
    h = 2 * head / F  # logits for the last token only, once per sequence
    c = 2 * m.kv_bytes_per_token("fp16") / W  # out over the link and back in, per token
    return a, b, h, c


def recompute_window(costs, r=1.0):
    """Where recompute / e_F < swap / e_W (r = e_F / e_W): between the roots of b n² + (a - r c) n + h = 0;
    None: swap is cheaper at every n."""
    a, b, h, c = costs
    d = r * c - a
    if d <= 0 or d * d <= 4 * b * h:
        return None
    root = (d * d - 4 * b * h) ** 0.5
    return (d - root) / (2 * b), (d + root) / (2 * b)


def crossover_at(costs, r=1.0):
    """n*: the upper end of the window where recompute is cheaper (None: swap at every n)."""
    window = recompute_window(costs, r)
    return None if window is None else window[1]


def gpu_table():
    """The calculated crossover for each model and GPU: n* at the RATIOS, the ratio below which swap wins at every
    n, the one above which n* is past the model's context, and the time to read the weights once from HBM."""
    import pandas as pd

    from ..memory import spec

    rows = []
    for name in MODELS:
        m = spec(name)
        for gpu, (F, W, HBM) in GPUS.items():
            a, b, h, c = costs = preempt_costs(m, F, W)
            N = m.max_context
            rows.append({"model": name, "GPU": gpu, "context": N, "KV KiB/token": m.kv_bytes_per_token("fp16") / 1024,
                         "recompute µs/token": 1e6 * a, "swap µs/token": 1e6 * c,
                         **{f"n* at r = {r:g}": ("none" if crossover_at(costs, r) is None
                                                 else f"{crossover_at(costs, r):,.0f}") for r in RATIOS},
                         "swap at every n if r <": (a + 2 * (b * h) ** 0.5) / c,
                         "n* past the context if r >": (a * N + b * N**2 + h) / (c * N),
                         "alone: weights read (ms)": 1e3 * m.weight_bytes("fp16") / HBM})
    return pd.DataFrame(rows).set_index(["model", "GPU"])


def plot_n_star():
    """n*(r) for each model and GPU, the contexts as dotted lines: readable on its own."""
    import matplotlib.pyplot as plt

    from ..memory import spec

    r_grid = np.geomspace(0.1, 10, 400)
    fig, ax = plt.subplots(figsize=(10, 5))
    for k, name in enumerate(MODELS):
        m = spec(name)
        for gpu, ls in zip(GPUS, ("-", "--")):
            costs = preempt_costs(m, *GPUS[gpu][:2])
            n_of_r = [crossover_at(costs, r) for r in r_grid]
            ax.plot(r_grid, [np.nan if n is None else n for n in n_of_r], ls=ls, color=f"C{k}",
                    label=f"{name} on {gpu.split(' (')[0]}")
    for context in sorted({spec(name).max_context for name in MODELS}):
        ax.axhline(context, color="k", lw=0.8, ls=":")
        ax.text(0.11, context * 1.08, f"context {context:,} ({', '.join(n for n in MODELS if spec(n).max_context == context)})",
                fontsize=8)
    for r in RATIOS:
        ax.axvline(r, color="grey", lw=0.6)
        ax.text(r * 1.03, 130, f"r = {r:g}", fontsize=8, color="grey")
    ax.set(xscale="log", yscale="log", xlim=(0.1, 10), ylim=(100, 1e6),
           xlabel="r = (achieved share of peak FLOP/s) / (achieved share of PCIe bandwidth)",
           ylabel="crossover length n* (tokens)",
           title="Preempted sequence of n tokens: recompute is cheaper below its line, swap above\n"
                 "(no line at some r: swap is cheaper at every n). CALCULATED from datasheet peaks, fp16, not measured")
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------
# 08b: the prefix cache on a RAG-like workload, tiers, faults
# --------------------------------------------------------------------------------------------


def rag_workload(n=30, n_docs=3, doc_len=192, rate=0.3, popularity=(0.6, 0.3, 0.1), seed=1):
    """n requests, each one of ``n_docs`` random documents of ``doc_len`` tokens followed by a short question;
    Poisson arrivals; documents drawn with the given popularity. Returns (requests, documents)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(32, 127, doc_len).tolist() for _ in range(n_docs)]
    gaps = rng.exponential(1 / rate, n)
    rag = [dict(arrival=int(a), doc=int(d), prompt=docs[d] + rng.integers(32, 127, int(q)).tolist(), max_new=int(o))
           for a, d, q, o in zip(np.floor(np.cumsum(gaps) - gaps[0]), rng.choice(n_docs, n, p=list(popularity)),
                                 rng.integers(8, 32, n), rng.integers(4, 24, n))]
    return rag, docs


def hit_ceiling(rag, doc_len):
    """The best hit rate any prefix cache can reach: each document computed once, the questions never shared."""
    prompt_tokens = sum(len(r["prompt"]) for r in rag)
    question_tokens = prompt_tokens - doc_len * len(rag)
    return 1 - (len({r["doc"] for r in rag}) * doc_len + question_tokens) / prompt_tokens


def rag_table(runs, rag):
    """Prefix caching off and on: hit rate, prefill tokens computed, steps, TTFT in steps."""
    import pandas as pd

    prompt_tokens = sum(len(r["prompt"]) for r in rag)
    rows = []
    for flag, run in runs.items():
        e, s = run["engine"], summarize(run)
        cached = sum(e.metrics(run["ids"][i])["cached_tokens"] for i in range(len(rag)))
        rows.append({"prefix caching": "on" if flag else "off", "hit rate": cached / prompt_tokens,
                     "prefill tokens computed": prefill_computed(e),
                     "steps": s["steps"], "ttft_p50": s["ttft_p50"], "ttft_p99": s["ttft_p99"]})
    return pd.DataFrame(rows).set_index("prefix caching")


def late_partial_hits(run, rag, doc_len):
    """Later requests for a document that found only part of it cached, and how many of them were admitted before
    the first request with that document had its first token (so its blocks were not all computed yet)."""
    e, ids = run["engine"], run["ids"]
    first_of_doc, partial = {}, []
    for i, r in enumerate(rag):
        req = e.requests[ids[i]]
        if r["doc"] not in first_of_doc:
            first_of_doc[r["doc"]] = req
        elif req.cached_tokens < doc_len:
            partial.append(req.admitted_step <= first_of_doc[r["doc"]].first_token_step)
    return len(partial), sum(partial)


def all_cached_demo(model, engine, doc, block_size=BLOCK):
    """A prompt that is entirely in the cache (a document alone, after the run cached all its blocks): how many of
    its blocks were cached, what it served from the cache and computed, and whether its output equals generate's."""
    from ..paged import chained_block_hashes

    n_blocks = len(doc) // block_size
    found = sum(h in engine.cache.hash_to_block for h in chained_block_hashes(doc, block_size, n_blocks))
    rid = engine.add_request(doc, max_new_tokens=8)
    out = engine.run()[rid]
    m = engine.metrics(rid)
    return dict(blocks=n_blocks, found=found, served=m["cached_tokens"], computed=len(doc) - m["cached_tokens"],
                ttft_steps=m["ttft_steps"], same=out == generate(model, [doc], 8)[0].tolist())


def tier_runs(model, rag, engine_kw, doc_blocks):
    """The RAG workload on a small pool: device only; a host tier for every document's blocks; a 4-block host tier
    with a disk tier behind it. Returns ({name: run}, block files left on disk at the end)."""
    disk_dir = tempfile.mkdtemp(prefix="kv_tiers_")
    setups = {"device only": {}, f"+ host ({doc_blocks})": dict(host_blocks=doc_blocks),
              f"+ host (4) + disk ({doc_blocks})": dict(host_blocks=4, disk_dir=disk_dir, disk_blocks=doc_blocks)}
    try:
        runs = {name: replay(model, rag, **engine_kw, **kw) for name, kw in setups.items()}
        files = len(os.listdir(disk_dir))
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    return runs, files


def tier_table(runs, rag):
    """Per run: the hit rate per tier (tokens served from it / prompt tokens), prefill computed, preemptions, steps,
    queueing and TTFT in steps, MiB moved between the tiers."""
    import pandas as pd

    prompt_tokens = sum(len(r["prompt"]) for r in rag)
    rows = []
    for name, run in runs.items():
        e, s = run["engine"], summarize(run)
        m = [e.metrics(run["ids"][i]) for i in range(len(rag))]
        hit = {t: sum(x[f"cached_tokens_{t}"] for x in m) / prompt_tokens for t in ("device", "host", "disk")}
        ts = e.tier_stats
        rows.append({"run": name, "hit device": hit["device"], "hit host": hit["host"], "hit disk": hit["disk"],
                     "hit rate": sum(hit.values()),
                     "prefill tokens computed": prefill_computed(e),
                     "preemptions": sum(x["preemptions"] for x in m), "steps": s["steps"],
                     "queue_p50": np.percentile([x["queue_steps"] for x in m], 50),
                     "ttft_p50": s["ttft_p50"], "ttft_p99": s["ttft_p99"],
                     "MiB to host": ts["bytes_to_host"] / 2**20, "MiB to disk": ts["bytes_to_disk"] / 2**20,
                     "MiB back": (ts["bytes_from_host"] + ts["bytes_from_disk"]) / 2**20})
    return pd.DataFrame(rows).set_index("run")


def _snapshot(engine):
    return {r.id: (r.state, r.computed, len(r.output)) for r in engine.requests.values()}


def failing_step_demo(model, trace, engine_kw, fail_at=40):
    """The sampler raises once (as NaN probabilities would), at its ``fail_at``-th call, in the middle of the trace,
    all requests queued at step 0. Returns (the failed step, its error, whether requests and blocks were exactly as
    before it, the outputs once the run went on)."""
    engine = Engine(model, **engine_kw)
    real_sample, draws = engine._sample, {"n": 0}

    def failing_sample(samplers, logits):
        draws["n"] += 1
        if draws["n"] == fail_at:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real_sample(samplers, logits)

    engine._sample = failing_sample
    ids = [engine.add_request(r["prompt"], r["max_new"]) for r in trace]
    failed = None
    while engine.has_unfinished():
        before, avail = _snapshot(engine), engine.cache.num_available
        try:
            engine.step()
        except RuntimeError as err:
            failed = (engine.clock - 1, repr(err), _snapshot(engine) == before and engine.cache.num_available == avail)
    return (*failed, [engine.requests[i].output for i in ids])


def damaged_disk_demo(model, rag, engine_kw, doc_blocks):
    """The tiered run with every disk-tier block file truncated after every step. Returns (the engine, outputs)."""
    tier_dir = tempfile.mkdtemp(prefix="kv_damaged_")
    engine = Engine(model, **engine_kw, host_blocks=4, disk_dir=tier_dir, disk_blocks=doc_blocks)
    log = logging.getLogger("kvlib.tiers")
    level = log.level
    log.setLevel(logging.ERROR)  # the warnings are counted in tier_stats["errors"] instead
    try:
        ids = [engine.add_request(r["prompt"], r["max_new"]) for r in rag]
        while engine.has_unfinished():
            engine.step()
            for f in os.listdir(tier_dir):
                with open(os.path.join(tier_dir, f), "r+b") as fh:
                    fh.truncate(8)
    finally:
        log.setLevel(level)
        shutil.rmtree(tier_dir, ignore_errors=True)
    return engine, [engine.requests[i].output for i in ids]


# --------------------------------------------------------------------------------------------
# 08b: SmolLM2, and the side by side with transformers
# --------------------------------------------------------------------------------------------


def serve_chats(real, chats, max_new, eos_id, block_size=BLOCK):
    """The chats one at a time with ``generate`` (the reference outputs), then all at once through the engine.
    Returns (one-by-one outputs, its seconds, engine outputs in order, its seconds, the engine)."""
    t0 = time.perf_counter()
    alone = [generate(real, [p], max_new, eos_id=eos_id)[0].tolist() for p in chats]
    t_alone = time.perf_counter() - t0
    engine = Engine(real, num_blocks=64, block_size=block_size, max_num_seqs=len(chats), max_batched_tokens=256)
    rids = [engine.add_request(p, max_new, eos_id=eos_id) for p in chats]
    t0 = time.perf_counter()
    served = engine.run()
    t_engine = time.perf_counter() - t0
    return alone, t_alone, [served[i] for i in rids], t_engine, engine


def live_demo(real, rtok, chats, block_size=BLOCK, cancel_at=4):
    """Three requests: one streamed piece by piece, one ended by stop strings, one cancelled at step ``cancel_at``.
    Returns (the streamed pieces, the engine, (streamed, stopped, cancelled) ids)."""
    live = Engine(real, num_blocks=64, block_size=block_size, max_num_seqs=4, max_batched_tokens=256, tokenizer=rtok)
    streamed = live.add_request(chats[4], 24, eos_id=rtok.eos_id)
    stopped = live.add_request(chats[1], 24, eos_id=rtok.eos_id, stop=[".", "\n"])
    cancelled = live.add_request(chats[2], 24, eos_id=rtok.eos_id)
    pieces = []
    for rid, toks, reason in live.stream():
        if rid == streamed:
            pieces.append(rtok.decode(toks))
        if live.clock == cancel_at and live.requests[cancelled].state == "running":
            live.abort(cancelled)  # the client went away: its blocks go back now
    return pieces, live, (streamed, stopped, cancelled)


ENGINES = ("kvlib", "generate_batch", "padded generate")  # the side by side's engines, in its tables' order


def side_by_side_trials(real, prompts, new_tokens, threads, trials=3, block_size=BLOCK, budget=256):
    """kvlib's engine, transformers' ``generate_batch`` and padded ``generate`` (kvlib.bench.peers) on the same
    prompts, ``trials`` times each, interleaved: each trial runs the three once, the order rotated by one engine per
    trial, after one untimed warm-up of each on two short requests (one-time costs stay out). Same block size and
    token budget for the two paged engines. Returns (a DataFrame with one row per run: trial, engine, serve and
    whole-call tokens/s, TTFT median, requests token-identical to kvlib's first run; transformers' twin of ``real``;
    None), or (None, None, the reason) when transformers cannot run it."""
    import pandas as pd

    from ..bench import peers

    try:
        hf = peers.hf_model_from_kvlib(real)
    except ImportError as err:
        return None, None, f"skipped: transformers is not usable here ({err})"
    runs = {"kvlib": lambda ps, n: peers.run_kvlib_engine(real, ps, n, block_size=block_size, max_batched_tokens=budget),
            "generate_batch": lambda ps, n: peers.run_hf_continuous(hf, ps, n, page_size=block_size,
                                                                     max_batch_tokens=budget),
            "padded generate": lambda ps, n: peers.run_hf_static(hf, ps, n)}
    old = torch.get_num_threads()
    torch.set_num_threads(int(threads))
    rows, ref = [], None
    try:
        for run in runs.values():
            run([p[:8] for p in prompts[:2]], 2)
        names = list(runs)
        for t in range(trials):
            for name in names[t % 3:] + names[: t % 3]:
                outs, st = runs[name](prompts, new_tokens)
                ref = outs if ref is None and name == "kvlib" else ref
                rows.append(dict(trial=t, engine=name, serve_tokens_per_s=st["serve_tokens_per_s"],
                                 tokens_per_s=st["tokens_per_s"], ttft_median_s=float(np.median(st["ttft_s"])),
                                 outputs=outs))
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(old)
    for r in rows:
        r["identical"] = f"{sum(a == b for a, b in zip(ref, r.pop('outputs')))}/{len(prompts)}"
    df = pd.DataFrame(rows)
    df.attrs.update(threads=used, trials=trials, requests=len(prompts), new_tokens=new_tokens)
    return df, hf, None


def trial_ranges(df):
    """Per engine, over the trials of ``side_by_side_trials``: the median, min and max of serving-only and
    whole-call tokens/s, the median TTFT, and whether every run was token-identical to kvlib's."""
    import pandas as pd

    rows = []
    for name in ENGINES:
        g = df[df["engine"] == name]
        row = {"engine": name, "trials": len(g)}
        for col, label in (("serve_tokens_per_s", "serve"), ("tokens_per_s", "whole")):
            row.update({f"{label} median": g[col].median(), f"{label} min": g[col].min(), f"{label} max": g[col].max()})
        row.update({"ttft_median_s": g["ttft_median_s"].median(),
                    "identical": "all" if all(v.split("/")[0] == v.split("/")[1] for v in g["identical"]) else "no"})
        rows.append(row)
    out = pd.DataFrame(rows).set_index("engine")
    out.attrs.update(df.attrs)
    return out


def ranges_line(ranges, label) -> str:
    """One line per measure (``label``: "serve" or "whole"): each engine's min-max over the trials, and the pairs of
    engines whose ranges do not overlap ("none": these trials rank no pair)."""
    name = {"serve": "serving only", "whole": "whole call"}[label]
    span = ", ".join(f"{e} {ranges.loc[e, f'{label} min']:.1f}-{ranges.loc[e, f'{label} max']:.1f}" for e in ranges.index)
    return f"{name}, min-max over {ranges['trials'].min()} trials: {span}; separated: {separated(ranges, label)}"


def separated(ranges, label):
    """The pairs of engines whose ranges of ``label`` ("serve" or "whole") do not overlap, as "a > b"; "none" when
    every pair overlaps (no ranking: the trials do not separate them)."""
    pairs = [f"{a} > {b}" for a in ranges.index for b in ranges.index
             if a != b and ranges.loc[a, f"{label} min"] > ranges.loc[b, f"{label} max"]]
    return ", ".join(pairs) or "none"


def floor_line(real, prompts, new_tokens):
    """The work every engine must do on this workload: the weights' matrix products for at least one position per
    distinct prompt prefix plus every decode token but the last, and the head for every drawn token; and the time
    that takes at the FLOP/s this CPU reached on one MLP-sized product. Returns (GFLOP, seconds, GFLOP/s)."""
    from .. import bench

    cfg = real.config
    xb, wb = torch.randn(256, cfg.dim), torch.randn(cfg.hidden_dim, cfg.dim)
    linear_ms = float(np.median(bench.time_runs(lambda: torch.nn.functional.linear(xb, wb), budget_s=0.3, min_rep=5)))
    rate = 2 * xb.shape[0] * wb.numel() / (linear_ms / 1e3)
    head = cfg.vocab_size * cfg.dim
    body = sum(p.numel() for name, p in real.named_parameters() if not name.startswith("tok_emb"))
    if not cfg.tie_embeddings:
        body -= head
    distinct = len({tuple(p[: i + 1]) for p in prompts for i in range(len(p))})
    flops = 2 * body * (distinct + len(prompts) * (new_tokens - 1)) + 2 * head * len(prompts) * new_tokens
    return flops / 1e9, flops / rate, rate / 1e9


_GROUPS = [  # (category, predicate on an operator's name), first match wins
    ("matrix products (linear, mm, bmm)", lambda k: k in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul",
                                                          "aten::linear", "aten::baddbmm")),
    ("attention (sdpa, softmax)", lambda k: "attention" in k or "softmax" in k),
    ("copies and indexing", lambda k: any(w in k for w in ("copy", "index", "cat", "gather", "scatter", "clone",
                                                           "contiguous", "select", "slice", "to", "fill", "zero"))),
]


def _op_groups(prof) -> collections.Counter:
    """Self CPU seconds of a profile's operators (aten::*), grouped by kind (a user range's self time is Python
    time, not an operator's, so only aten operators count); also, under the keys "calls" and "GFLOP", how many
    operators ran and the FLOPs the profiler counted (matrix products; with ``with_flops=True``)."""
    groups = collections.Counter()
    for e in prof.key_averages():
        if e.key.startswith("aten::"):
            kind = next((g for g, pred in _GROUPS if pred(e.key)), "other operators")
            groups[kind] += e.self_cpu_time_total / 1e6
            groups["calls"] += e.count
            groups["GFLOP"] += (e.flops or 0) / 1e9
    return groups


class _quiet_native_stderr:
    """Silence file descriptor 2 while active: the profiler's native library logs its start and stop there."""

    def __enter__(self):
        import sys

        sys.stderr.flush()
        self.saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)
        return False


def profile_engines(real, prompts, new_tokens, hf_model=None, block_size=BLOCK, budget=256, warmup=True):
    """Both paged engines on the same prompts, once each under ``torch.profiler`` (CPU): kvlib's engine in this
    thread; transformers' ``generate_batch`` in the background thread where its scheduler runs the model (the
    profiler records one thread, so its loop is wrapped to profile itself there). Returns a DataFrame in seconds, one
    column per engine: the operators' self time grouped by kind, their sum, the serving time (first request queued
    to last done, under the profiler) and what of it no operator accounts for (Python, scheduling, waiting), all
    wall-clock seconds, which a machine busy with other work inflates; then two counts no load changes: the operators
    called and the GFLOP the profiler counted in them (its FLOP formulas cover the matrix products)."""
    import pandas as pd
    from torch.profiler import ProfilerActivity, profile

    from ..bench import peers

    hf = hf_model if hf_model is not None else peers.hf_model_from_kvlib(real)
    from transformers.generation.continuous_batching import continuous_api

    manager = continuous_api.ContinuousBatchingManager
    loop, profiles = manager._run_generation_loop, []

    def profiled_loop(self, *args, **kw):  # the background thread profiles itself
        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
            loop(self, *args, **kw)
        profiles.append(prof)

    kv = lambda: peers.run_kvlib_engine(real, prompts, new_tokens, block_size=block_size,  # noqa: E731
                                        max_batched_tokens=budget)
    cb = lambda: peers.run_hf_continuous(hf, prompts, new_tokens, page_size=block_size,  # noqa: E731
                                         max_batch_tokens=budget)
    if warmup:
        kv(), cb()
    with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        _, kv_stats = kv()
    cols = {"kvlib Engine": (_op_groups(prof), kv_stats["serve_s"])}
    manager._run_generation_loop = profiled_loop
    try:
        with _quiet_native_stderr():
            _, cb_stats = cb()
    finally:
        manager._run_generation_loop = loop
    cols["transformers generate_batch"] = (_op_groups(profiles[-1]), cb_stats["serve_s"])
    out = {}
    for name, (groups, serve_s) in cols.items():
        kinds = [g for g, _ in _GROUPS] + ["other operators"]
        in_ops = sum(groups.get(g, 0.0) for g in kinds)
        out[name] = {**{g: groups.get(g, 0.0) for g in kinds}, "all operators": in_ops,
                     "serving time (profiled)": serve_s,
                     "not in an operator (Python, scheduling, waiting)": serve_s - in_ops,
                     "operators called (count)": groups.get("calls", 0), "GFLOP counted (count)": groups.get("GFLOP", 0.0)}
    return pd.DataFrame(out)


# --------------------------------------------------------------------------------------------
# What each sitting measured
# --------------------------------------------------------------------------------------------


def summary_a(st, co, best_order, best_steps, n_forwards, n_steps, pre, ratio_range, checked, ab):
    """08a's measurements and the conditions each holds under, as one table (``ab``: ``ab_ranges`` of the
    alternating tokens/s runs)."""
    import pandas as pd

    rc, sw = pre["small pool, recompute"], pre["small pool, swap"]
    rows = [
        ("engine steps for the trace: static (arrival order) / continuous", f"{st['steps']} / {co['steps']}",
         "40 requests, same KV memory, B = 8, 128 tokens per step; steps: the same on every machine"),
        ("TTFT p99 in steps: static / continuous", f"{st['ttft_p99']:.0f} / {co['ttft_p99']:.0f}", "the same"),
        ("tokens/s on this machine, min-max: static / continuous",
         f"{ab['static']['tps'][0]:.0f}-{ab['static']['tps'][1]:.0f} / "
         f"{ab['continuous']['tps'][0]:.0f}-{ab['continuous']['tps'][1]:.0f}",
         "tiny model, wall clock of the computing steps, 3 alternating runs each"),
        ("tokens/s, continuous / static, min-max over run pairs", f"{ab['ratio'][0]:.2f}-{ab['ratio'][1]:.2f}",
         "the same; the two runs of a pair back to back"),
        ("best static order, steps", f"{best_order}: {best_steps}", "the same trace, arriving over time"),
        ("forwards / steps that computed anything", f"{n_forwards} / {n_steps}", "one fused forward per step"),
        ("small pool: tokens recomputed (recompute) / MiB copied (swap)",
         f"{rc['recomputed']:,} / {sw['MiB copied (out + in)']}", "a quarter of the pool"),
        ("recompute / swap time per sequence, this machine", f"{ratio_range[0]:.0f}x to {ratio_range[1]:.0f}x",
         "tiny model, n = 16 to 1008; a CPU: one memory"),
        ("outputs token-identical to generate alone", f"{checked}", "every run of this notebook"),
    ]
    return pd.DataFrame(rows, columns=["what", "measured", "under"]).set_index("what")


def summary_b(on, off, ceiling, dev, host, disk, chat_rates, side, checked):
    """08b's measurements and the conditions each holds under, as one table."""
    import pandas as pd

    rows = [
        ("RAG-like load: hit rate (ceiling)", f"{on['hit rate']:.1%} ({ceiling:.1%})", "30 requests, 3 documents, 160 blocks"),
        ("prefill tokens computed: with / without prefix caching",
         f"{on['prefill tokens computed']:,} / {off['prefill tokens computed']:,}", "the same"),
        ("small pool: hit rate device only / + host tier / of which from disk",
         f"{dev['hit rate']:.1%} / {host['hit rate']:.1%} / {disk['hit disk']:.1%}", "20 blocks, 3 running at most"),
        ("SmolLM2 tokens/s: engine / one at a time", f"{chat_rates[0]:.1f} / {chat_rates[1]:.1f}", "5 chats, this machine"),
    ]
    if side is not None:
        k, cb = side.loc["kvlib"], side.loc["generate_batch"]
        cell = lambda r, m: f"{r[m + ' median']:.1f} ({r[m + ' min']:.1f}-{r[m + ' max']:.1f})"  # noqa: E731
        a = side.attrs
        rows += [("serving-only tokens/s, median (min-max): kvlib / generate_batch", f"{cell(k, 'serve')} / {cell(cb, 'serve')}",
                  f"{a['requests']} chats, {a['new_tokens']} tokens, {a['threads']} thread(s), {a['trials']} interleaved "
                  f"trials; ranges that do not overlap: {separated(side, 'serve')}"),
                 ("whole-call tokens/s, median (min-max): kvlib / generate_batch", f"{cell(k, 'whole')} / {cell(cb, 'whole')}",
                  f"the same, setup and teardown included; ranges that do not overlap: {separated(side, 'whole')}")]
    rows.append(("outputs token-identical to generate alone", f"{checked}", "every run of this notebook"))
    return pd.DataFrame(rows, columns=["what", "measured", "under"]).set_index("what")


# --------------------------------------------------------------------------------------------
# Labs 08a and 08b: traces recorded from the real engine, and the measurements the decisions use
# --------------------------------------------------------------------------------------------


def toy_model():
    """A tiny random model (one layer, vocabulary of 32): the scheduler's decisions depend only on token counts and
    blocks, never on what the tokens say. Seeded, without touching the global generator."""
    from ..model import ModelConfig, Transformer

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=2, hidden_dim=64)).eval()


def decisions(fn, trace, args):
    """fn's answer at every step of the trace, each step given a fresh copy of its arguments."""
    import copy

    from .check import CheckFailed

    out = []
    for i, s in enumerate(trace):
        answer = fn(**{k: copy.deepcopy(s[k]) for k in args})
        if answer is None:
            raise CheckFailed(f"{fn.__name__} returned None at trace step {i}: a `return` is missing")
        out.append(list(answer))
    return out


def replay_lines(name, yours, trace, key):
    """How many trace steps agree with the engine, and what the first one that does not saw (trace step i is row i
    of the check's table)."""
    bad = [i for i, s in enumerate(trace) if yours[i] != s[key]]
    lines = [f"{name}: {len(trace) - len(bad)} of {len(trace)} trace steps agree with the engine"]
    if bad:
        s = trace[bad[0]]
        lines.append(f"  first difference, at trace step {bad[0]} (row {bad[0]} of the table below): "
                     + ", ".join(f"{k}={v}" for k, v in s.items() if k != key))
        lines.append(f"  yours {yours[bad[0]]}, the engine {s[key]}")
    return lines


def _cached_now(engine, r):
    """What the prefix cache holds of r's tokens now: register it, read the count, undo."""
    probe = ("probe", r.id)
    n = engine.cache.add_sequence(probe, r.tokens)
    engine.cache.free_sequence(probe)
    return n


def admission_trace(model, seed=8):
    """An engine with 24 blocks of 4 positions and watermark 0.1 serves 30 requests arriving during the first 40
    steps (about half start with the same 8-token "system prompt") and, at step 100, one long request alone. Before
    every step the cached blocks no request holds are dropped, then admit()'s arguments are noted from the engine's
    state, the engine steps, and what it admitted is noted. Returns (trace, engine)."""
    import random

    engine = Engine(model, num_blocks=24, block_size=4, max_num_seqs=16, max_batched_tokens=24, watermark=0.1)
    rng = random.Random(seed)
    system = [rng.randrange(32) for _ in range(8)]
    requests = []
    for arrival in sorted(rng.randrange(40) for _ in range(30)):
        body = [rng.randrange(32) for _ in range(rng.randint(1, 26))]
        requests.append((arrival, system + body if rng.random() < 0.5 else body, rng.randint(2, 14)))
    requests.append((100, [rng.randrange(32) for _ in range(92)], 2))  # alone, it needs 23 of the 24 blocks
    trace = []
    while requests or engine.has_unfinished():
        while requests and requests[0][0] <= engine.clock:
            _, prompt, max_new_tokens = requests.pop(0)
            engine.add_request(prompt, max_new_tokens=max_new_tokens)
        engine.drop_prefix_cache()  # only blocks that running requests hold can be shared
        if not engine.waiting:
            engine.step()
            continue
        step = dict(free_blocks=engine.cache.allocator.num_free, num_blocks=engine.config.num_blocks,
                    watermark=engine.config.watermark, block_size=engine.config.block_size,
                    running_needs=[engine.cache.blocks_needed(r.id, r.pending) for r in engine.running],
                    waiting=[(len(r.tokens), _cached_now(engine, r)) for r in engine.waiting])
        queue = [r.id for r in engine.waiting]
        step["admitted"] = [queue.index(i) for i in engine.step()["admitted"]]
        trace.append(step)
    return trace, engine


def preemption_trace(model, seed=3):
    """16 blocks of 4 positions, no watermark, no prefix cache, 10 requests queued at once that outgrow the pool as
    they decode. The engine's block phase is wrapped to note, in every step where all running requests decode, the
    free blocks and [(id, held, need)] oldest first, and whom the engine preempted. Returns (trace, engine)."""
    import random

    engine = Engine(model, num_blocks=16, block_size=4, max_num_seqs=8, max_batched_tokens=32, watermark=0.0,
                    prefix_caching=False)
    rng = random.Random(seed)
    for _ in range(10):
        engine.add_request([rng.randrange(32) for _ in range(rng.randint(3, 9))], max_new_tokens=rng.randint(10, 30))
    trace, schedule = [], engine._schedule

    def noting(ev):
        if not (engine.running and all(r.pending == 1 for r in engine.running)):
            return schedule(ev)
        step = dict(free_blocks=engine.cache.allocator.num_free,
                    running=[(r.id, len(engine.cache.tables[r.id]), engine.cache.blocks_needed(r.id, 1))
                             for r in engine.running])
        out = schedule(ev)
        step["preempted"] = list(ev["preempted"])
        trace.append(step)
        return out

    engine._schedule = noting
    engine.run()
    return trace, engine


def chunk_case(block_size, seq_len, T, seed):
    """The block table and the reference slots (what PagedKVCache.reserve returns) of a chunk of T tokens after
    seq_len cached ones, on blocks handed out in shuffled order."""
    import random

    from ..paged import PagedKVCache

    num_blocks = -(-(seq_len + T) // block_size) + 3
    cache = PagedKVCache(n_layers=1, num_blocks=num_blocks, block_size=block_size, n_kv_heads=1, head_dim=2,
                         kernels="torch", prefix_caching=False)
    taken = cache.allocator.allocate(num_blocks)
    random.Random(seed).shuffle(taken)
    for b in taken:  # the stack now hands the blocks out in shuffled order
        cache.allocator.free(b)
    cache.add_sequence("s")
    if seq_len:
        cache.reserve(["s"], seq_len)
        cache.lens["s"] += seq_len
    slots = cache.reserve(["s"], T)  # (T,)
    return list(cache.tables["s"]), slots


CHUNK_SHAPES = [(4, 0, 7), (4, 5, 6), (4, 8, 4), (16, 13, 20), (1, 3, 4), (8, 24, 1)]  # (block_size, seq_len, T)


def measured_costs(model, lengths=(16, 64, 128, 256, 512, 1024), threads=1):
    """This machine's costs for the recompute-or-swap decision: the best of three prefills of n tokens (one thread),
    and the copy bandwidth of K/V-sized tensors to host memory (pinned on a GPU). Returns (lengths, seconds,
    bytes per token of K/V in fp32, bytes/s)."""
    from ..memory import kv_cache_bytes

    cfg = model.config
    device = next(model.parameters()).device
    old = torch.get_num_threads()
    torch.set_num_threads(threads)

    def best_of(fn, k):
        best = float("inf")
        for _ in range(k):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    try:
        with torch.no_grad():
            times = [best_of(lambda n=n: model(torch.randint(0, cfg.vocab_size, (1, n), device=device)), 3)
                     for n in lengths]
        per_token = kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads or cfg.n_heads, cfg.head_dim, seq_len=1, batch=1,
                                   dtype=torch.float32)
        blocks = torch.randn(256, 16, per_token // 4, device=device)  # 256 blocks of 16 positions' K/V (fp32)
        host = torch.empty(blocks.shape, pin_memory=device.type == "cuda")
        bandwidth = blocks.numel() * 4 / best_of(lambda: host.copy_(blocks), 5)
    finally:
        torch.set_num_threads(old)
    return list(lengths), times, per_token, bandwidth


def interpolate(lengths, times):
    """A prefill-time function of n, linear between the measured lengths (and from 0 tokens, 0 s)."""
    xs, ys = [0] + list(lengths), [0.0] + list(times)

    def prefill_s(n):
        i = min(max(1, next((j for j, x in enumerate(xs) if x >= n), len(xs) - 1)), len(xs) - 1)
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (n - xs[i - 1]) / (xs[i] - xs[i - 1])
    return prefill_s


def cost_table(lengths, times, per_token, bandwidth):
    """Per measured length: recompute and swap (out and in) times and which was cheaper."""
    import pandas as pd

    swap = [2 * n * per_token / bandwidth for n in lengths]
    return pd.DataFrame({"n tokens": lengths, "recompute ms": [1e3 * t for t in times],
                         "recompute µs per token": [1e6 * t / n for n, t in zip(lengths, times)],
                         "swap out + in ms": [1e3 * s for s in swap],
                         "cheaper": ["swap" if s < t else "recompute" for s, t in zip(swap, times)]}).set_index("n tokens")


def preemption_answer(table) -> str:
    """The mode a server on this machine should use for the lab's preempted requests (all lengths measured): the one
    cheaper at every measured length, or "it depends" when the cheaper one changes with n."""
    kinds = set(table["cheaper"])
    return kinds.pop() if len(kinds) == 1 else "it depends"


def check_preemption_choice(choice, table) -> None:
    """Lab 08a's decision: your preemption mode for this machine against what its measurements say. Prints yours vs
    the reference; a wrong choice fails with the reason for it. Returns nothing."""
    from .check import CheckFailed
    from .mistakes import lab08

    right = preemption_answer(table)
    ok = choice == right
    print(f"preemption mode: yours {choice!r}  this machine's measurements {right!r}  " + ("✓" if ok else "✗"))
    if ok:
        print("PASS ✓")
        return None
    raise CheckFailed(f"FAIL ✗\n  {lab08.preemption_choice(choice, right)}")


def rag_lab_workload():
    """Lab 08b's RAG-like requests on the toy model's vocabulary: 24 requests over 3 documents of 24 tokens."""
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 32, 24).tolist() for _ in range(3)]
    picks = rng.choice(3, 24, p=[0.5, 0.3, 0.2])
    return [dict(arrival=int(2 * i), doc=int(d), prompt=docs[d] + rng.integers(0, 32, int(q)).tolist(), max_new=4)
            for i, (d, q) in enumerate(zip(picks, rng.integers(2, 6, 24)))], docs


HOST_CHOICES = (0, 8, 16, 32, 48, 64)


def host_tier_runs(model, rag, host_choices=HOST_CHOICES):
    """Lab 08b's evidence: the workload on a 10-block pool (4 positions each), at most 2 running, with host tiers of
    each size. Returns a DataFrame: prefill tokens computed, host-tier hits, host blocks used at most."""
    import pandas as pd

    rows = []
    for h in host_choices:
        kw = dict(host_blocks=h) if h else {}
        run = replay(model, rag, num_blocks=10, block_size=4, max_num_seqs=2, max_batched_tokens=16, **kw)
        e = run["engine"]
        rows.append({"host_blocks": h, "prefill tokens computed": prefill_computed(e),
                     "tokens from host": sum(r.cached_tokens_host for r in e.requests.values()),
                     "host blocks used, most": max((ev.get("tiers", {}).get("host_blocks", 0) for ev in e.events),
                                                   default=0)})
    return pd.DataFrame(rows).set_index("host_blocks")


def host_tier_answer(table) -> int:
    """The smallest host tier that computes as little prefill as the largest one."""
    best = table["prefill tokens computed"].min()
    return int(min(h for h, row in table.iterrows() if row["prefill tokens computed"] == best))


def check_host_tier_choice(choice, table) -> None:
    """Lab 08b's decision: the host tier you would configure, against the evidence table. Prints yours vs the
    reference; a wrong choice fails with the reason for it. Returns nothing."""
    from .check import CheckFailed
    from .mistakes import lab08

    right = host_tier_answer(table)
    ok = isinstance(choice, int) and not isinstance(choice, bool) and choice == right
    print(f"host_blocks: yours {choice!r}  reference {right}  " + ("✓" if ok else "✗"))
    if ok:
        print("PASS ✓")
        return None
    raise CheckFailed(f"FAIL ✗\n  {lab08.host_tier_choice(choice, right, table)}")


def prefix_cases(seed=11, n=40, block_size=4):
    """Lab 08b's prompts and a prefix cache to look them up in: a PagedKVCache (toy sizes) that has registered a few
    prompts' full blocks (their sequences freed, the blocks kept as cached). Returns (cache, prompts to look up)."""
    import random

    from ..paged import PagedKVCache

    rng = random.Random(seed)
    cache = PagedKVCache(n_layers=1, num_blocks=64, block_size=block_size, n_kv_heads=1, head_dim=2, kernels="torch",
                         retain_freed=True)  # as the engine keeps them
    stored = [[rng.randrange(32) for _ in range(rng.choice((8, 12, 17, 20)))] for _ in range(4)]
    for k, p in enumerate(stored):  # compute nothing: register the tokens and their blocks, then free
        cache.add_sequence(k, p)
        if len(p) > cache.lens[k]:
            cache.ragged([k], [p[cache.lens[k]:]]).commit()  # as if a forward had written them: full blocks hashed
        cache.free_sequence(k)
    prompts = []
    for _ in range(n):
        base = rng.choice(stored)
        cut = rng.randrange(0, len(base) + 1)
        tail = [rng.randrange(32) for _ in range(rng.randrange(0, 9))]
        p = base[:cut] + tail
        if rng.random() < 0.2 and len(p) > block_size + 1:  # change one token of the first block: a later block matches
            p = [(p[0] + 1) % 32] + p[1:]
        prompts.append(p or [rng.randrange(32)])
    prompts += [list(p) for p in stored]  # each stored prompt again: whole blocks cached, the last token still computed
    return cache, prompts


def reference_cached(cache, prompt) -> int:
    """What the engine's cache serves of ``prompt`` from its device pool (plan_prefix, changes nothing)."""
    return len(cache.plan_prefix(prompt, tiers=False)) * cache.block_size
