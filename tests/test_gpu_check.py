"""scripts/gpu_check.sh, the one prepared run on a lent GPU, and the harness parts it relies on.

On a CPU the script refuses to run, or with GPU_CHECK_ALLOW_CPU=1 makes a dry run in the interpreter:
here in --smoke mode over three sweeps, one of which aborts as a CUDA fault would (the test hook
KVLIB_BENCH_FAULT), to show that a crash ends one sweep, not the run, and the others' rows and figures
are merged. The in-process tests cover what the script calls: --plan, --merge, the rows written after
every point, and the error row of a point that raised.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from kvlib import runtime
from kvlib.bench import results, sweeps
from kvlib.bench.__main__ import main

GPU = runtime.mode() == "gpu"
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
KNOBS = ("GPU_CHECK_", "KVLIB_BENCH_", "TEST_TIMEOUT_S", "BENCH_BUDGET_S")


def _script(out, *args, **env_vars):
    """Run the script into ``out`` with only the given knobs set (none inherited from this shell)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(KNOBS)}
    env.update(PYTHON=sys.executable, **env_vars)
    return subprocess.run(["bash", str(SCRIPT), str(out), *args], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.mark.skipif(GPU, reason="on a GPU this would run the whole GPU check")
def test_gpu_check_script_refuses_to_run_without_a_gpu(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0  # parses
    proc = _script(tmp_path / "out")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "needs one" in (tmp_path / "out" / "status.txt").read_text()
    assert "torch" in (tmp_path / "out" / "environment.txt").read_text()


@pytest.mark.skipif(GPU, reason="on a GPU the script runs for real, not as a dry run")
def test_a_sweep_that_crashes_ends_alone_and_the_other_sweeps_rows_and_figures_are_merged(tmp_path):
    out = tmp_path / "out"
    proc = _script(out, "--smoke", GPU_CHECK_ALLOW_CPU="1", GPU_CHECK_SKIP_TESTS="1",
                   GPU_CHECK_SWEEPS="copy decode store", KVLIB_BENCH_FAULT="decode")
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 1, log
    status = (out / "status.txt").read_text()
    assert "smoke decode exit 134" in status and "SIGABRT" in status, status
    assert "smoke copy exit 0" in status and "smoke store exit 0" in status, status
    assert "tests skipped: GPU_CHECK_SKIP_TESTS=1" in status, status
    assert "merge exit 0" in status and "1 failed (smoke decode exit 134)" in status.splitlines()[-1], status
    assert "aborting after the first point of decode" in (out / "smoke" / "decode.log").read_text()

    rows = results.read_csv(out / "bench" / "results.csv")
    assert [r["sweep"] for r in rows] == sorted((r["sweep"] for r in rows), key=list(sweeps.SWEEPS).index)
    assert {r["sweep"] for r in rows} == {"copy", "decode", "store"}
    assert not [r for r in rows if str(r["status"]).startswith(("MISMATCH", "error"))], rows
    # decode died after its first point: that point's rows were on disk before the abort, the next never ran
    first_S = sweeps.WORKLOADS["cpu_smoke"]["decode"]["ctx"][0]
    assert {r["S"] for r in rows if r["sweep"] == "decode"} == {first_S}
    assert {r["kernel"] for r in rows if r["sweep"] == "store"} >= {"store_kv", "store_paged (block 16)"}
    for name in ("copy", "decode", "store"):
        assert (out / "bench" / f"{name}.png").stat().st_size > 10_000, name
    assert "interpreter mode" in (out / "bench" / "summary.md").read_text()
    st = json.loads((out / "bench" / "stamp.json").read_text())
    assert {p["sweeps"][0]: p["complete"] for p in st["parts"]} == {"copy": True, "decode": False, "store": True}
    assert st["complete"] is False and st["smoke"] is True and st["device"] == rows[0]["device"]
    assert not list(SCRIPT.parent.parent.glob("core*")), "an aborted sweep left a core file"


@pytest.mark.skipif(GPU, reason="on a GPU the script runs for real, not as a dry run")
def test_steps_past_the_budget_are_skipped_and_listed_and_nothing_measured_fails(tmp_path):
    out = tmp_path / "out"
    # 40 s, of which the merge keeps 30: nothing can start with the 20 s a step needs
    proc = _script(out, GPU_CHECK_ALLOW_CPU="1", GPU_CHECK_SWEEPS="copy memory", GPU_CHECK_BUDGET_S="40")
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    status = (out / "status.txt").read_text()
    for step in ("smoke copy", "smoke memory", "tests", "sweep copy", "sweep memory"):
        assert f"   {step} skipped: " in status, (step, status)
    assert "sweeps (points): copy " in status and "nothing in bench/" in status, status
    assert not (out / "bench").exists()
    bad = _script(tmp_path / "bad", GPU_CHECK_BUDGET_S="9 minutes")
    assert bad.returncode == 1 and "GPU_CHECK_BUDGET_S=9 minutes: give a whole number of seconds" in bad.stderr


def _fake(monkeypatch, builds):
    """A sweep named "fake" whose points run ``builds`` in turn (S = 1, 2, 3, ...)."""
    pts = [sweeps.Point("fake", {"S": i + 1, "dtype": "float32"}, b, curve=("c",)) for i, b in enumerate(builds)]
    monkeypatch.setitem(sweeps.SWEEPS, "fake", lambda ctx: iter(pts))


def _ok():
    x = torch.ones(4)
    return {"base": sweeps.Kernel(lambda: x + 1, False, 32)}


def _fault():
    raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be ...")


def test_rows_are_handed_over_after_every_point_and_an_error_leaves_a_row_then_raises(monkeypatch):
    _fake(monkeypatch, [_ok, _ok, _fault, _ok])
    seen = []
    with pytest.raises(RuntimeError, match="illegal memory access"):
        sweeps.run(["fake"], quick=True, progress=False, on_rows=lambda rows: seen.append(rows))
    assert [len(r) for r in seen] == [1, 2, 3]
    assert [r["S"] for r in seen[-1]] == [1, 2, 3] and set(seen[-1][0]) == set(results.COLUMNS)
    assert seen[-1][2]["status"] == "error: RuntimeError: CUDA error: an illegal memory access was encountered"


def test_the_cli_leaves_the_rows_measured_before_a_point_raised(monkeypatch, tmp_path):
    _fake(monkeypatch, [_ok, _fault])
    results.write_csv([{"sweep": "copy", "kernel": "an older run's row"}], tmp_path / "results.csv")
    with pytest.raises(RuntimeError):
        main(["--only", "fake", "--out", str(tmp_path), "--quick", "--no-plots"])
    rows = results.read_csv(tmp_path / "results.csv")
    assert [(r["S"], r["status"][:6]) for r in rows] == [(1, "ok"), (2, "error:")]
    st = json.loads((tmp_path / "stamp.json").read_text())
    assert st["complete"] is False and st["seconds"] is None and st["sweeps"] == ["fake"]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_fault_hook_that_names_no_known_fault_is_a_clear_error(monkeypatch):
    _fake(monkeypatch, [_ok, _ok])
    monkeypatch.setenv(sweeps.FAULT_ENV, "fake:explode")
    with pytest.raises(ValueError, match="abort or hang"):
        sweeps.run(["fake"], quick=True, progress=False)
    monkeypatch.setenv(sweeps.FAULT_ENV, "copy")  # another sweep's fault: this one runs to the end
    assert len(sweeps.run(["fake"], quick=True, progress=False)) == 2


def test_plan_counts_each_sweeps_points_in_run_order(monkeypatch, capsys):
    _fake(monkeypatch, [_ok, _ok, _ok])
    assert sweeps.plan(["fake"]) == [("fake", 3)]
    counted = sweeps.plan(["store", "copy"], smoke=True)
    ctx = sweeps.Ctx(quick=False, smoke=True, measure=False)
    assert counted == [(n, len(list(sweeps.SWEEPS[n](ctx)))) for n in ("store", "copy")]
    assert all(n >= 1 for _, n in counted) and ctx.copy_bw is None
    assert main(["--plan", "--smoke", "--only", "store", "--only", "copy"]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == [f"{n} {k}" for n, k in counted]
    with pytest.raises(ValueError, match="unknown sweep"):
        sweeps.plan(["decod"])


def _part(folder, rows, stamp=None):
    results.write_csv(rows, folder / "results.csv")
    if stamp is not None:
        (folder / "stamp.json").write_text(json.dumps(stamp))
    return folder


def test_merge_joins_the_parts_in_run_order_with_one_header_and_says_which_ended_early(tmp_path, capsys):
    base = {"device": "GPU X", "mode": "gpu", "torch": "2.11", "date": "2026-01-01T00:00:00Z", "status": "ok"}
    parts = tmp_path / "sweeps"
    store = _part(parts / "a_store", [{**base, "sweep": "store", "kernel": "store_kv", "T": t, "time_ms": 1.0,
                                       "pct_copy_bw": 80.0} for t in (1024, 4096)],
                  {"device": "GPU X", "copy_bandwidth_gbps": 4000.0, "seconds": 3.0, "complete": True,
                   "command": "python -m kvlib.bench --only store"})
    _part(parts / "b_copy", [{**base, "sweep": "copy", "kernel": "torch copy", "memory_bytes": 2**20, "gbps": 9.0,
                              "pct_copy_bw": 100.0}])  # no stamp.json: that process died
    assert main(["--merge", str(parts), "--out", str(tmp_path / "bench")]) == 0
    text = (tmp_path / "bench" / "results.csv").read_text()
    assert text.count("sweep,kernel,") == 1
    rows = results.read_csv(tmp_path / "bench" / "results.csv")
    assert [(r["sweep"], r["T"]) for r in rows] == [("copy", None), ("store", 1024), ("store", 4096)]
    st = json.loads((tmp_path / "bench" / "stamp.json").read_text())
    assert st["sweeps"] == ["copy", "store"] and st["complete"] is False and st["copy_bandwidth_gbps"] == 4000.0
    assert [(p["sweeps"], p["rows"], p["complete"]) for p in sorted(st["parts"], key=lambda p: p["rows"])] == [
        (["copy"], 1, False), (["store"], 2, True)]
    assert "GPU X" in (tmp_path / "bench" / "summary.md").read_text()
    assert {p.name for p in (tmp_path / "bench").glob("*.png")} == {"copy.png", "store.png"}
    assert "ended early" in capsys.readouterr().out
    # a results.csv or a folder holding one work as well; nothing to merge is a clear error
    assert main(["--merge", str(store / "results.csv"), str(parts / "b_copy"), "--out", str(tmp_path / "two"),
                 "--no-plots"]) == 0
    assert len(results.read_csv(tmp_path / "two" / "results.csv")) == 3
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="nothing to merge"):
        main(["--merge", str(tmp_path / "empty"), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="no such file or folder"):
        main(["--merge", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")])
