"""The benchmark harness: the CLI's quick run, result files, curves, references, the headline table,
and how the loop handles out-of-memory, a spent time budget and a kernel that disagrees."""

import json
import os
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from kvlib import runtime
from kvlib.bench import results, sweeps

GPU = runtime.mode() == "gpu"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``python -m kvlib.bench --quick --smoke`` in a fresh process, as a learner runs ``--quick`` but with
    one point per sweep (the same code paths, every sweep, plot and file; the notebooks run the quick sizes)."""
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, "-m", "kvlib.bench", "--quick", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


@pytest.mark.bench_cli
def test_quick_run_writes_every_sweep_with_stamp_and_plots(quick_run):
    out, proc = quick_run
    rows = results.read_csv(out / "results.csv")
    assert {r["sweep"] for r in rows} == set(sweeps.SWEEPS)
    for r in rows:
        assert r["device"] and r["torch"] and r["date"] and r["mode"], r
        assert not str(r["status"]).startswith("MISMATCH"), r
    for name in sweeps.SWEEPS:
        assert (out / f"{name}.png").stat().st_size > 10_000, name
    st = json.loads((out / "stamp.json").read_text())
    assert st["copy_bandwidth_gbps"] > 0 and st["quick"] is True and st["smoke"] is True
    if not GPU:
        assert "No headline points" in (out / "summary.md").read_text()  # they need a GPU
    assert "rows in" in proc.stdout


@pytest.mark.bench_cli
def test_quick_run_checks_every_triton_kernel_against_its_baseline(quick_run):
    out, _ = quick_run
    rows = results.read_csv(out / "results.csv")
    # CPU: each kernel runs once in the interpreter; GPU: compiled, checked and timed
    checked = {r["kernel"] for r in rows if r["max_abs_err"] is not None
               and r["status"] == ("ok" if GPU else "correctness only (interpreter)")}
    for kernel in ("triton add", "flash_attention", "decode (split-K auto)", "paged block 1",
                   "paged block 16", "paged block 128", "int8 decode (fused dequant)", "grouped decode",
                   "store_kv", "store_paged (block 16)", "store_kv_int8", "index decode, all S",
                   "KIVI 2-bit decode", "ragged, decodes + chunk") + (() if GPU else (
                       "decode (4 splits)", "ragged, decodes only", "paged decode (decodes only)",
                       "paged decode + flash (2 calls)")):  # GPU smoke: a mixed step, its separate calls the baseline
        assert kernel in checked, kernel


@pytest.mark.bench_cli
def test_quick_run_times_the_pytorch_paths_and_fills_the_derived_columns(quick_run):
    out, _ = quick_run
    rows = results.read_csv(out / "results.csv")
    timed = [r for r in rows if r["time_ms"] is not None]
    assert {r["sweep"] for r in timed} >= {"copy", "prefill", "decode", "paged", "int8", "grouped", "store"}
    for r in timed:
        assert r["time_ms"] > 0 and r["gbps"] == pytest.approx(r["bytes_moved"] / r["time_ms"] / 1e6, rel=1e-3)
        if r["baseline"]:
            assert r["vs_baseline"] > 0
    mem = [r for r in rows if r["sweep"] == "memory"]
    # CPU: the tensors' bytes, exactly; GPU: the allocator rounds up (and the cache has a lengths tensor)
    assert mem and all(0 <= r["memory_bytes"] - r["predicted_bytes"] <= (4096 if GPU else 0) for r in mem)


def test_csv_round_trip_and_curves(tmp_path):
    rows = [{"sweep": "decode", "kernel": "a", "B": 1, "S": s, "time_ms": 1.5 * s, "headline": 0, "status": "ok"}
            for s in (4, 1, 2)] + [{"sweep": "decode", "kernel": "b", "B": 1, "S": 1, "time_ms": None}]
    back = results.read_csv(results.write_csv(rows, tmp_path / "r.csv"))
    assert back[0]["S"] == 4 and back[0]["time_ms"] == 6.0 and back[3]["time_ms"] is None
    assert results.curves(back, x="S", y="time_ms") == {"a": ([1, 2, 4], [1.5, 3.0, 6.0])}
    assert results.curves(back, x="S", y="time_ms", series=("kernel", "B")) == {"a B=1": ([1, 2, 4], [1.5, 3.0, 6.0])}


def test_reference_reads_committed_gpu_results_only(tmp_path):
    stamp = {"device": "NVIDIA Test GPU", "mode": "gpu", "driver": "1.2", "torch": "2.x", "triton": "3.x",
             "date": "2026-01-02T00:00:00Z"}
    results.write_csv([{**stamp, "sweep": "decode", "kernel": "k", "S": 1, "time_ms": 1.0}],
                      tmp_path / "test-gpu" / "results.csv")
    results.write_csv([{**stamp, "mode": "interpreter", "sweep": "prefill", "kernel": "k", "S": 1}],
                      tmp_path / "cpu" / "results.csv")
    label, rows = results.reference("decode", root=tmp_path)
    assert "NVIDIA Test GPU" in label and "2026-01-02" in label and len(rows) == 1
    assert results.reference("prefill", root=tmp_path) == (None, [])  # CPU rows are never a reference
    assert results.reference("decode", root=tmp_path / "missing") == (None, [])


def test_headline_table_says_met_and_by_how_much_it_is_missed():
    base = {"sweep": "decode", "kernel": "decode (split-K auto)", "headline": 1, "time_ms": 1.0, "baseline": "SDPA",
            "H": 32, "H_KV": 8}
    rows = [{**base, "pct_copy_bw": 80.0, "vs_baseline": 1.1}, {**base, "pct_copy_bw": 60.0, "vs_baseline": 0.9},
            {**base, "pct_copy_bw": 70.0, "vs_baseline": 1.0}, {**base, "pct_copy_bw": 99.0, "headline": 0},
            {"sweep": "int8", "kernel": "int8 decode (fused dequant)", "headline": 1, "time_ms": 1.0,
             "vs_baseline": 1.7, "pct_copy_bw": 50.0, "baseline": "float16 decode"}]
    table = {t["kernel"]: t for t in results.headline_table(rows)}
    assert "decode (split-K auto), 32/32 heads" not in table  # no rows for that workload
    dec = table["decode (split-K auto), 32/8 heads"]
    assert dec["points"] == 3 and dec["pct_copy_bw"] == (70.0, 60.0, 80.0) and dec["met"] is False
    assert dec["shortfall"] == pytest.approx(-5.0)
    assert table["int8 decode (fused dequant)"]["met"] is True
    md = results.headline_markdown(rows)
    assert "**no**: 5.0 points short" in md and "| yes |" in md
    assert "No headline points" in results.headline_markdown([])


def _fake_sweep(points):
    return lambda ctx: iter(points)


def _point(S, build, curve=("c",)):
    return sweeps.Point("fake", {"S": S, "dtype": "float32"}, build, curve=curve)


def test_out_of_memory_ends_that_curve_and_the_sweep_goes_on(monkeypatch):
    def ok():
        x = torch.ones(4)
        return {"base": sweeps.Kernel(lambda: x + 1, False, 32)}

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")

    pts = [_point(1, ok), _point(2, oom), _point(4, ok), _point(1, ok, curve=("other",))]
    monkeypatch.setitem(sweeps.SWEEPS, "fake", _fake_sweep(pts))
    rows = sweeps.run(["fake"], quick=True, progress=False)
    assert [(r["S"], r["status"]) for r in rows] == [(1, "ok"), (2, "out of memory (curve ends)"), (1, "ok")]


def test_a_spent_time_budget_skips_points_and_says_so(monkeypatch):
    pts = [_point(1, lambda: {"base": sweeps.Kernel(lambda: torch.ones(2), False, 8)})]
    monkeypatch.setitem(sweeps.SWEEPS, "fake", _fake_sweep(pts))
    rows = sweeps.run(["fake"], quick=True, budget_s=-1, progress=False)
    assert rows[0]["status"] == "skipped: time budget spent" and rows[0].get("time_ms") is None


def test_a_kernel_that_disagrees_is_a_mismatch_and_fails_the_cli(monkeypatch, tmp_path):
    x = torch.arange(8.0)
    pts = [_point(8, lambda: {"base": sweeps.Kernel(lambda: x * 2, False, 64),
                              "wrong": sweeps.Kernel(lambda: x * 2 + 0.5, False, 64)})]
    monkeypatch.setitem(sweeps.SWEEPS, "fake", _fake_sweep(pts))
    rows = sweeps.run(["fake"], quick=True, progress=False)
    assert rows[0]["status"] == "ok" and rows[1]["status"].startswith("MISMATCH")
    assert rows[1]["max_abs_err"] == 0.5 and rows[1]["vs_baseline"] > 0

    from kvlib.bench.__main__ import main

    assert main(["--only", "fake", "--out", str(tmp_path), "--quick", "--no-plots"]) == 1
    assert "MISMATCH" in (tmp_path / "results.csv").read_text()
    with pytest.raises(SystemExit):  # argparse only accepts the real sweeps
        main(["--only", "nope", "--out", str(tmp_path)])


def test_unknown_sweep_names_are_a_clear_error():
    with pytest.raises(ValueError, match="unknown sweep"):
        sweeps.run(["decod"], progress=False)


TINY = {
    "copy": {"mib": [1]},
    "decode": {"heads": [(4, 2, 32), (2, 2, 32)], "batch": [2], "ctx": [128, 256]},
    "paged": {"heads": [(4, 2, 32)], "batch": [2], "ctx": [256]},
    "int8": {"heads": [(4, 2, 32)], "batch": [2], "ctx": [128]},
    "keepless": {"heads": [(4, 2, 32)], "batch": [2], "ctx": [128]},
    "grouped": {"heads": [(8, 2, 32)], "batch": [2], "ctx": [128]},
    "store": {"tokens": [40]},
    "prefill": {"heads": [(4, 2, 32), (2, 2, 32)], "batch": [1], "ctx": [48]},
    "memory": {"ctx": [128]},
    "engine": {"loads": [2], "requests": 1, "prompt": (5, 8), "output": (2, 3), "max_num_seqs": 2,
               "max_batched_tokens": 8, "block_size": 4, "num_blocks": 4},  # Triton in the interpreter: keep it tiny
    "ragged": {"heads": [(4, 2, 32)], "decodes": [2], "chunk": [20, 0], "ctx": [40]},
    "sparse": {"heads": [(4, 2, 32)], "batch": [2], "ctx": [120], "budgets": [32, 48]},  # 120: a partly filled block
}
ENGINE_TINY = {"loads": [0.5, 4], "requests": 4, "prompt": (8, 16), "output": (3, 6), "max_num_seqs": 2,
               "max_batched_tokens": 8, "block_size": 4, "num_blocks": 6}  # the CPU branch (PyTorch paths)


@pytest.mark.skipif(GPU, reason="the real GPU run covers these branches")
def test_the_gpu_branches_of_every_sweep_run_at_tiny_sizes(monkeypatch):
    """Walk each sweep's GPU-mode code (kernel lists, names, bytes, baselines, checks) on the CPU with
    tiny shapes, so a GPU session does not find a typo in a branch CI never ran."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    ctx = sweeps.Ctx(quick=True)
    ctx.gpu, ctx.sizes, ctx.dtype = True, TINY, torch.float32
    ctx.time_kw = {"warmup": 0, "rep": 1}  # the interpreter's time means nothing: one timed call per kernel
    rows = sweeps.run(quick=True, progress=False, ctx=ctx)
    bad = [r for r in rows if r.get("status") != "ok"]
    assert not bad, bad
    kernels = {(r["sweep"], r["kernel"]) for r in rows}
    for sweep, kernel, *_ in results.TARGETS:  # every kernel named in the headline table is produced
        assert (sweep, kernel) in kernels, (sweep, kernel)
    for r in rows:
        if r["sweep"] not in ("memory", "engine"):  # engine rows: tokens/s of a whole trace (tested below)
            assert r["time_ms"] > 0 and r["bytes_moved"] > 0, r
            assert (r.get("baseline") is None) == (r.get("vs_baseline") is None), r
            # add is not a copy; selecting blocks computes indices, not attention
            compared = r.get("baseline") is not None and r["kernel"] != "torch add" and not r["kernel"].startswith(
                "select ")
            assert not compared or r.get("max_abs_err") is not None, r
    assert {r["kernel"] for r in rows if r["sweep"] == "int8"} == {
        "float32 decode", "int8 decode (fused dequant)", "dequantize, then fp16 decode"}
    engine = [r for r in rows if r["sweep"] == "engine"]
    assert len(engine) == 2 * len(TINY["engine"]["loads"]) and all(r["tokens_per_s"] > 0 for r in engine)


def test_update_readme_replaces_only_the_headline_section(tmp_path):
    from kvlib.bench.__main__ import END, START, main

    rows = [{"sweep": "int8", "kernel": "int8 decode (fused dequant)", "headline": 1, "time_ms": 1.0, "B": 8,
             "S": 4096, "vs_baseline": 1.7, "pct_copy_bw": 50.0, "baseline": "float16 decode", "mode": "gpu",
             "device": "NVIDIA Test GPU", "status": "ok"}]
    csv = results.write_csv(rows, tmp_path / "docs" / "results.csv")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{START}\nold table\n{END}\noutro\n")
    assert main(["--from-csv", str(csv), "--out", str(tmp_path / "docs"), "--update-readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{END}\noutro\n") and "old table" not in text
    assert "int8 decode (fused dequant)" in text and "NVIDIA Test GPU" in text and "(docs/results.csv)" in text
    assert (tmp_path / "docs" / "int8.png").exists()


def _gpu_rows(sweep="decode"):
    stamp = {"device": "NVIDIA Test GPU", "mode": "gpu", "driver": "1", "torch": "t", "triton": "x",
             "date": "2026-01-02T00:00:00Z", "sweep": sweep, "H": 32, "H_KV": 8, "D": 128, "dtype": "float16"}
    return [{**stamp, "kernel": k, "B": B, "S": S, "time_ms": 1.0, "pct_copy_bw": p, "headline": 1,
             "status": "ok", "baseline": None if k == "SDPA" else "SDPA", "vs_baseline": None if k == "SDPA" else 1.2}
            for B in (8, 32) for S in (4096, 65536) for k, p in (("SDPA", 60.0), ("decode (split-K auto)", 80.0))]


def test_plot_sweep_draws_the_reference_batches_too():
    own = [{"sweep": "decode", "kernel": "SDPA", "B": 1, "S": 512, "pct_copy_bw": 50.0, "device": "CPU"}]
    fig = results.plot_sweep(own, "decode", reference_rows=_gpu_rows(), reference_label="NVIDIA Test GPU")
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert len(titles) == 3 and any("B=32" in t for t in titles)  # B=1 (own), 8 and 32 (reference)
    dashed = [ln for ax in fig.axes for ln in ax.lines if ln.get_linestyle() == "--"]
    assert len(dashed) == 4 and "NVIDIA Test GPU" in dashed[0].get_label()


def test_show_refuses_a_mismatch_and_reports_points_not_measured(capsys, tmp_path, monkeypatch):
    rows = _gpu_rows()[:2] + [{"sweep": "decode", "B": 128, "S": 131072, "status": "out of memory (curve ends)"}]
    monkeypatch.setattr(results, "reference", lambda sweep, root=None: (None, []))
    label, ref = results.show(rows, "decode")
    assert (label, ref) == (None, [])
    assert "1 point(s): out of memory (curve ends)" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="disagree"):
        results.show(rows + [{**rows[0], "status": "MISMATCH: max |difference| 1 > 0.02"}], "decode")
    assert results.headline_table(rows)  # rows without a kernel (skipped points) are ignored, not a KeyError


def test_targets_prints_the_reference_headline_on_a_cpu(capsys):
    if GPU:
        pytest.skip("on a GPU the run's own table is printed")
    results.targets("decode", [], "NVIDIA Test GPU, ...", _gpu_rows())
    out = capsys.readouterr().out
    assert "target: decode (split-K auto), 32/8 heads" in out and "| 80% (80%–80%) |" in out
    results.targets("decode", [], None, [])
    assert results.NO_REFERENCE in capsys.readouterr().out


def test_report_on_a_cpu_says_what_was_checked_and_draws_only_a_gpu_reference(capsys, tmp_path):
    if GPU:
        pytest.skip("on a GPU report() draws this GPU's own rows")
    import matplotlib.pyplot as plt

    rows = [{"sweep": "decode", "kernel": "decode (split-K auto)", "B": 1, "S": 77, "max_abs_err": 1e-6,
             "status": "correctness only (interpreter)", "device": "CPU"},
            {"sweep": "decode", "kernel": "decode_attention_ref", "B": 1, "S": 77, "time_ms": 3.0, "max_abs_err": 1e-7,
             "status": "ok", "device": "CPU"},
            {"sweep": "decode", "kernel": "SDPA", "B": 1, "S": 77, "time_ms": 2.0, "status": "ok", "device": "CPU"}]
    plt.close("all")
    assert results.report(rows, "decode", root=tmp_path / "none") == 2
    out = capsys.readouterr().out
    assert ("1 Triton kernel(s), run in the interpreter at small, ragged shapes (decode (split-K auto)): 1 output(s), "
            "at most 1.0e-06 from their PyTorch baseline; 1 PyTorch path(s) (decode_attention_ref): 1 output(s), "
            "at most 1.0e-07") in out  # a reference is no kernel, and its own largest difference is shown
    assert results.NO_REFERENCE in out
    assert not plt.get_fignums()  # CPU times are not drawn
    stamp = {"device": "NVIDIA Test GPU", "mode": "gpu", "driver": "1.2", "torch": "2.x", "triton": "3.x",
             "date": "2026-01-02T00:00:00Z"}
    results.write_csv([{**stamp, **r} for r in _gpu_rows()], tmp_path / "ref" / "results.csv")
    results.report(rows, "decode", root=tmp_path)
    out = capsys.readouterr().out
    assert results.NO_REFERENCE not in out and "target: decode (split-K auto)" in out
    with pytest.raises(AssertionError, match="disagree"):
        results.report(rows + [{**rows[0], "status": "MISMATCH: max |difference| 1 > 0.02"}], "decode", root=tmp_path)
    plt.close("all")


@pytest.mark.skipif(GPU, reason="CPU shapes")
def test_paged_rows_carry_their_block_size():
    rows = sweeps.run(["paged"], smoke=True, progress=False)
    for r in rows:
        if "block" in r["kernel"]:
            assert r["block_size"] == int(r["kernel"].split("block ")[1]), r
        assert set(r) == set(results.COLUMNS)


def test_table_leaves_out_empty_columns_and_counts_what_was_checked():
    rows = [{**r, "max_abs_err": 1e-3} for r in _gpu_rows()[:2]] + [{"sweep": "decode", "status": "skipped"}]
    text = results.table(rows)
    header = text.splitlines()[0]
    assert "kernel" in header and "% copy bw" in header and "TFLOP/s" not in header and "block" not in header
    assert "2 timed rows; 2 outputs compared" in text and "1.0e-03" in text and "none beyond tolerance" in text
    rows[1] = {**rows[1], "status": "MISMATCH: max |difference| 0.5 > 0.02", "max_abs_err": 0.5}
    assert "1 beyond tolerance (MISMATCH)" in results.table(rows)


def test_prefill_flops_is_half_the_dense_count_torch_counts():
    from torch.utils.flop_counter import FlopCounterMode

    from kvlib.attention import attention_ref

    B, H, H_KV, S, D = 1, 4, 2, 32, 16
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, H_KV, S, D), torch.randn(B, H_KV, S, D)
    with FlopCounterMode(display=False) as counter:  # attention_ref multiplies the full S x S, then masks
        attention_ref(q, k, v)
    assert sweeps.prefill_flops(B, H, S, D, causal=False) == counter.get_total_flops() == 4 * B * H * S * S * D
    assert sweeps.prefill_flops(B, H, S, D) == 2 * B * H * S * S * D


def test_percent_of_bandwidth_plots_draw_a_100_percent_line():
    own = [{"sweep": "decode", "kernel": "SDPA", "B": 1, "S": s, "pct_copy_bw": 50.0, "device": "CPU"} for s in (1, 2)]
    fig = results.plot_sweep(own, "decode")
    assert any(ln.get_ydata()[0] == 100 and "100%" in ln.get_label() for ln in fig.axes[0].lines)
    copy = [{"sweep": "copy", "kernel": "torch copy", "memory_bytes": m, "gbps": 10.0, "pct_copy_bw": 50.0,
             "device": "CPU"} for m in (1, 2)]
    fig = results.plot_sweep(copy, "copy")
    assert any(ln.get_ydata()[0] == pytest.approx(20.0) and "100%" in ln.get_label() for ln in fig.axes[0].lines)


ENGINE_COLUMNS = ("load", "requests", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                  "preemptions")


@pytest.mark.skipif(GPU, reason="CPU workload")
def test_engine_sweep_runs_on_cpu_with_complete_rows_checked_against_generate(tmp_path):
    """Per load: static batching's row and the engine's, every column present, the engine's outputs equal to
    generate alone (status ok), its tokens/s over static's as vs_baseline, preemptions at the highest load."""
    w = sweeps.WORKLOADS["cpu"]["engine"]
    rows = sweeps.run(["engine"], progress=False)
    assert all(set(r) == set(results.COLUMNS) for r in rows)
    assert [(r["load"], r["kernel"]) for r in rows] == [
        (float(load), k) for load in w["loads"] for k in ("static batching (generate)", "engine (continuous batching)")]
    for static, eng in zip(rows[::2], rows[1::2]):
        for r in (static, eng):
            assert r["status"] == "ok" and r["device"] and r["mode"] and r["date"], r
            assert r["B"] == w["max_num_seqs"] and r["block_size"] == w["block_size"] and r["requests"] == w["requests"]
            assert r["tokens_per_s"] > 0 and r["time_ms"] is None and r["headline"] == 0
        assert static["baseline"] is None and static["vs_baseline"] is None and static["preemptions"] == 0
        assert eng["baseline"] == static["kernel"]
        assert eng["vs_baseline"] == pytest.approx(eng["tokens_per_s"] / static["tokens_per_s"])
        assert 0 < eng["ttft_p50_ms"] <= eng["ttft_p99_ms"] and 0 < eng["tpot_p50_ms"] <= eng["tpot_p99_ms"]
        assert isinstance(eng["preemptions"], int) and eng["preemptions"] >= 0
    assert rows[-1]["preemptions"] > 0  # the pool is kept small enough that the highest load preempts
    back = results.read_csv(results.write_csv(rows, tmp_path / "r.csv"))
    assert [{k: r[k] for k in ENGINE_COLUMNS} for r in back] == [
        {k: (pytest.approx(r[k], rel=1e-5) if isinstance(r[k], float) else r[k]) for k in ENGINE_COLUMNS} for r in rows]
    fig = results.plot_sweep(back, "engine", tmp_path / "engine.png")
    assert (tmp_path / "engine.png").stat().st_size > 10_000 and "CPU" in fig.axes[0].get_title()


def test_engine_sweep_says_mismatch_when_an_output_differs_from_generate_alone(monkeypatch):
    ctx = sweeps.Ctx(quick=True)
    ctx.gpu, ctx.sizes = False, {"engine": ENGINE_TINY}
    serve = sweeps._serve

    def wrong(*args):
        out, mets, wall = serve(*args)
        out[0] = out[0][:-1] + [(out[0][-1] + 1) % 256]  # one token of one request
        return out, mets, wall

    monkeypatch.setattr(sweeps, "_serve", wrong)
    rows = sweeps.run(["engine"], progress=False, ctx=ctx)
    assert [r["status"] for r in rows if r["kernel"].startswith("engine")] == [
        "MISMATCH: 1 of 4 requests differ from generate alone"] * 2
    assert all(r["status"] == "ok" for r in rows if r["kernel"].startswith("static"))


def test_engine_trace_is_seeded_skewed_and_the_same_requests_at_every_load():
    w = {**ENGINE_TINY, "requests": 200, "prompt": (24, 96), "output": (12, 48)}
    a, b = sweeps.engine_trace(w, 256), sweeps.engine_trace(w, 256)
    assert a == b and a != sweeps.engine_trace(w, 256, seed=1)
    lens = sorted(len(r["prompt"]) for r in a)
    assert 2 <= lens[0] and lens[-1] <= 96 and lens[100] < sum(lens) / len(lens)  # median < mean: a long tail
    assert all(2 <= r["new"] <= 48 for r in a) and all(max(r["prompt"]) < 256 for r in a)
    times = [r["arrival"] for r in a]
    assert times[0] == 0 and times == sorted(times) and 0.7 < (times[-1] / (len(a) - 1)) < 1.3  # rate ~1 per step


RAGGED_TINY = {"heads": [(4, 2, 32)], "decodes": [3], "chunk": [24, 0], "ctx": [40]}  # 40: a partly filled block


@pytest.mark.skipif(GPU, reason="CPU shapes")
def test_ragged_sweep_checks_the_fused_step_against_the_separate_calls_and_times_it_against_them(monkeypatch):
    """A mixed step (3 decodes at S = 40, a 24-token chunk after 40 cached positions) and a decode-only step:
    the fused call against the separate calls (the chunk's K/V contiguous; gathered in every call, as the
    engine did), outputs compared, bytes = the step's unique K/V + q + output + tables; then the interpreter's
    check of every Triton path against the reference, and a wrong fused output is a MISMATCH."""
    ctx = sweeps.Ctx(quick=True)
    ctx.sizes = {"ragged": RAGGED_TINY}
    rows = sweeps.run(["ragged"], progress=False, ctx=ctx)
    assert all(set(r) == set(results.COLUMNS) and r["sweep"] == "ragged" for r in rows)
    timed = [r for r in rows if r["time_ms"] is not None]
    assert [(r["T"], r["kernel"]) for r in timed] == [
        (27, "paged decode + flash (2 calls) (ref)"), (27, "paged decode + gather + flash (engine before) (ref)"),
        (27, "ragged, decodes + chunk (ref)"), (3, "paged decode (decodes only) (ref)"),
        (3, "ragged, decodes only (ref)")]
    H, H_KV, D = RAGGED_TINY["heads"][0]
    B, S, C = 3, 40, 24
    unique = 2 * (B * S + S + C) * H_KV * D * 4  # fp32 K/V of 3 decodes, the chunk's prefix and itself
    mixed = unique + 2 * (B + C) * H * D * 4 + (B + 1) * 4 * 4  # q and output; 4 sequences x 4 blocks, int32
    decodes = 2 * B * S * H_KV * D * 4 + 2 * B * H * D * 4 + B * 3 * 4  # 3 sequences x 3 blocks
    gathered = 2 * 2 * (S + C) * H_KV * D * 4  # the engine's old path writes the chunk's K/V, then reads them
    assert [r["bytes_moved"] for r in timed] == [mixed, mixed + gathered, mixed, decodes, decodes]
    for r in timed:
        assert (r["B"], r["S"], r["H"], r["H_KV"], r["D"], r["block_size"]) == (B, S, H, H_KV, D, 16), r
        assert r["status"] == "ok" and r["gbps"] > 0 and r["tflops"] > 0 and r["headline"] == 0, r
        first = r["kernel"].startswith(("paged decode + flash", "paged decode (decodes"))
        assert (r["baseline"] is None) == first and (r["vs_baseline"] is None) == first, r
        assert first or r["max_abs_err"] < 1e-4, r
    assert timed[2]["tflops"] * timed[2]["time_ms"] * 1e9 == pytest.approx(4 * H * D * (B * S + C * S + C * C / 2))
    checks = [r for r in rows if r["status"] == "correctness only (interpreter)"]
    assert {r["kernel"] for r in checks} == {"paged decode + flash (2 calls)", "ragged, decodes + chunk",
                                             "paged decode + gather + flash (engine before)",
                                             "paged decode (decodes only)", "ragged, decodes only"}
    assert all(r["max_abs_err"] is not None and r["baseline"] == "ragged_paged_attention_ref" for r in checks)

    import kvlib.ragged

    ref = kvlib.ragged.ragged_paged_attention_ref
    monkeypatch.setattr(kvlib.ragged, "ragged_paged_attention_ref", lambda *a: ref(*a) + 1)
    ctx.sizes = {"ragged": {**RAGGED_TINY, "chunk": [24]}}
    wrong = {r["kernel"]: r["status"] for r in sweeps.run(["ragged"], progress=False, ctx=ctx) if r["time_ms"]}
    assert wrong["ragged, decodes + chunk (ref)"].startswith("MISMATCH")
    assert wrong["paged decode + gather + flash (engine before) (ref)"] == "ok"


@pytest.mark.skipif(GPU, reason="CPU shapes")
def test_sparse_sweep_counts_the_rows_read_and_checks_every_kernel_against_the_reference(monkeypatch):
    """cpu_smoke: at the smallest CPU point the PyTorch paths are timed (dense decode over all S, paged, the
    selection, sparse contiguous and paged at the budget), the sparse bytes between the budget's rows per K/V head
    and the whole cache; then the interpreter's checks at awkward shapes (S not a multiple of the block size,
    partly filled last blocks, a sequence shorter than the budget, 1, 2, 4 and 8 query heads per K/V head, fp16
    and fp32), every Triton output compared with its reference; a kernel that skips a selected block is caught."""
    rows = sweeps.run(["sparse"], smoke=True, progress=False)
    assert all(set(r) == set(results.COLUMNS) and r["sweep"] == "sparse" for r in rows)
    assert all(r["status"] in ("ok", "correctness only", "correctness only (interpreter)") for r in rows), rows
    (budget,) = sweeps.WORKLOADS["cpu_smoke"]["sparse"]["budgets"]
    n = budget // 16
    timed = [r for r in rows if r["time_ms"] is not None]
    assert [r["kernel"] for r in timed] == [
        "float32 decode, all S (ref)", "paged decode, all S (ref)", f"select {n} blocks (bound + top)",
        f"sparse decode, {n} blocks (ref)", f"sparse decode paged, {n} blocks (ref)"]
    dense, paged, select, sparse, sparse_paged = timed
    H, H_KV, D, S = dense["H"], dense["H_KV"], dense["D"], dense["S"]
    assert dense["bytes_moved"] == 2 * S * H_KV * D * 4 + 2 * H * D * 4 and dense["baseline"] is None
    extra = H * n * 8 + 2 * H * D * 4  # the selection (int64) read, q read, the output written
    assert 2 * H_KV * budget * D * 4 + extra <= sparse["bytes_moved"] <= 2 * S * H_KV * D * 4 + extra
    assert paged["bytes_moved"] - dense["bytes_moved"] == sparse_paged["bytes_moved"] - sparse["bytes_moved"] == \
        S // 16 * 4  # the int32 block table
    assert select["bytes_moved"] == 2 * H_KV * (S // 16) * D * 4 + H * D * 4 + H * n * 8  # (kmin, kmax), q, selection
    assert select["max_abs_err"] is None
    for r in (paged, select, sparse, sparse_paged):
        assert r["baseline"] == dense["kernel"] and r["vs_baseline"] > 0 and r["gbps"] > 0, r
    checks = [r for r in rows if r["status"] == "correctness only (interpreter)"]
    assert {(r["H"] // r["H_KV"], r["dtype"]) for r in checks if r["kernel"].startswith("sparse decode paged")} == {
        (1, "float32"), (2, "float32"), (4, "float16"), (8, "float16")}
    assert all(r["S"] % 16 for r in checks) and all(
        r["max_abs_err"] is not None and r["max_abs_err"] <= sweeps.TOL[getattr(torch, r["dtype"])] for r in checks)
    assert sum(r["kernel"].startswith("sparse decode") for r in checks) == 8

    import kvlib.sparse

    real = kvlib.sparse.sparse_decode_attention

    def skips_last_block(q, k, v, sel, lens, **kw):  # a buggy kernel: each head's last selected block is left out
        last = ((sel >= 0).sum(-1, keepdim=True) - 1).clamp(min=1)  # (a head with one block keeps it)
        return real(q, k, v, sel.scatter(-1, last, -1), lens, **kw)

    monkeypatch.setattr(kvlib.sparse, "sparse_decode_attention", skips_last_block)
    ctx = sweeps.Ctx(quick=True, measure=False)
    ctx.sizes = {"sparse": {**sweeps.WORKLOADS["cpu_smoke"]["sparse"], "ctx": []}}  # the interpreter's points only
    wrong = sweeps.run(["sparse"], progress=False, ctx=ctx)
    status = {(r["S"], r["kernel"]): r["status"] for r in wrong}
    assert all(s.startswith("MISMATCH") for (_, k), s in status.items() if k.startswith("sparse decode")), status
    assert not any(s.startswith("MISMATCH") for (_, k), s in status.items() if not k.startswith("sparse decode"))
