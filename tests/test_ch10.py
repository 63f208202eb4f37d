"""kvlib.course.ch10: chapter 10's harness (timings paired token by token, trials, attainment, verdicts)."""

import math

import numpy as np
import pandas as pd
import pytest

from kvlib.course import ch10
from kvlib.stats import wilson


def frame(rows):
    """A load.summarize-like frame: rows of (target, trial, out_tok_per_s, ttft_p50, ttft_p90, itl_p50, itl_p90,
    ok, errored, slo_attainment_pct)."""
    cols = ["target", "trial", "out_tok_per_s", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms", "ok",
            "errored", "slo_attainment_pct"]
    df = pd.DataFrame(rows, columns=cols)
    df["load_before"], df["load_after"] = 1.5, 2.5
    return df


OURS = frame([(1, 1, 16.0, 300, 400, 150, 160, 3, 0, 100.0),
              (6, 1, 24.0, 2500, 4000, 300, 340, 10, 0, 30.0), (6, 2, 25.0, 2600, 4100, 310, 350, 10, 0, 20.0),
              (6, 3, 24.5, 2400, 3900, 305, 360, 10, 0, 40.0)])
THEIRS = frame([(1, 1, 15.0, 500, 700, 200, 220, 3, 0, 100.0),
                (6, 1, 18.0, 2450, 5000, 600, 700, 10, 0, 0.0), (6, 2, 19.0, 3000, 5200, 620, 710, 9, 1, 0.0),
                (6, 3, 18.5, 2800, 4800, 590, 690, 10, 0, 10.0)])


def test_attainment_pools_the_trials_with_a_wilson_interval():
    t = ch10.attainment_table({"ours": OURS, "theirs": THEIRS})
    r = t.loc[("ours", 6)]
    assert r["met / sent"] == "9 / 30" and r["attainment % per trial"] == "30 / 20 / 40"
    lo, hi = wilson(9, 30)
    assert math.isclose(r["95% low %"], 100 * lo) and math.isclose(r["95% high %"], 100 * hi)
    assert r[f"target ({ch10.GOAL:.0%} of requests)"] == "breaks"  # the whole interval is under 90%
    assert t.loc[("theirs", 6), "met / sent"] == "1 / 30"  # an errored request is a miss: 10% of 9 ok, of 10 sent
    assert t.loc[("ours", 1), f"target ({ch10.GOAL:.0%} of requests)"] == "cannot tell"  # 3 of 3: too few to promise
    many = frame([(1, k, 16, 1, 1, 1, 1, 20, 0, 100.0) for k in (1, 2, 3)])
    assert ch10.attainment_table({"x": many}).iloc[0][f"target ({ch10.GOAL:.0%} of requests)"] == "holds"
    assert t.loc[("ours", 6), "load avg before-after"] == "1.5-2.5"


def test_a_verdict_only_where_every_trial_beats_every_other():
    t = ch10.ratio_table(OURS, THEIRS)
    ahead = t["ahead"].to_dict()
    assert ahead[(6, "ITL p50 ms")] == "kvlib" and ahead[(6, "output tokens/s")] == "kvlib"
    assert ahead[(6, "TTFT p50 ms")] == "no verdict: overlap"  # 2400-2600 against 2450-3000
    assert ahead[(1, "output tokens/s")] == "no verdict: under 3 trials"  # one trial cannot separate anything
    assert t.loc[(6, "ITL p50 ms"), "ratio, kvlib's favour (min-max)"] == "1.93-2.00"  # 600/300, 620/310, 590/305
    assert ch10.separation([1, 2], [3, 4], lower_is_better=True) == "first"
    assert ch10.separation([1, 2], [3, 4], lower_is_better=False) == "second"
    assert ch10.separation([1, 3], [2, 4], lower_is_better=False) == "overlap"


def test_the_median_interval_holds_the_median():
    x = np.random.default_rng(1).normal(10, 1, 40)
    med, lo, hi = ch10.median_interval(x)
    assert lo <= med <= hi and med == pytest.approx(np.median(x))
    assert ch10.median_interval([5.0] * 10) == (5.0, 5.0, 5.0)


def test_load_trials_numbers_each_rate_s_trials_and_records_the_load(monkeypatch, tmp_path):
    from kvlib.bench import load

    calls = []

    def fake_run(base, model, tok_dir, out_dir=None, rates=None, max_requests=None, **kw):
        calls.append((rates, max_requests))
        return {"_bursts": [] if len(calls) > 1 else [6.0], "benchmarks": []}

    monkeypatch.setattr(load, "run_guidellm", fake_run)
    monkeypatch.setattr(load, "summarize", lambda report: pd.DataFrame({"target": [1.0, 6.0, 6.0, 6.0]}))

    class Server:
        base = "http://127.0.0.1:1"

    _, df, watch = ch10.load_trials(Server(), "m", tmp_path, tmp_path / "x", rates=[1, 6, 6, 6],
                                    requests=[3, 10, 10, 10])
    assert calls == [([1, 6, 6, 6], [3, 10, 10, 10])] * 2  # a run with a burst is run again
    assert df["trial"].tolist() == [1, 1, 2, 3] and df["attempts"].iloc[0] == 2 and watch is None
    assert {"load_before", "load_after"} <= set(df.columns) and df["load_before"].iloc[0] >= 0


def test_step_vs_gap_pairs_each_token_with_its_engine_step():
    pytest.importorskip("fastapi")
    from kvlib.model import load_tiny
    from kvlib.serve import Server

    model, tok = load_tiny()
    with Server(model, tok, "tiny", num_blocks=16, block_size=16, max_num_seqs=2, max_batched_tokens=64) as srv:
        first = srv.engine.clock
        timed = ch10.step_vs_gap(srv, "def f(x):", n_tokens=12, chat=False)
        steps = [ev for ev in srv.engine.events if ev["step"] >= first and ev["emitted"]]
    assert len(timed) == 11 and len(steps) == 12  # the prefill step gives the first token: no gap before it
    assert timed["step_ms"].tolist() == pytest.approx([1000 * ev["wall_s"] for ev in steps[1:]])
    assert (timed["gap_ms"] - timed["step_ms"]).tolist() == pytest.approx(timed["overhead_ms"].tolist())
    assert (timed["gap_ms"] > 0).all()
    table = ch10.time_table(timed, forward=1.0)
    step = table.loc["the engine's step, timed inside the server", "median ms"]
    assert step == pytest.approx(timed["step_ms"].median())
    assert ch10.detok_us(tok, tok.encode("hello, world")) > 0


def test_summary_and_same_answers():
    timed = pd.DataFrame({"step_ms": [10.0, 11.0], "gap_ms": [10.5, 11.2], "overhead_ms": [0.5, 0.2]})
    answer = {"ids": [1, 2, 3], "stamps": [0.2, 0.3]}
    attain = ch10.attainment_table({"ours": OURS})
    s = ch10.summary(answer, timed, 9.0, {"freed_ms": None}, attain, ch10.ratio_table(OURS, THEIRS))
    assert s.loc["blocks back after a client hung up"].iloc[0] == "not within the wait"
    beat = s.loc["metrics where every trial of one server beat every trial of the other"].iloc[0]
    assert beat == "4 of 10"  # at 6 req/s, all but TTFT p50
    report = {"benchmarks": [{"requests": {"successful": [
        {"request_args": '{"body": {"messages": [{"content": "p1"}]}}', "output": "a"},
        {"request_args": '{"body": {"messages": [{"content": [{"text": "p2"}]}]}}', "output": "b"}]}}]}
    other = {"benchmarks": [{"requests": {"successful": [
        {"request_args": '{"body": {"messages": [{"content": "p1"}]}}', "output": "a"},
        {"request_args": '{"body": {"messages": [{"content": "p2"}]}}', "output": "c"}]}}]}
    assert ch10.same_answers(report, other) == (2, 1)


def test_forward_ms_gives_one_value_per_run_and_the_table_their_spread():
    from kvlib.model import load_tiny

    model, tok = load_tiny()
    runs = ch10.forward_ms(model, tok.encode("def f(x):"), n_tokens=4, runs=3)
    assert runs.shape == (3,) and (runs > 0).all()
    timed = pd.DataFrame({"step_ms": [10.0, 11.0], "gap_ms": [10.5, 11.2], "overhead_ms": [0.5, 0.2]})
    row = ch10.time_table(timed, [1.0, 2.0, 9.0]).iloc[0]
    assert row.name.endswith("3 runs") and row["median ms"] == 2.0
    assert row["p10 ms"] == pytest.approx(1.2) and row["p90 ms"] == pytest.approx(7.6)  # not NaN: a spread


def test_big_prompt_measures_the_stream_around_the_refusal():
    pytest.importorskip("fastapi")
    from kvlib.model import load_tiny
    from kvlib.serve import Server

    model, tok = load_tiny()
    with Server(model, tok, "tiny", num_blocks=32, block_size=16, max_num_seqs=2, max_batched_tokens=64) as srv:
        capped = ch10.big_prompt(srv, megabytes=5, before=6, after=6)  # the default 4 MiB cap: a 413
    with Server(model, tok, "tiny", num_blocks=32, block_size=16, max_num_seqs=2, max_batched_tokens=64,
                max_body_bytes=8 * 2**20) as srv:
        read = ch10.big_prompt(srv, megabytes=5, before=6, after=6)  # read, parsed, refused by its byte bound
    assert (capped["status"], capped["code"]) == (413, "request_too_large") and capped["mb"] > 4.5
    assert (read["status"], read["code"]) == (400, "context_length_exceeded")
    for r in (capped, read):
        assert r["overlapping"] >= 1 and r["largest_ms"] > 0 and r["typical_ms"] > 0 and r["answer_ms"] > 0
