"""Chapter 12b's harnesses: moving the cache between workers (disaggregation) and routing by cached prefix.

The notebook keeps what it teaches (the message, the remap, the router's score); what it measures with is here:
- ``disagg_spec`` / ``run_disagg`` / ``colocated_outputs``: a prefill worker and a decode worker as two real
  processes (``kvlib.dist.launch``), against one colocated engine in this process;
- ``transfer_table`` / ``bench_transfer`` (``kvlib.dist.disagg.bench_worker``): bytes and time per transferred block;
- ``itl_spec`` / ``run_itl`` / ``itl_records`` / ``itl_trial_row`` / ``itl_table`` / ``itl_ranges`` / ``verdict`` /
  ``plot_itl``: the inter-token latency of running decodes while long prompts arrive, colocated (two engines, each
  with chunked prefill) vs disaggregated, three trials of each mode interleaved in one launch;
- ``router_runs`` / ``router_table``: the prefix-aware router against round-robin on a RAG-like trace, and with one
  hot document (a replica that fills up, and the load-aware fallback);
- lab 12b: ``remap_case``, ``score_cases``, ``decision_cases`` / ``choose`` / ``check_choice_12b``.

Times are wall-clock ``time.perf_counter()``: on Linux one monotonic clock for every process on the machine, so
a token's time on the decode worker and its arrival on the prefill worker can be subtracted. CPU times are each
worker's ``time.process_time()`` (gloo's receiving thread included).
"""

from __future__ import annotations

import random
import statistics

import torch

from ..dist import disagg, launch, router
from ..engine import Engine

__all__ = ["BLOCK", "ENGINE", "disagg_spec", "run_disagg", "colocated_outputs", "transfer_table", "bench_transfer",
           "itl_spec", "run_itl", "itl_records", "itl_trial_row", "itl_table", "itl_ranges", "verdict", "plot_itl",
           "router_runs", "router_table",
           "remap_case", "remap_lab_case", "score_cases", "measure_costs", "decision_cases", "choose",
           "check_choice_12b", "summary"]

BLOCK = 16
ENGINE = dict(num_blocks=96, block_size=BLOCK, max_num_seqs=8, max_batched_tokens=128)


# --------------------------------------------------------------------------------------------
# 1. Disaggregation: token identity, damage, what a block costs
# --------------------------------------------------------------------------------------------


def disagg_spec(model="tiny", lengths=(40, 17, 64, 33), max_new=8, damage=None, seed=0, vocab=256, engine=None,
                local=(48,)):
    """A spec for ``disagg.disagg_worker``: prompts of the given lengths (random token ids, seeded), then requests of
    the ``local`` lengths that start on the decode worker itself (they hold some of its blocks when transfers land)."""
    rng = random.Random(seed)
    reqs = [dict(prompt=[rng.randrange(vocab) for _ in range(n)], max_new=max_new) for n in lengths]
    reqs += [dict(prompt=[rng.randrange(vocab) for _ in range(n)], max_new=4 * max_new, local=True) for n in local]
    return disagg.check_spec(dict(model=model, requests=reqs, engine=dict(engine or ENGINE), damage=dict(damage or {})))


def run_disagg(spec, timeout_s=120.0):
    """Run the two workers; returns (rank 0's result, rank 1's result)."""
    sent, got = launch.run(disagg.disagg_worker, 2, disagg.check_spec(spec), timeout_s=timeout_s)
    return sent, got


def colocated_outputs(model, spec) -> list:
    """What one engine in this process generates for the spec's requests (the reference)."""
    e = Engine(model, **spec["engine"])
    ids = [e.add_request(r["prompt"], r["max_new"]) for r in spec["requests"]]
    out = e.run()
    return [out[i] for i in ids]


def transfer_table(spec, sent, got, block_bytes):
    """Per request: blocks sent, bytes, how the decode worker got it, why, the two block tables."""
    import pandas as pd

    rows = []
    for i in sorted(sent["sent"]):  # the requests the prefill worker ran
        r, s, g = spec["requests"][i], sent["sent"][i], got["out"][i]
        rows.append({"request": i, "prompt tokens": len(r["prompt"]), "blocks": s["n_blocks"],
                     "K/V bytes sent": s["n_blocks"] * block_bytes if g["why"] != disagg.WHY_FAILED else 0,
                     "injected": spec["damage"].get(i, "-"), "decode worker": g["how"],
                     "prefill table": s["table"], "decode table": g["table"][: s["n_blocks"]]})
    return pd.DataFrame(rows).set_index("request")


def bench_transfer(model="tiny", blocks=(1, 4, 16, 64), repeats=9, timeout_s=120.0):
    """Time sending n blocks (K and V of every layer, stacked in one message as a transfer sends them) from rank 0 to
    rank 1, both ready (a barrier first), the sizes interleaved: the receiver's seconds. Returns a DataFrame by
    n_blocks: bytes, min / median / max ms over the repeats (the spread is the noise), ms per block and MB/s at the
    minimum (the least disturbed repeat)."""
    import pandas as pd

    spec = dict(model=model, blocks=list(blocks), repeats=repeats, block_size=BLOCK)
    _, times = launch.run(disagg.bench_worker, 2, spec, timeout_s=timeout_s)
    rows = []
    for n, (nbytes, secs) in times.items():
        lo = min(secs)
        rows.append({"blocks": n, "bytes": nbytes, "min ms": 1e3 * lo, "median ms": 1e3 * statistics.median(secs),
                     "max ms": 1e3 * max(secs), "ms per block (min)": 1e3 * lo / n, "MB/s (min)": nbytes / lo / 1e6})
    table = pd.DataFrame(rows).set_index("blocks")
    table.attrs["repeats"] = repeats
    return table


# --------------------------------------------------------------------------------------------
# 2. Why engines do it: inter-token latency while long prompts arrive
# --------------------------------------------------------------------------------------------


def itl_spec(mode, n_decode=4, decode_new=64, n_long=4, long_len=384, long_new=4, gap_s=0.06, first_s=0.02,
             budget=128, model="tiny", seed=1, vocab=256):
    """Running decodes (short prompts, many new tokens, from the start) and long prompts arriving every ``gap_s``.

    "colocated": request i runs on rank i % 2, each rank's engine mixes prefill chunks (``budget`` tokens a step)
    with decodes; "disaggregated": the long prompts go to rank 0 (prefill), everything decodes on rank 1. The long
    prompts arrive early and close together, so that they land while the decodes run on an idle machine as on a busy
    one (a busy machine stretches the decodes, not the arrival times)."""
    rng = random.Random(seed)
    reqs = [dict(prompt=[rng.randrange(vocab) for _ in range(16)], max_new=decode_new, local=True, kind="decode")
            for _ in range(n_decode)]
    reqs += [dict(prompt=[rng.randrange(vocab) for _ in range(long_len)], max_new=long_new, kind="long",
                  arrival=first_s + j * gap_s) for j in range(n_long)]
    if mode == "colocated":  # decodes and long prompts alternate ranks: each rank gets half of each kind
        order = sorted(range(len(reqs)), key=lambda i: (reqs[i]["kind"] != "decode", i))
        reqs = [reqs[i] for i in order]
    eng = dict(num_blocks=256, block_size=BLOCK, max_num_seqs=16, max_batched_tokens=budget)
    return disagg.check_spec(dict(model=model, requests=reqs, engine=eng, mode=mode))


def run_itl(orders=(("colocated", "disaggregated"), ("disaggregated", "colocated"), ("colocated", "disaggregated")),
            timeout_s=300.0, **kw):
    """Trials of both modes, interleaved in the given orders (a slow moment of the machine falls on both), in one
    launch (``disagg.itl_trials_worker``: no process start between trials). Returns [(mode, records)] in run order."""
    modes = [m for order in orders for m in order]
    specs = [itl_spec(m, **kw) for m in modes]
    per_rank = launch.run(disagg.itl_trials_worker, 2, dict(trials=specs), timeout_s=timeout_s)
    return [(m, itl_records(sp, [r[t] for r in per_rank])) for t, (m, sp) in enumerate(zip(modes, specs))]


def itl_records(spec, results) -> list[dict]:
    """One record per request: kind, arrival, token times (the first one from the prefill worker when it was
    transferred), tokens."""
    out = {}
    for res in results:
        out.update(res.get("out", {}))
    sent = next((r["sent"] for r in results if "sent" in r), {})
    recs = []
    for i, r in enumerate(spec["requests"]):
        o = out[i]
        times, arrival = list(o["times"]), o.get("arrival")
        if i in sent and o.get("how") == "transfer":
            times, arrival = [sent[i]["first_time"]] + times, sent[i]["arrival"]
        elif i in sent:
            arrival = sent[i]["arrival"]
        recs.append(dict(kind=r["kind"], arrival=arrival, times=times, tokens=list(o["tokens"]), cpu=list(o.get("cpu", [])),
                         step_prefill=list(o.get("step_prefill", [])), received=list(o.get("received", [])),
                         recv_cpu=o.get("recv_cpu")))
    return recs


def _q(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _step_gaps(recs):
    """The running decodes' gaps, one per engine step (decodes that emit in the same step share a gap): a list of
    (wall s, CPU s, prefill tokens in the step, blocks received just before it)."""
    gaps = {}
    for r in recs:
        if r["kind"] == "decode":
            for j in range(1, len(r["times"])):
                t, c = r["times"], r["cpu"]
                gaps[(t[j - 1], t[j])] = (t[j] - t[j - 1], c[j] - c[j - 1], r["step_prefill"][j], r["received"][j])
    return list(gaps.values())


def itl_trial_row(recs) -> dict:
    """One trial: the running decodes' step gaps (how many; CPU median, p90 and worst; wall worst), the shares of gaps
    whose step carried a prefill chunk or followed a receipt (and the worst CPU gap of each kind), the decode worker's
    CPU time per receipt (receive, checksum, hand-over to the engine; the install is in the next step), and the long
    prompts' times (ms, medians): arrival to
    the first token (on the prefill worker when disaggregated), and that first token to the next one (disaggregated:
    the transfer, the admission and a decode step on the decode worker; colocated: one step)."""
    g = _step_gaps(recs)
    longs = [r for r in recs if r["kind"] == "long"]
    return {"step gaps": len(g), "CPU gap median ms": 1e3 * _q([c for _, c, _, _ in g], 0.5),
            "CPU gap p90 ms": 1e3 * _q([c for _, c, _, _ in g], 0.9),
            "CPU gap worst ms": 1e3 * max(c for _, c, _, _ in g), "wall gap worst ms": 1e3 * max(w for w, _, _, _ in g),
            "gaps with prefill in the step": sum(p > 0 for _, _, p, _ in g) / len(g),
            "gaps after a receipt": sum(b > 0 for _, _, _, b in g) / len(g),
            "CPU gap worst with prefill ms": 1e3 * max((c for _, c, p, _ in g if p > 0), default=float("nan")),
            "CPU gap worst after a receipt ms": 1e3 * max((c for _, c, _, b in g if b > 0), default=float("nan")),
            "receipt CPU median ms": 1e3 * _q([r["recv_cpu"] for r in longs if r.get("recv_cpu") is not None], 0.5),
            "long TTFT median ms": 1e3 * _q([r["times"][0] - r["arrival"] for r in longs], 0.5),
            "long first -> next token median ms": 1e3 * _q([r["times"][1] - r["times"][0] for r in longs], 0.5)}


def itl_table(trials):
    """trials: [(mode, records)] -> one row per trial, in run order."""
    import pandas as pd

    rows = [dict(trial=t, mode=m, **itl_trial_row(recs)) for t, (m, recs) in enumerate(trials)]
    return pd.DataFrame(rows).set_index(["trial", "mode"])


def itl_ranges(table, columns=("CPU gap median ms", "CPU gap worst ms", "wall gap worst ms", "long TTFT median ms",
                               "long first -> next token median ms")):
    """Per mode, [lowest, highest] over its trials of each column: {column: {mode: (lo, hi)}}."""
    by = table.groupby(level="mode")
    return {c: {m: (float(by[c].min()[m]), float(by[c].max()[m])) for m in by[c].min().index} for c in columns}


def verdict(ranges: dict, a="colocated", b="disaggregated") -> str:
    """"<mode> higher" when one mode's range lies wholly above the other's, else "not separated"."""
    (alo, ahi), (blo, bhi) = ranges[a], ranges[b]
    return f"{a} higher" if alo > bhi else f"{b} higher" if blo > ahi else "not separated"


def plot_itl(trials):
    """Each running decode's inter-token gaps against time, one panel per mode (its first trial), long-prompt
    arrivals marked."""
    import matplotlib.pyplot as plt

    first = {}
    for mode, recs in trials:
        first.setdefault(mode, recs)
    fig, axes = plt.subplots(1, len(first), figsize=(5.2 * len(first), 3.0), sharey=True)
    for ax, (mode, recs) in zip(axes, first.items()):
        t0 = min(r["arrival"] for r in recs)
        for r in recs:
            if r["kind"] == "decode":
                ts = r["times"]
                ax.plot([b - t0 for b in ts[1:]], [1e3 * (b - a) for a, b in zip(ts, ts[1:])], lw=0.8)
            else:
                ax.axvline(r["arrival"] - t0, color="grey", ls=":", lw=0.8)
        ax.set_title(f"{mode} (its first trial): running decodes", fontsize=10)
        ax.set_xlabel("seconds since start (dotted: a long prompt arrives)")
    axes[0].set_ylabel("inter-token gap, wall (ms)")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------
# 3. The router
# --------------------------------------------------------------------------------------------

ROUTER_ENGINE = dict(num_blocks=30, block_size=BLOCK, max_num_seqs=4, max_batched_tokens=64)


def router_runs(model, trace, policies=(("round-robin", "round_robin", None), ("prefix", "prefix", None),
                                        ("prefix + load cap", "prefix", 4)), **engine_kw) -> dict:
    """{name: router.simulate(...)} for each (name, policy, max_load)."""
    kw = dict(ROUTER_ENGINE, **engine_kw)
    return {name: router.simulate(model, trace, policy, max_load=cap, **kw) for name, policy, cap in policies}


def router_table(runs: dict, trace):
    """Per policy: hit rate, prefill tokens computed, TTFT in steps (median, p90, max), requests per replica."""
    import pandas as pd

    prompt = sum(len(r["prompt"]) for r in trace)
    rows = {}
    for name, out in runs.items():
        ttft = out["ttft"]
        per = out["per_replica"]
        rows[name] = {"hit rate": sum(out["cached"]) / prompt,
                      "prefill computed": sum(p["prefill computed"] for p in per),
                      "TTFT median": _q(ttft, 0.5), "TTFT p90": _q(ttft, 0.9), "TTFT max": max(ttft),
                      "requests per replica": "/".join(str(p["requests"]) for p in per),
                      "fallbacks": out["router"].fallbacks}
    return pd.DataFrame(rows).T


def summary(identical, recovered, wire, ranges, rt, hot):
    """What this sitting measured, and under what, as one table (``wire``: ``bench_transfer``'s table; ``ranges``:
    ``itl_ranges``)."""
    import pandas as pd

    def rng(col):
        r = ranges[col]
        return " / ".join(f"[{r[m][0]:.1f}, {r[m][1]:.1f}]" for m in ("colocated", "disaggregated"))

    n = max(wire.index)
    rows = [("disaggregated tokens identical to one colocated engine", identical, "tiny model and SmolLM2, greedy, fp32"),
            ("damaged / failed transfers recovered by recompute", recovered, "checksum mismatch, failed status"),
            (f"ms per transferred block ({n} blocks in one message)", f"{wire.loc[n, 'ms per block (min)']:.3f}",
             f"gloo over loopback, the least disturbed of {wire.attrs.get('repeats', '?')} repeats, this machine"),
            ("running decodes' worst step gap, process CPU ms: colocated / disaggregated", rng("CPU gap worst ms"),
             f"range over 3 trials each: {verdict(ranges['CPU gap worst ms'])}"),
            ("the same in wall time (ms)", rng("wall gap worst ms"),
             f"range over 3 trials, this machine with its load: {verdict(ranges['wall gap worst ms'])}"),
            ("long prompts, first -> next token median ms: colocated / disaggregated",
             rng("long first -> next token median ms"),
             f"disaggregated: the transfer is in it; {verdict(ranges['long first -> next token median ms'])}"),
            ("prefix hit rate: round-robin / prefix router",
             f"{rt.loc['round-robin', 'hit rate']:.1%} / {rt.loc['prefix', 'hit rate']:.1%}", "RAG-like trace, 2 replicas"),
            ("TTFT median steps on that trace: round-robin / prefix router",
             f"{rt.loc['round-robin', 'TTFT median']} / {rt.loc['prefix', 'TTFT median']}",
             f"requests per replica {rt.loc['prefix', 'requests per replica']} under the prefix router"),
            ("one hot document, TTFT p90 steps: prefix / prefix + load cap",
             f"{hot.loc['prefix', 'TTFT p90']} / {hot.loc['prefix + load cap', 'TTFT p90']}", "the same replicas")]
    return pd.DataFrame(rows, columns=["what", "measured", "under"]).set_index("what")


# --------------------------------------------------------------------------------------------
# The remap, in one process (notebook section 1, lab exercise 1)
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def remap_case(model, prompt_len=40, busy_len=48, num_blocks=16, seed=0):
    """A sender cache that prefilled a prompt, a receiver whose first blocks hold another sequence; the sender's
    blocks installed into the receiver with ``disagg.install_blocks``. Returns the tables, whether the K/V read back
    through the new table equal the sender's, and whether the other sequence's blocks were left untouched."""
    from ..paged import PagedKVCache

    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    prompt = torch.randint(0, V, (prompt_len,), generator=g).tolist()
    busy = torch.randint(0, V, (busy_len,), generator=g).tolist()
    sender = PagedKVCache.for_model(model, num_blocks, BLOCK)
    receiver = PagedKVCache.for_model(model, num_blocks, BLOCK)
    sender.add_sequence("p")
    model(torch.tensor([prompt]), cache=sender.batch(["p"], [prompt]))
    receiver.add_sequence("other")
    model(torch.tensor([busy]), cache=receiver.batch(["other"], [busy]))
    busy_blocks = list(receiver.tables["other"])
    before = [k[busy_blocks].clone() for k in receiver.k]
    sent_table, k, v = disagg.gather_blocks(sender, "p")
    table = disagg.install_blocks(receiver, "p", k, v, prompt)
    idx = torch.tensor(table)
    equal = all(torch.equal(receiver.k[layer][idx], k[layer]) and torch.equal(receiver.v[layer][idx], v[layer])
                for layer in range(k.shape[0]))
    untouched = all(torch.equal(kk[busy_blocks], b) for kk, b in zip(receiver.k, before))
    return dict(table=table, sent_table=sent_table, busy=busy_blocks, equal=equal, untouched=untouched)


# --------------------------------------------------------------------------------------------
# Lab 12b: the cases the exercises check on
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def remap_lab_case(model, prompt_len=40, num_blocks=12, seed=0):
    """Exercise 1's inputs: a sender's blocks as received (k, v: (n_layers, n_blocks, block_size, H_KV, D)), the
    sender's table, and a receiver's pools (n_layers, num_blocks, block_size, H_KV, D) that already hold other
    sequences' K/V, with its free list in the order its allocator hands blocks out."""
    from ..paged import PagedKVCache

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=g).tolist()
    sender = PagedKVCache.for_model(model, num_blocks, BLOCK)
    sender.add_sequence("other")
    sender.reserve(["other"], 2 * BLOCK)  # the sender's first blocks are taken, so its ids are not 0, 1, 2
    sender.add_sequence("p")
    model(torch.tensor([prompt]), cache=sender.batch(["p"], [prompt]))
    sent_table, k, v = disagg.gather_blocks(sender, "p")
    c = model.config
    shape = (c.n_layers, num_blocks, BLOCK, c.n_kv_heads, c.head_dim)
    pool_k, pool_v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)  # other sequences' K/V
    busy = {2, 3, 5, 8}
    free = [b for b in range(num_blocks) if b not in busy][::-1]  # the order the allocator hands them out
    return k, v, sent_table, pool_k, pool_v, free


def score_cases(model, seed=0):
    """Exercise 2's cases: [(a prompt's chained block hashes, a replica's held hashes)], from a real router run
    (the router's index after a RAG-like trace) and the same index after one random block, or the first and the
    third, of the prompt were reported removed."""
    trace = router.rag_trace(n_requests=16, n_docs=4, doc_len=80, question_len=8, max_new=2, seed=seed)
    out = router.simulate(model, trace, "prefix", **dict(ROUTER_ENGINE, num_blocks=24))
    r = out["router"]
    rng = random.Random(seed)
    cases = []
    for k, held in enumerate(r.index):
        for t in trace[::2]:
            hs = r.hashes(t["prompt"])
            cases.append((hs, set(held)))
            if len(hs) > 2 and hs[0] in held:  # the same index after BlockRemoved events for blocks of this prompt
                cases.append((hs, set(held) - {hs[rng.randrange(len(hs))]}))
                cases.append((hs, set(held) - {hs[0], hs[2]}))
    return cases


@torch.no_grad()
def measure_costs(model, long_len=512, n_decode=4, budget=128, repeats=3):
    """Exercise 3's measured costs, in this process (CPU seconds of this thread, ``time.thread_time``, which a busy
    machine does not stretch; medians of ``repeats``): a decode-only step of
    ``n_decode`` requests, the same step with a ``budget``-token prefill chunk in it, a prefill-only chunk step, and
    the local part of a transfer of a ``long_len`` prompt (gather, checksum, install; no wire)."""
    import time

    def steps(with_prefill, with_decode):
        e = Engine(model, num_blocks=128, block_size=BLOCK, max_num_seqs=16, max_batched_tokens=budget)
        for _ in range(n_decode if with_decode else 0):
            e.add_request(list(range(16)), 64)
        for _ in range(2 if with_decode else 0):
            e.step()
        if with_prefill:
            e.add_request([i % model.config.vocab_size for i in range(long_len)], 4)
        t = time.thread_time()
        e.step()
        return time.thread_time() - t

    med = lambda f: statistics.median(f() for _ in range(repeats))  # noqa: E731
    chunks = -(-long_len // budget)
    c = dict(decode_step=med(lambda: steps(False, True)), mixed_step=med(lambda: steps(True, True)),
             prefill_step=med(lambda: steps(True, False)), chunks=chunks)

    def local_transfer():
        from ..paged import PagedKVCache

        a, b = PagedKVCache.for_model(model, 64, BLOCK), PagedKVCache.for_model(model, 64, BLOCK)
        a.add_sequence("s")
        a.reserve(["s"], long_len)
        t = time.thread_time()
        table, k, v = disagg.gather_blocks(a, "s")
        disagg.checksum(k, v)
        disagg.install_blocks(b, "s", k, v, list(range(long_len)))
        return time.thread_time() - t

    c["transfer"] = med(local_transfer)
    return c


def decision_cases(costs) -> dict:
    """Exercise 3's cases: the costs as (TTFT, worst ITL) per mode, and targets placed between the measured values,
    so that each case's answer is the same on every machine. Disaggregated: (prefill, decode step + receipt,
    transfer); its TTFT is prefill + transfer (the notebook's "TTFT" and "first -> next token" columns together)."""
    co = (costs["chunks"] * costs["mixed_step"], costs["mixed_step"])
    # disaggregated: the worst gap is a decode step with a receipt before it (this decode worker stops to receive);
    # the TTFT the client sees when the answer streams from the decode worker is the prefill, then the transfer
    di = (costs["chunks"] * costs["prefill_step"], costs["decode_step"] + costs["transfer"], costs["transfer"])
    if not di[1] < co[1]:
        raise ValueError(f"a decode step with a receipt ({di[1]:.4f} s) should be shorter than a step with a prefill "
                         f"chunk ({co[1]:.4f} s): measure the costs again on a quieter machine")
    itl_mid = (di[1] * co[1]) ** 0.5  # between the two kinds of worst gap
    roomy = 2 * max(co[0], di[0] + di[2])
    tight_ttft = di[0] + di[2] / 2  # the prefill fits, the transfer does not
    base = dict(colocated=co, disaggregated=di)
    return {"loose targets": dict(base, ttft_target=roomy, itl_target=2 * co[1]),
            "tight per-token target": dict(base, ttft_target=roomy, itl_target=itl_mid),
            "tight per-token target, TTFT without room for the transfer": dict(base, ttft_target=tight_ttft,
                                                                                 itl_target=itl_mid),
            "per-token target below a decode step": dict(base, ttft_target=roomy, itl_target=costs["decode_step"] / 2)}


def choose(case) -> str:
    """The chapter's rule: colocate when colocating meets both targets (no second pool, no transfer, no throughput
    lost); else disaggregate when that meets both; else neither (more hardware, or other targets)."""
    from .mistakes import lab12b

    return lab12b._choose(case)


def check_choice_12b(yours, cases) -> bool:
    """Exercise 3's checker: ``yours`` is a function case -> "colocate" | "disaggregate" | "neither"."""
    from .check import check_choice
    from .mistakes import lab12b

    mine = tuple(yours(c) for c in cases.values())
    ref = lab12b.choice_answers(cases)
    if any(a not in lab12b.CHOICES for a in mine):
        raise ValueError(f"each answer must be one of {lab12b.CHOICES}, got {mine}")

    def why():
        found = [what for what, wrong in lab12b.choice_rules(cases).items() if wrong == mine]
        lines = [f"{name}: yours {a}, reference {b}" for name, a, b in zip(cases, mine, ref) if a != b]
        return lines + ([f"Diagnosis: yours matches a known mistake: {w}" for w in found] or
                        ["Hint: for each mode, does the TTFT (with everything the first token waits for) meet its "
                         "target, and does the worst gap meet the per-token one?"])

    return check_choice("answers, case by case", mine, ref, why, shown=(", ".join(mine), ", ".join(ref)))
