"""kvlib.course.ch08: chapter 08's harnesses compute what the notebooks say they compute."""

import math

import numpy as np
import pytest
import torch

from kvlib.course import ch08
from kvlib.generate import generate
from kvlib.memory import spec
from kvlib.model import ModelConfig, Transformer


@pytest.fixture(scope="module")
def model():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(ModelConfig(vocab_size=128, dim=32, n_layers=1, n_heads=2, hidden_dim=64)).eval()


@pytest.fixture(scope="module")
def trace():
    return ch08.make_trace(14, 0.5, seed=2, prompt_median=12, output_median=8)


def alone(model, trace):
    return [generate(model, [r["prompt"]], r["max_new"])[0].tolist() for r in trace]


def test_the_trace_is_seeded_poisson_and_log_normal():
    a, b = ch08.make_trace(40, 0.25, 0), ch08.make_trace(40, 0.25, 0)
    assert a == b and a[0]["arrival"] == 0
    assert all(x["arrival"] <= y["arrival"] for x, y in zip(a, a[1:]))
    assert all(4 <= len(r["prompt"]) <= 320 and 2 <= r["max_new"] <= 160 for r in a)
    off = ch08.make_trace(40, 0.25, 0, all_at_once=True)
    assert {r["arrival"] for r in off} == {0}
    assert [(r["prompt"], r["max_new"]) for r in off] == [(r["prompt"], r["max_new"]) for r in a]  # the same requests
    assert ch08.trace_lines(a, 0.25)[0] == f"40 requests arriving over steps 0..{a[-1]['arrival']} (rate 0.25 per step)"


@pytest.mark.parametrize("order", ch08.ORDERS)
def test_static_batching_gives_generate_s_tokens_and_counts_its_steps(model, trace, order):
    run = ch08.run_static(model, trace, order, batch_size=4, budget=16)
    assert [run["outputs"][i] for i in range(len(trace))] == alone(model, trace)
    grid = run["grid"]
    assert grid.shape == (len(trace), len(run["step_s"]))
    for i, r in enumerate(trace):  # every request decodes exactly max_new - 1 passes after its prefill steps
        assert (grid[i] == ch08.DECODE).sum() == r["max_new"] - 1
        rec = run["recs"][i]
        assert rec["finish"] - rec["first"] == r["max_new"] - 1 and rec["first"] >= r["arrival"]
    # a decode slot is wasted for each pass a finished row still runs: the IDLE cells
    assert run["wasted"] == (grid == ch08.IDLE).sum()


def test_the_engine_replay_and_its_summary(model, trace):
    run = ch08.replay(model, trace, num_blocks=40, block_size=4, max_num_seqs=4, max_batched_tokens=16,
                      prefix_caching=False)
    assert [run["outputs"][i] for i in range(len(trace))] == alone(model, trace)
    s = ch08.summarize(run)
    e = run["engine"]
    assert s["steps"] == len(e.events) and s["tokens_per_step"] == sum(r["max_new"] for r in trace) / len(e.events)
    ttft = [e.metrics(run["ids"][i])["ttft_steps"] for i in range(len(trace))]
    assert s["ttft_p99"] == np.percentile(ttft, 99)  # the summary's TTFT is the engine's own
    static = ch08.summarize(ch08.run_static(model, trace, batch_size=4, budget=16))
    assert s["steps"] < static["steps"]  # continuous batching: fewer steps on this trace


def test_tables_count_what_the_engine_did(model, trace):
    prompt_tokens = sum(len(r["prompt"]) for r in trace)
    kw = dict(num_blocks=20, block_size=4, max_num_seqs=4, max_batched_tokens=16, prefix_caching=False)
    runs = {m: ch08.replay(model, trace, **kw, preemption=m) for m in ("recompute", "swap")}
    t = ch08.preemption_table(runs, prompt_tokens)
    rc, sw = t.loc["recompute"], t.loc["swap"]
    assert rc["preemptions"] > 0 and rc["recomputed"] > 0 and rc["blocks swapped out"] == 0
    assert sw["recomputed"] == 0 and sw["blocks swapped out"] > 0
    block_bytes = 2 * 1 * 4 * model.config.n_kv_heads * model.config.head_dim * 4  # K and V, 1 layer, fp32
    assert sw["MiB copied (out + in)"] == round(2 * sw["blocks swapped out"] * block_bytes / 2**20, 2)
    wm, _ = ch08.watermark_table(model, trace, kw, (0.0, 0.25))
    assert list(wm["blocks kept free"]) == [0, 5]
    budgets, _ = ch08.budget_table(model, trace, kw, (8, 16))
    assert all(budgets["most tokens in a step"] <= budgets.index)


def test_the_check_against_generate_alone_can_fail(model, trace):
    run = ch08.replay(model, trace, num_blocks=40, block_size=4, max_num_seqs=4, max_batched_tokens=16)
    checked, n_runs, bad = ch08.check_alone(model, [({"run": run}, trace)])
    assert (checked, n_runs, bad) == (len(trace), 1, [])
    run["outputs"][3] = run["outputs"][3][:-1] + [run["outputs"][3][-1] + 1]
    assert ch08.check_alone(model, [({"run": run}, trace)])[2] == [("run", 3)]


def test_the_rag_workload_and_its_ceiling():
    rag, docs = ch08.rag_workload(n=30, n_docs=3, doc_len=192)
    assert all(r["prompt"][:192] == docs[r["doc"]] for r in rag)
    prompt = sum(len(r["prompt"]) for r in rag)
    used = len({r["doc"] for r in rag})
    assert ch08.hit_ceiling(rag, 192) == pytest.approx((30 - used) * 192 / prompt)  # all later documents, no question


def test_a_failed_step_moves_nothing(model, trace):
    step, error, unmoved, outputs = ch08.failing_step_demo(model, trace, dict(num_blocks=40, block_size=4,
                                                                              max_num_seqs=4, max_batched_tokens=16),
                                                           fail_at=5)
    assert unmoved and "probability tensor" in error and outputs == alone(model, trace)


@pytest.mark.parametrize("name", ch08.MODELS)
def test_the_crossover_is_where_the_two_costs_meet(name):
    m = spec(name)
    for F, W, _ in ch08.GPUS.values():
        a, b, h, c = costs = ch08.preempt_costs(m, F, W)
        for r in (0.3, 1.0, 3.0, 10.0):
            n = ch08.crossover_at(costs, r)
            if n is None:  # swap is cheaper at every length
                assert all(a * k + b * k * k + h > r * c * k for k in (1, 10, 100, 1000, 10_000, 100_000))
            else:
                assert math.isclose(a * n + b * n * n + h, r * c * n, rel_tol=1e-9)
                assert a * (n / 2) + b * (n / 2) ** 2 + h < r * c * (n / 2)  # below it, recompute is cheaper
    table = ch08.gpu_table()
    assert set(table.index.get_level_values(0)) == set(ch08.MODELS)


def test_the_lab_s_prefix_cases_exercise_every_rule():
    from kvlib.course.mistakes import lab08

    cache, prompts = ch08.prefix_cases()
    ref = [ch08.reference_cached(cache, p) for p in prompts]
    assert ref == [lab08._cached_tokens(p, set(cache.hash_to_block), 4) for p in prompts]  # the rule, as the engine
    assert any(r > 0 for r in ref) and any(r == 0 for r in ref)
    full = [p for p, r in zip(prompts, ref) if len(p) % 4 == 0 and r == len(p) - 4]
    assert full  # prompts whose every block is cached: the last block is computed again


def test_the_host_tier_evidence_has_a_smallest_best_size(model):
    rag, _ = ch08.rag_lab_workload()
    table = ch08.host_tier_runs(ch08.toy_model(), rag)
    best = ch08.host_tier_answer(table)
    least = table["prefill tokens computed"].min()
    assert table.loc[0, "prefill tokens computed"] > least  # a tier saves prefill
    assert best in table.index and best < max(table.index)  # a smaller tier than the largest does as well
    assert all(table.loc[h, "prefill tokens computed"] > least for h in table.index if h < best)


def test_operators_are_grouped_by_kind():
    from torch.profiler import ProfilerActivity, profile

    x, w = torch.randn(64, 32), torch.randn(48, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.nn.functional.linear(x, w)
            torch.softmax(x, -1)
    groups = ch08._op_groups(prof)
    assert groups["matrix products (linear, mm, bmm)"] > 0 and groups["attention (sdpa, softmax)"] > 0


def test_alternating_trials_count_exact_steps_and_pair_their_ratio(model, trace):
    kw = dict(num_blocks=40, block_size=4, max_num_seqs=4, max_batched_tokens=16, prefix_caching=False)
    df = ch08.ab_trials(model, trace, kw, trials=2)
    assert list(df["policy"]) == ["static", "continuous", "continuous", "static"]  # alternating order
    static, cont = ch08.run_static(model, trace), ch08.replay(model, trace, **kw)
    assert set(df[df.policy == "static"]["compute_steps"]) == {sum(1 for s in static["step_s"] if s > 0)}
    assert set(df[df.policy == "continuous"]["compute_steps"]) == {sum(1 for e in cont["engine"].events if e["scheduled"])}
    ab = ch08.ab_ranges(df)
    wide = df.pivot(index="trial", columns="policy", values="tokens_per_s")
    ratios = sorted(wide["continuous"] / wide["static"])
    assert ab["ratio"] == pytest.approx((ratios[0], ratios[-1]))  # a ratio per back-to-back pair, not across pairs
    assert ab["static"]["tps"][0] <= ab["static"]["tps"][1]



def test_alternating_trials_take_a_given_first_pair_and_refuse_a_wrong_one(model, trace):
    kw = dict(num_blocks=40, block_size=4, max_num_seqs=4, max_batched_tokens=16, prefix_caching=False)
    static, cont = ch08.run_static(model, trace), ch08.replay(model, trace, record=True, **kw)
    df = ch08.ab_trials(model, trace, kw, trials=2, first=(static, cont))
    t0 = df[df.trial == 0].set_index("policy")
    assert t0.loc["static", "tokens_per_s"] == ch08.summarize(static)["tokens_per_s"]  # the given runs, not new ones
    assert t0.loc["continuous", "tokens_per_s"] == ch08.summarize(cont)["tokens_per_s"]
    assert list(df["policy"]) == ["static", "continuous", "continuous", "static"]
    assert set(df["compute_steps"][df.policy == "continuous"]) == {sum(1 for e in cont["engine"].events if e["scheduled"])}
    with pytest.raises(ValueError):
        ch08.ab_trials(model, trace, kw, trials=2, first=(cont, static))  # the pair in the wrong order
    with pytest.raises(ValueError):
        ch08.ab_trials(model, trace[:-1], kw, trials=2, first=(static, cont))  # runs of another trace

def _fake_trials(values):
    import pandas as pd

    df = pd.DataFrame([dict(trial=t, engine=e, serve_tokens_per_s=v[t], tokens_per_s=v[t] - 1, ttft_median_s=1.0,
                            identical="8/8" if e != "padded generate" or t else "7/8")
                       for e, v in values.items() for t in range(3)])
    df.attrs.update(threads=1, trials=3, requests=8, new_tokens=16)
    return df


def test_engines_are_ranked_only_where_their_ranges_do_not_overlap():
    r = ch08.trial_ranges(_fake_trials({"kvlib": [20, 22, 21], "generate_batch": [23, 19, 30],
                                        "padded generate": [10, 12, 11]}))
    assert r.loc["kvlib", "serve median"] == 21 and (r.loc["kvlib", "serve min"], r.loc["kvlib", "serve max"]) == (20, 22)
    assert ch08.separated(r, "serve") == "kvlib > padded generate, generate_batch > padded generate"  # 19-30 overlaps 20-22
    assert list(r["identical"]) == ["all", "all", "no"]  # one differing run is enough to say no
    r = ch08.trial_ranges(_fake_trials({"kvlib": [20, 22, 21], "generate_batch": [21, 19, 30], "padded generate": [18, 25, 21]}))
    assert ch08.separated(r, "whole") == "none"
    assert ch08.ranges_line(r, "whole") == ("whole call, min-max over 3 trials: kvlib 19.0-21.0, generate_batch "
                                            "18.0-29.0, padded generate 17.0-24.0; separated: none")
