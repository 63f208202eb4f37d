"""Chapter 12b's harnesses: moving the cache between workers (disaggregation) and routing by cached prefix.

The notebook keeps what it teaches (the message, the remap, the router's score); what it measures with is here:
- ``disagg_spec`` / ``run_disagg`` / ``colocated_outputs``: a prefill worker and a decode worker as two real
  processes (``kvlib.dist.launch``), against one colocated engine in this process;
- ``transfer_table`` / ``bench_transfer`` (``kvlib.dist.disagg.bench_worker``): bytes and time per transferred block;
- ``itl_spec`` / ``run_itl`` / ``itl_records`` / ``itl_table`` / ``plot_itl`` / ``goodput``: the inter-token latency of
  running decodes while long prompts arrive, colocated (two engines, each with chunked prefill) vs disaggregated;
- ``router_runs`` / ``router_table``: the prefix-aware router against round-robin on a RAG-like trace, and with one
  hot document (a replica that fills up, and the load-aware fallback);
- lab 12b: ``remap_case``, ``score_cases``, ``decision_cases`` / ``choose`` / ``check_choice_12b``.

Times are wall-clock ``time.perf_counter()``: on Linux one monotonic clock for every process on the machine, so
a token's time on the decode worker and its arrival on the prefill worker can be subtracted.
"""

from __future__ import annotations

import random
import statistics

import torch

from ..dist import disagg, launch, router
from ..engine import Engine

__all__ = ["BLOCK", "ENGINE", "disagg_spec", "run_disagg", "colocated_outputs", "transfer_table", "bench_transfer",
           "itl_spec", "run_itl", "itl_records", "itl_table", "plot_itl", "goodput", "router_runs", "router_table",
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


def bench_transfer(model="tiny", blocks=(1, 4, 16, 64), repeats=5, timeout_s=120.0):
    """Time sending n blocks (K and V of every layer) from rank 0 to rank 1, both ready (a barrier first): the
    receiver's median seconds. Returns a DataFrame by n_blocks: bytes, median ms, ms per block, MB/s."""
    import pandas as pd

    spec = dict(model=model, blocks=list(blocks), repeats=repeats, block_size=BLOCK)
    _, times = launch.run(disagg.bench_worker, 2, spec, timeout_s=timeout_s)
    rows = []
    for n, (nbytes, secs) in times.items():
        med = statistics.median(secs)
        rows.append({"blocks": n, "bytes": nbytes, "median ms": 1e3 * med, "ms per block": 1e3 * med / n,
                     "MB/s": nbytes / med / 1e6})
    return pd.DataFrame(rows).set_index("blocks")


# --------------------------------------------------------------------------------------------
# 2. Why engines do it: inter-token latency while long prompts arrive
# --------------------------------------------------------------------------------------------


def itl_spec(mode, n_decode=4, decode_new=48, n_long=4, long_len=384, long_new=4, gap_s=0.25, first_s=0.1,
             budget=128, model="tiny", seed=1, vocab=256):
    """Running decodes (short prompts, many new tokens, from the start) and long prompts arriving every ``gap_s``.

    "colocated": request i runs on rank i % 2, each rank's engine mixes prefill chunks (``budget`` tokens a step)
    with decodes; "disaggregated": the long prompts go to rank 0 (prefill), everything decodes on rank 1."""
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


def run_itl(mode, timeout_s=180.0, **kw):
    spec = itl_spec(mode, **kw)
    return spec, launch.run(disagg.itl_worker, 2, spec, timeout_s=timeout_s)


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
                         step_prefill=list(o.get("step_prefill", [])), received=list(o.get("received", []))))
    return recs


def _q(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def itl_table(runs: dict):
    """runs: {mode: records}. Per mode: the running decodes' inter-token gaps (ms: median, p90, p99, max) in wall
    time and in the worker's CPU time between the two tokens (what an idle core would take: a busy machine stretches
    wall time, not CPU time), the long prompts' TTFT (wall ms: median, max), and output tokens per second."""
    import pandas as pd

    rows = {}
    for mode, recs in runs.items():
        dec = [r for r in recs if r["kind"] == "decode"]
        gaps = [b - a for r in dec for a, b in zip(r["times"], r["times"][1:])]
        cpu = [b - a for r in dec for a, b in zip(r["cpu"], r["cpu"][1:])]
        ttft = [r["times"][0] - r["arrival"] for r in recs if r["kind"] == "long"]
        t0, t1 = min(r["arrival"] for r in recs), max(r["times"][-1] for r in recs)
        rows[mode] = {"ITL median ms": 1e3 * _q(gaps, 0.5), "ITL p90 ms": 1e3 * _q(gaps, 0.9),
                      "ITL p99 ms": 1e3 * _q(gaps, 0.99), "ITL max ms": 1e3 * max(gaps),
                      "CPU gap median ms": 1e3 * _q(cpu, 0.5), "CPU gap p90 ms": 1e3 * _q(cpu, 0.9),
                      "CPU gap p99 ms": 1e3 * _q(cpu, 0.99),
                      "gaps with prefill in the step": sum(p > 0 for r in dec for p in r["step_prefill"][1:]) / len(cpu),
                      "gaps with blocks received": sum(b > 0 for r in dec for b in r["received"][1:]) / len(cpu),
                      "long TTFT median ms": 1e3 * _q(ttft, 0.5), "long TTFT max ms": 1e3 * max(ttft),
                      "tokens/s": sum(len(r["tokens"]) for r in recs) / (t1 - t0)}
    return pd.DataFrame(rows).T


def plot_itl(runs: dict):
    """Each running decode's inter-token gaps against time, one panel per mode, long-prompt arrivals marked."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 3.0), sharey=True)
    for ax, (mode, recs) in zip(axes, runs.items()):
        t0 = min(r["arrival"] for r in recs)
        for r in recs:
            if r["kind"] == "decode":
                ts = r["times"]
                ax.plot([b - t0 for b in ts[1:]], [1e3 * (b - a) for a, b in zip(ts, ts[1:])], lw=0.8)
            else:
                ax.axvline(r["arrival"] - t0, color="grey", ls=":", lw=0.8)
        ax.set_title(f"{mode}: running decodes", fontsize=10)
        ax.set_xlabel("seconds since start (dotted: a long prompt arrives)")
    axes[0].set_ylabel("inter-token gap (ms)")
    fig.tight_layout()
    return fig


def goodput(recs, ttft_slo_s, itl_slo_s) -> float:
    """Requests per second that met both targets: TTFT <= ttft_slo_s and every inter-token gap <= itl_slo_s
    (DistServe's goodput, with the worst gap standing for the per-token target)."""
    t0, t1 = min(r["arrival"] for r in recs), max(r["times"][-1] for r in recs)
    ok = sum(1 for r in recs if r["times"][0] - r["arrival"] <= ttft_slo_s
             and all(b - a <= itl_slo_s for a, b in zip(r["times"], r["times"][1:])))
    return ok / (t1 - t0)


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


def summary(identical, recovered, per_block, itl, rt, hot):
    """What this sitting measured, and under what, as one table."""
    import pandas as pd

    rows = [("disaggregated tokens identical to one colocated engine", identical, "tiny model and SmolLM2, greedy, fp32"),
            ("damaged / failed transfers recovered by recompute", recovered, "checksum mismatch, failed status"),
            ("ms per transferred block (64 blocks at once)", f"{per_block:.3f}", "gloo over loopback, this machine"),
            ("running decodes' gap p99 ms, CPU time: colocated / disaggregated",
             f"{itl.loc['colocated', 'CPU gap p99 ms']:.1f} / {itl.loc['disaggregated', 'CPU gap p99 ms']:.1f}",
             "2 single-thread processes, tiny model"),
            ("the same in wall time (ITL p99 ms)",
             f"{itl.loc['colocated', 'ITL p99 ms']:.1f} / {itl.loc['disaggregated', 'ITL p99 ms']:.1f}",
             "this machine, with whatever else it ran"),
            ("tokens/s: colocated / disaggregated",
             f"{itl.loc['colocated', 'tokens/s']:.0f} / {itl.loc['disaggregated', 'tokens/s']:.0f}",
             "the same run, below saturation: not a throughput verdict"),
            ("prefix hit rate: round-robin / prefix router",
             f"{rt.loc['round-robin', 'hit rate']:.1%} / {rt.loc['prefix', 'hit rate']:.1%}", "RAG-like trace, 2 replicas"),
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
    """Exercise 3's measured costs, in this process (seconds, medians of ``repeats``): a decode-only step of
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
        t = time.perf_counter()
        e.step()
        return time.perf_counter() - t

    med = lambda f: statistics.median(f() for _ in range(repeats))  # noqa: E731
    chunks = -(-long_len // budget)
    c = dict(decode_step=med(lambda: steps(False, True)), mixed_step=med(lambda: steps(True, True)),
             prefill_step=med(lambda: steps(True, False)), chunks=chunks)

    def local_transfer():
        from ..paged import PagedKVCache

        a, b = PagedKVCache.for_model(model, 64, BLOCK), PagedKVCache.for_model(model, 64, BLOCK)
        a.add_sequence("s")
        a.reserve(["s"], long_len)
        t = time.perf_counter()
        table, k, v = disagg.gather_blocks(a, "s")
        disagg.checksum(k, v)
        disagg.install_blocks(b, "s", k, v, list(range(long_len)))
        return time.perf_counter() - t

    c["transfer"] = med(local_transfer)
    return c


def decision_cases(costs) -> dict:
    """Exercise 3's cases: the costs as (TTFT, worst ITL) per mode, and targets placed between the measured values,
    so that each case's answer is the same on every machine."""
    co = (costs["chunks"] * costs["mixed_step"], costs["mixed_step"])
    di = (costs["chunks"] * costs["prefill_step"], costs["decode_step"], costs["transfer"])
    itl_mid = (costs["decode_step"] * costs["mixed_step"]) ** 0.5  # between the two kinds of step
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
