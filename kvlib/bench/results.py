"""Result rows: the stamp, results.csv, curves from rows, committed GPU references, the headline table.

A result row is a flat dict with the keys in ``COLUMNS``: what was measured (sweep, kernel, shape,
dtype), what came out (time, bytes moved, GB/s, % of this machine's measured copy bandwidth, speed
ratio against the sweep's baseline, max |difference| against the baseline's output) and the stamp
(device, driver, CUDA, torch and triton versions, date) so a file read elsewhere says where its
numbers came from. Empty fields are written as "" and read back as None.

Committed results from a real GPU live in ``docs/results/<gpu>/results.csv``; the notebooks draw
them, dashed and labelled with that GPU, beside the learner's own curves (``reference``).
"""

from __future__ import annotations

import csv
import datetime
import platform
import re
import shutil
import statistics
import subprocess
from pathlib import Path

import torch

from .. import runtime

__all__ = ["COLUMNS", "stamp", "write_csv", "read_csv", "curves", "reference", "results_dirs", "TARGETS",
           "headline_table", "headline_markdown", "plot_sweep", "PLOTS", "show", "targets", "table",
           "NO_REFERENCE", "report"]

COLUMNS = [
    "sweep",  # which sweep: copy, prefill, decode, paged, int8, grouped, store, memory, engine, keepless, ragged, sparse
    "kernel",  # what ran (a Triton kernel, a PyTorch path, SDPA...)
    "B", "H", "H_KV", "S", "T", "D",  # shape glossary of the course (T: new tokens, S: cached length)
    "block_size",  # positions per cache block (paged rows)
    "dtype",
    "time_ms",  # median time per call (do_bench with a cold L2 on a GPU)
    "bytes_moved",  # bytes the call must read + write at least
    "gbps",  # bytes_moved / time, 1 GB = 1e9 bytes
    "pct_copy_bw",  # gbps as % of this machine's measured copy bandwidth (the roofline)
    "tflops",  # prefill rows: useful FLOPs / time (sweeps.prefill_flops: causal 2*B*H*S^2*D)
    "baseline",  # the row this one is compared with
    "vs_baseline",  # baseline time / this time (> 1: faster than the baseline)
    "max_abs_err",  # max |output - baseline's output| (or the reference's)
    "memory_bytes",  # memory rows: bytes measured; copy rows: one buffer's bytes
    "predicted_bytes",  # memory rows: bytes by the formula of chapter 04
    "load",  # engine rows: mean requests arriving per engine step (Poisson); B is max_num_seqs there
    "requests",  # engine rows: requests in the trace
    "tokens_per_s",  # engine rows: generated tokens / wall-clock seconds of the whole trace
    "ttft_p50_ms", "ttft_p99_ms",  # engine rows: time to first token from arrival (wall clock), median and p99
    "tpot_p50_ms", "tpot_p99_ms",  # engine rows: time per output token after the first (wall clock)
    "preemptions",  # engine rows: preemptions over the trace (recompute); vs_baseline: tokens/s over static's
    "headline",  # 1 where the point counts for the headline table (e.g. KV read >= 256 MB)
    "status",  # ok | correctness only (interpreter) | out of memory | skipped: ... | MISMATCH ... | error: ... (raised)
    "device", "mode", "driver", "cuda", "torch", "triton", "date",  # the stamp
]
STAMP_KEYS = ["device", "mode", "driver", "cuda", "torch", "triton", "date"]
_INT = {"B", "H", "H_KV", "S", "T", "D", "block_size", "bytes_moved", "memory_bytes", "predicted_bytes", "headline",
        "requests", "preemptions"}
_FLOAT = {"time_ms", "gbps", "pct_copy_bw", "tflops", "vs_baseline", "max_abs_err", "load", "tokens_per_s",
          "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"}


def _driver() -> str | None:
    """The NVIDIA driver version (nvidia-smi, else /proc), None without one."""
    if runtime.DEVICE != "cuda":
        return None
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        m = re.search(r"Kernel Module\s+([\d.]+)", Path("/proc/driver/nvidia/version").read_text())
        return m.group(1) if m else None
    except OSError:
        return None


def stamp() -> dict:
    """Where and when: device name, mode, driver, CUDA, torch and triton versions, UTC date."""
    triton = None
    if runtime.HAS_TRITON:
        import triton as _t

        triton = _t.__version__
    return {
        "device": runtime.device_name(),
        "mode": runtime.mode(),
        "driver": _driver(),
        "cuda": torch.version.cuda if runtime.DEVICE == "cuda" else None,
        "torch": torch.__version__,
        "triton": triton,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
    }


def write_csv(rows: list[dict], path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(r.get(k)) for k in COLUMNS})
    return path


def _fmt(v):
    if v is None:
        return ""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def read_csv(path) -> list[dict]:
    """Rows of a results.csv, numbers parsed back, empty fields as None."""
    rows = []
    with Path(path).open(newline="") as f:
        for raw in csv.DictReader(f):
            row = {}
            for k, v in raw.items():
                if v == "" or v is None:
                    row[k] = None
                elif k in _INT:
                    row[k] = int(float(v))
                elif k in _FLOAT:
                    row[k] = float(v)
                else:
                    row[k] = v
            rows.append(row)
    return rows


def _matches(row, where: dict) -> bool:
    return all(row.get(k) == v for k, v in where.items())


def curves(rows, *, x: str, y: str, series=("kernel",), where: dict | None = None) -> dict:
    """{label: (xs, ys)} from rows: one curve per distinct value of the ``series`` columns, keeping
    rows that match ``where`` and have a value for ``y``; sorted by ``x``."""
    out: dict = {}
    for r in rows:
        if not _matches(r, where or {}) or r.get(y) is None or r.get(x) is None:
            continue
        label = " ".join(str(r.get(c)) if c == "kernel" else f"{c}={r.get(c)}" for c in series)
        out.setdefault(label, []).append((r[x], r[y]))
    return {k: tuple(map(list, zip(*sorted(v)))) for k, v in out.items()}


def results_dirs(root=None) -> list[Path]:
    """Folders under docs/results/ holding a committed results.csv (one per GPU)."""
    root = Path(root) if root else Path(__file__).resolve().parents[2] / "docs" / "results"
    return sorted(p.parent for p in root.glob("*/results.csv")) if root.is_dir() else []


def reference(sweep: str, root=None):
    """(label, rows) of the first committed GPU result with rows for ``sweep``, or (None, []).

    The label names the GPU and its stamp (driver, torch, triton, date), for plot legends."""
    for d in results_dirs(root):
        rows = [r for r in read_csv(d / "results.csv") if r["sweep"] == sweep and r.get("mode") == "gpu"]
        if rows:
            r = rows[0]
            label = (f"{r['device']}, driver {r['driver']}, torch {r['torch']}, triton {r['triton']}, "
                     f"{(r['date'] or '')[:10]}")
            return label, rows
    return None, []


# --------------------------------------------------------------------------------------------
# Headline table: one line per kernel with a target (README, summary.md)
# --------------------------------------------------------------------------------------------

# (sweep, kernel, metric, target, where, what the target says); None: reported, no target
_MHA, _GQA8, _GQA70 = {"H": 32, "H_KV": 32}, {"H": 32, "H_KV": 8}, {"H": 64, "H_KV": 8}
TARGETS = [
    ("decode", "decode (split-K auto)", "pct_copy_bw", 75.0, _MHA, "≥ 75% of copy bandwidth, KV read ≥ 256 MB"),
    ("decode", "decode (split-K auto)", "pct_copy_bw", 75.0, _GQA8, "≥ 75% of copy bandwidth, KV read ≥ 256 MB"),
    ("decode", "decode (split-K auto)", "pct_copy_bw", 75.0, _GQA70, "≥ 75% of copy bandwidth, KV read ≥ 256 MB"),
    ("decode", "decode (no split)", "pct_copy_bw", None, {}, "(split-K off, for comparison)"),
    ("paged", "paged block 16", "vs_baseline", 0.90, {}, "≥ 0.90× the contiguous kernel"),
    ("paged", "paged block 128", "vs_baseline", 0.90, {}, "≥ 0.90× the contiguous kernel"),
    ("paged", "paged block 1", "vs_baseline", None, {}, "(one position per block, for comparison)"),
    ("int8", "int8 decode (fused dequant)", "vs_baseline", 1.6, {}, "≥ 1.6× the fp16 kernel"),
    ("int8", "dequantize, then fp16 decode", "vs_baseline", None, {}, "(unfused, for comparison)"),
    ("grouped", "grouped decode", "vs_baseline", 3.5, _GQA8, "≥ 3.5× repeat K/V, 32/8 heads"),
    ("grouped", "grouped decode", "vs_baseline", None, _GQA70, "(64/8 heads, for comparison)"),
    ("grouped", "per-query-head decode", "vs_baseline", None, _GQA8, "(chapter 03 kernel, for comparison)"),
    ("prefill", "flash_attention", "vs_baseline", 1.0, {}, "≥ 1.0× SDPA at S ≥ 4K"),
    ("store", "store_kv", "pct_copy_bw", 75.0, {}, "≥ 75% of copy bandwidth, ≥ 16K tokens"),
    ("store", "store_paged (block 16)", "pct_copy_bw", 75.0, {}, "≥ 75% of copy bandwidth, ≥ 16K tokens"),
    ("store", "store_kv_int8", "pct_copy_bw", 75.0, {}, "≥ 75% of copy bandwidth, ≥ 16K tokens"),
    ("ragged", "ragged, decodes + chunk", "vs_baseline", None, {}, "(no target yet: vs the 2 separate calls)"),
    ("ragged", "ragged, decodes only", "vs_baseline", None, {}, "(no target yet: vs paged decode)"),
]


def headline_table(rows) -> list[dict]:
    """Per target: the headline points' median (and min, max) % of copy bandwidth and ratio against
    the baseline, and whether the median meets the target. Kernels without headline points are left out."""
    table = []
    for sweep, kernel, metric, target, where, says in TARGETS:
        pts = [r for r in rows if r.get("sweep") == sweep and r.get("kernel") == kernel and r.get("headline")
               and r.get("time_ms") is not None and _matches(r, where)]
        if not pts:
            continue

        def stats(col):
            vals = [r[col] for r in pts if r.get(col) is not None]
            return (statistics.median(vals), min(vals), max(vals)) if vals else None

        pct, ratio = stats("pct_copy_bw"), stats("vs_baseline")
        value = (pct if metric == "pct_copy_bw" else ratio)
        heads = f", {where['H']}/{where['H_KV']} heads" if where else ""
        table.append({
            "sweep": sweep, "kernel": kernel + heads, "points": len(pts), "baseline": pts[0].get("baseline"),
            "pct_copy_bw": pct, "vs_baseline": ratio, "target": says, "metric": metric,
            "met": None if target is None or value is None else value[0] >= target,
            "shortfall": None if target is None or value is None else value[0] - target,
        })
    return table


def headline_markdown(rows, st: dict | None = None) -> str:
    """The headline table as Markdown (the README's results table is pasted from this)."""
    table = headline_table(rows)
    lines = []
    if st:
        gpu = f"driver {st.get('driver')}, CUDA {st.get('cuda')}, " if st.get("cuda") else ""
        lines.append(f"Measured on **{st.get('device')}** ({gpu}torch {st.get('torch')}, triton {st.get('triton')}, "
                     f"{st.get('mode')} mode), {st.get('date')}.\n")
    if not table:
        lines.append("No headline points among these rows: they are GPU timings of kernels with a target, where "
                     "the KV read is ≥ 256 MB (S ≥ 4K for prefill, ≥ 16K tokens stored). A CPU run checks "
                     "correctness and times the PyTorch paths only.")
        return "\n".join(lines) + "\n"
    lines += ["| sweep | kernel | points | % of copy bandwidth, median (min–max) | vs baseline, median (min–max) "
              "| target | met |",
              "|---|---|---|---|---|---|---|"]

    def cell(s, fmt):
        return "–" if s is None else f"{fmt(s[0])} ({fmt(s[1])}–{fmt(s[2])})"

    for t in table:
        short = -t["shortfall"] if t["shortfall"] is not None else None
        met = "–" if t["met"] is None else ("yes" if t["met"] else f"**no**: {short:.2f}× short" if
                                            t["metric"] == "vs_baseline" else f"**no**: {short:.1f} points short")
        lines.append(f"| {t['sweep']} | {t['kernel']} | {t['points']} | {cell(t['pct_copy_bw'], lambda v: f'{v:.0f}%')} "
                     f"| {cell(t['vs_baseline'], lambda v: f'{v:.2f}×')} vs {t['baseline']} | {t['target']} | {met} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Plots: one PNG per sweep, panels by batch size
# --------------------------------------------------------------------------------------------

# sweep -> (x column, y column, x label, y label, series columns, log y)
PLOTS = {
    "copy": ("memory_bytes", "gbps", "buffer size (bytes)", "achieved bandwidth (GB/s)", ("kernel",), False),
    "prefill": ("S", "tflops", "sequence length S (tokens)", "TFLOP/s (causal)", ("kernel", "H", "H_KV"), False),
    "decode": ("S", "pct_copy_bw", "context length S (tokens)", "% of measured copy bandwidth",
               ("kernel", "H", "H_KV"), False),
    "paged": ("S", "pct_copy_bw", "context length S (tokens)", "% of measured copy bandwidth", ("kernel",), False),
    "int8": ("S", "time_ms", "context length S (tokens)", "time per decode step (ms)", ("kernel",), True),
    "grouped": ("S", "time_ms", "context length S (tokens)", "time per decode step (ms)", ("kernel", "H", "H_KV"), True),
    "store": ("T", "pct_copy_bw", "new tokens written T", "% of measured copy bandwidth", ("kernel",), False),
    "keepless": ("S", "time_ms", "context length S (tokens)", "time per decode step (ms)", ("kernel",), True),
    "sparse": ("S", "time_ms", "context length S (tokens)", "time per decode step (ms)", ("kernel",), True),
    "ragged": ("S", "time_ms", "context length S of each decode (tokens)", "attention time per step (ms)",
               ("kernel", "T"), True),
    "memory": ("S", "memory_bytes", "context length S (tokens)", "bytes held (4 layers, batch 1)", ("kernel",), True),
    "engine": ("load", "tokens_per_s", "load (requests arriving per engine step, Poisson mean)",
               "generated tokens/s (wall clock, tiny model)", ("kernel",), False),
}


def _roofline(ax, rows, y):
    """The 100% line: at 100 on a % of copy bandwidth axis; on the copy sweep's GB/s axis, at the copy_bw
    this run divided by (gbps / pct_copy_bw of its rows). Dotted, so it is not taken for a reference curve."""
    if y == "pct_copy_bw":
        level, label = 100.0, "100% = measured copy bandwidth"
    elif y == "gbps":
        bws = [r["gbps"] * 100 / r["pct_copy_bw"] for r in rows if r.get("gbps") and r.get("pct_copy_bw")]
        if not bws:
            return
        level, label = bws[0], f"measured copy bandwidth {bws[0]:,.1f} GB/s (= 100%)"
    else:
        return
    ax.axhline(level, color="gray", linestyle=":", linewidth=1.5, label=label)
    ax.legend(fontsize=8)


def plot_sweep(rows, sweep: str, path=None, reference_rows=None, reference_label=None):
    """The sweep's figure: one panel per batch size (decode-like sweeps; two panels a row), each curve one
    kernel (and head layout); committed reference rows dashed, with the legend beside the panel. Saved to
    ``path`` when given. Returns the Figure."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from . import plot_curves

    x, y, xlabel, ylabel, series, logy = PLOTS[sweep]
    rows = [r for r in rows if r.get("sweep") == sweep]
    reference_rows = [r for r in reference_rows or [] if r.get("sweep") == sweep]
    # a GPU's bandwidth, TFLOP/s or time and a CPU's differ by orders of magnitude: a log axis shows both
    logy = logy or bool(reference_rows) and y not in ("pct_copy_bw", "vs_baseline")
    batches = sorted({r["B"] for r in rows + reference_rows if r.get(y) is not None and r.get("B") is not None})
    batches = batches or [None]
    ncols = min(2, len(batches))
    nrows = -(-len(batches) // ncols)
    width = 7.0 + (4.0 if reference_rows else 0.0)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, 4.4 * nrows), squeeze=False)
    device = rows[0]["device"] if rows else (reference_label or runtime.device_name())
    for ax, B in zip(axes.flat, batches):
        where = {} if B is None else {"B": B}
        own = curves(rows, x=x, y=y, series=series, where=where)
        ref = curves(reference_rows, x=x, y=y, series=series, where=where)
        shape = next((r for r in rows + reference_rows if _matches(r, where)), {})
        what = ", ".join(f"{k}={shape[k]}" for k in ("B", "D", "dtype") if shape.get(k) is not None)
        plot_curves(None, own, xlabel=xlabel, ylabel=ylabel, title=f"{sweep}: {what}", logy=logy, device=device,
                    reference=ref, reference_device=reference_label, ax=ax)
        _roofline(ax, rows, y)
        if reference_rows:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # long labels: beside the plot
    for ax in axes.flat[len(batches):]:
        ax.set_visible(False)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig


# --------------------------------------------------------------------------------------------
# What a notebook does with a sweep: check it, draw it beside the reference, state the targets
# --------------------------------------------------------------------------------------------

NO_REFERENCE = ("Measured on a GPU: not yet. The course has no GPU results to show here so far; run this "
                "notebook on a machine with an NVIDIA GPU and this cell times the Triton kernels at full size.")


def _refuse_mismatches(rows):
    """Raise AssertionError naming every row whose kernel disagreed with its baseline (status MISMATCH)."""
    bad = [r for r in rows if str(r.get("status", "")).startswith("MISMATCH")]
    if bad:
        raise AssertionError("kernels disagree with their baseline:\n" + "\n".join(
            f"  {r['kernel']} {r.get('B')}/{r.get('H')}/{r.get('H_KV')}/{r.get('S') or r.get('T')}: {r['status']}"
            for r in bad))


def show(rows, sweep: str, keep=None):
    """Check a sweep's rows (no MISMATCH), draw them (in CPU mode beside the committed GPU reference, if
    any) and say which points were not measured. ``keep(kernel_name)`` selects the curves drawn.
    Returns (reference label, reference rows) for ``targets``."""
    import matplotlib.pyplot as plt

    _refuse_mismatches(rows)
    label, ref_rows = (None, []) if runtime.mode() == "gpu" else reference(sweep)

    def kept(rs):
        return [r for r in rs if r.get("kernel") and (keep is None or keep(r["kernel"]))]

    # draw like against like: the reference's head layouts that this machine measured, if it measured any
    layouts = {(r.get("H"), r.get("H_KV")) for r in rows if r.get("time_ms") is not None}
    same = [r for r in ref_rows if (r.get("H"), r.get("H_KV")) in layouts]
    plot_sweep(kept(rows), sweep, reference_rows=kept(same or ref_rows), reference_label=label)
    plt.show()
    missing = {}
    for r in rows:
        status = str(r.get("status", ""))
        if not status.startswith(("ok", "correctness")):
            missing[status] = missing.get(status, 0) + 1
    if missing:
        print("not measured: " + "; ".join(f"{n} point(s): {s}" for s, n in missing.items()))
    return label, kept(ref_rows)


_TABLE = {"kernel": "kernel", "B": "B", "H": "H", "H_KV": "H_KV", "S": "S", "T": "T", "D": "D", "block_size": "block",
          "dtype": "dtype", "time_ms": "ms", "gbps": "GB/s", "pct_copy_bw": "% copy bw", "tflops": "TFLOP/s",
          "vs_baseline": "× baseline", "max_abs_err": "max |err|", "status": "status"}
_FORMATS = {"ms": "{:.4g}", "GB/s": "{:.1f}", "% copy bw": "{:.1f}", "TFLOP/s": "{:.3g}", "× baseline": "{:.2f}",
            "max |err|": "{:.1e}", "B": "{:.0f}", "H": "{:.0f}", "H_KV": "{:.0f}", "S": "{:.0f}", "T": "{:.0f}",
            "D": "{:.0f}", "block": "{:.0f}"}


def table(rows) -> str:
    """The rows as a text table (columns that are empty in every row left out), then one line saying how
    many rows were timed and how many outputs were compared with their baseline's."""
    import pandas as pd

    rows = [r for r in rows if r.get("kernel")]
    df = pd.DataFrame(rows).reindex(columns=list(_TABLE)).rename(columns=_TABLE).dropna(axis=1, how="all")
    text = df.to_string(index=False, na_rep="", formatters={
        c: (lambda v, f=f: "" if pd.isna(v) else f.format(v)) for c, f in _FORMATS.items() if c in df})
    timed = sum(r.get("time_ms") is not None for r in rows)
    errs = [r["max_abs_err"] for r in rows if r.get("max_abs_err") is not None]
    bad = sum(str(r.get("status", "")).startswith("MISMATCH") for r in rows)
    where = f"{runtime.mode()} mode, {rows[0]['device']}" if rows else runtime.mode()
    return (f"{text}\n\n{where}: {timed} timed rows; {len(errs)} outputs compared with their baseline's, largest "
            f"|difference| {max(errs, default=0):.1e}, " + (f"{bad} beyond tolerance (MISMATCH)" if bad else
                                                           "none beyond tolerance"))


def targets(sweep: str, rows, ref_label=None, ref_rows=(), kernels=None):
    """Print the sweep's targets, and the headline table of this run (GPU) or of the committed reference."""
    for sw, kernel, _, target, where, says in TARGETS:
        if sw == sweep and target is not None and (kernels is None or kernel in kernels):
            heads = f", {where['H']}/{where['H_KV']} heads" if where else ""
            print(f"target: {kernel}{heads}: {says}")
    if runtime.mode() == "gpu":
        _markdown(f"**This GPU**:\n\n{headline_markdown(rows)}")
    elif ref_rows:
        _markdown(f"**The reference GPU** (dashed above), {ref_label}:\n\n{headline_markdown(ref_rows)}")
    else:
        print("CPU mode: the targets are about GPU timings. " + NO_REFERENCE)


def report(rows, sweep: str, keep=None, kernels=None, root=None):
    """What a chapter shows of a sweep, by mode.

    GPU mode: ``show`` (the curves), ``table`` (every row) and ``targets`` (met or not on this GPU).
    CPU mode: the rows are PyTorch paths timed at small sizes and Triton kernels run once in the
    interpreter for correctness, so their times say nothing about the GPU kernels: one sentence says what
    was checked, then the committed GPU reference (curves and headline table) if there is one, else
    ``NO_REFERENCE``. A row whose kernel disagrees with its baseline raises in both modes.
    Returns the number of rows compared with their baseline.
    """
    if runtime.mode() == "gpu":
        label, ref_rows = show(rows, sweep, keep)
        print(table(rows))
        targets(sweep, rows, label, ref_rows, kernels)
        return sum(r.get("max_abs_err") is not None for r in rows)
    _refuse_mismatches(rows)
    checked = [r for r in rows if r.get("kernel") and r.get("max_abs_err") is not None]
    interpreted = [r for r in checked if str(r.get("status", "")).endswith("(interpreter)")]
    parts = []
    for group, what in ((interpreted, "Triton kernel(s), run in the interpreter at small, ragged shapes"),
                        ([r for r in checked if r not in interpreted], "PyTorch path(s)")):
        if group:
            found = sorted({r["kernel"] for r in group})
            parts.append(f"{len(found)} {what} ({', '.join(found)}): {len(group)} output(s), at most "
                         f"{max(r['max_abs_err'] for r in group):.1e} from their PyTorch baseline")
    print(f"CPU mode, checked against a baseline: {'; '.join(parts) or 'nothing'}. Times measured on a CPU say "
          "nothing about these GPU kernels, so none are drawn here.")
    label, ref_rows = reference(sweep, root)
    kept = [r for r in ref_rows if r.get("kernel") and (keep is None or keep(r["kernel"]))]
    if not kept:
        print(NO_REFERENCE)
        return len(checked)
    import matplotlib.pyplot as plt

    plot_sweep(kept, sweep)
    plt.show()
    targets(sweep, rows, label, kept, kernels)
    return len(checked)


def _markdown(text: str):
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display

        if get_ipython() is not None:
            display(Markdown(text))
            return
    except ImportError:
        pass
    print(text)
