"""Chapter 00's plumbing: the bandwidth measurements, their tables and plots, out of the notebook's cells.

The notebook (``notebooks/00_setup.ipynb``) calls these and shows what they return; what they measure is
explained there. Nothing here decides what a result means: the functions measure, tabulate and draw.

- :func:`cache_sizes`: the data caches this machine reports (a GPU's L2, a CPU's L1/L2/L3 from Linux's /sys).
- :func:`copy_sweep_table` / :func:`plot_copy_sweep`: the copy sweep of ``kvlib.bench`` (``python -m kvlib.bench
  --only copy``) as a table (one row per size and kernel, with the working set against the largest cache) and a
  plot (GB/s against the buffer size, committed GPU curves dashed beside this machine's).
- :func:`interleaved` / :func:`interleaved_table` / :func:`plot_interleaved`: copy and add alternated at each size
  for a few rounds, so each add is compared with a copy of its own size measured next to it.
- :func:`interpreter_cost`: the Triton add timed at several tile sizes on one vector: the interpreter's time
  follows the number of programs, not the bytes.
"""

from __future__ import annotations

import glob
import statistics
import time

import torch

from .. import bench, runtime
from ..bench import results, sweeps

__all__ = ["cache_sizes", "caches_line", "copy_sweep", "gpu_reference", "copy_sweep_table", "interpreter_rows", "plot_copy_sweep",
           "interleaved", "interleaved_table", "plot_interleaved", "interpreter_cost", "mib_axis"]


# ------------------------------------------------------------------------------------------------
# caches
# ------------------------------------------------------------------------------------------------


def cache_sizes() -> dict:
    """The data caches this machine reports, {"L2": bytes, ...}: the GPU's L2, or the CPU's from Linux's /sys
    (empty where the OS reports none). A virtual machine may report its host's whole cache, shared with others."""
    if runtime.DEVICE == "cuda":
        return {"L2": torch.cuda.get_device_properties(0).L2_cache_size}
    sizes = {}
    for d in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            kind, level, size = (open(f"{d}/{f}").read().strip() for f in ("type", "level", "size"))
        except OSError:
            continue
        if kind != "Instruction":  # the data (or unified) caches
            sizes[f"L{level}"] = int(size.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1], 1)
    return sizes


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**10:g} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:g} MiB"


def caches_line(caches: dict) -> str:
    """One printable line: the caches reported, e.g. "L1 48 KiB, L2 1 MiB, L3 32 MiB"."""
    if not caches:
        return "no cache sizes reported by this OS: assume buffers of a few MiB fit in a cache"
    return ", ".join(f"{k} {_size(v)}" for k, v in caches.items())


# ------------------------------------------------------------------------------------------------
# the copy sweep (kvlib.bench's, as `python -m kvlib.bench --only copy` runs it)
# ------------------------------------------------------------------------------------------------


def copy_sweep() -> list[dict]:
    """Run kvlib.bench's copy sweep on this machine; its result rows (see kvlib.bench.results.COLUMNS)."""
    return sweeps.run(["copy"])


def gpu_reference() -> tuple[str | None, list[dict]]:
    """(label, rows) of the copy sweep of a GPU run committed with the course, to draw beside a CPU's curves;
    (None, []) in GPU mode (the notebook then shows this GPU's own curves) or when none is committed."""
    return (None, []) if runtime.mode() == "gpu" else results.reference("copy")


def interpreter_rows(rows: list[dict]) -> list[dict]:
    """The rows run once in the interpreter for correctness (CPU mode), not timed."""
    return [r for r in rows if r.get("status") == "correctness only (interpreter)"]


def copy_sweep_table(rows: list[dict], copy_bw: float, largest_cache: int | None):
    """One row per timed (size, kernel): the working set (bytes read + written), its ratio to the largest
    reported cache, GB/s and % of ``copy_bw`` (the same measurement ``pct_copy_bw`` was computed against)."""
    import pandas as pd

    out = []
    for r in rows:
        if r.get("time_ms") is None:
            continue
        ws = r["bytes_moved"]  # every byte read or written once
        out.append({"buffer (MiB)": r["memory_bytes"] // 2**20, "kernel": r["kernel"],
                    "working set (MiB)": ws // 2**20,
                    "working set ÷ largest cache": None if not largest_cache else round(ws / largest_cache, 2),
                    "GB/s": round(r["gbps"], 1), "% of copy_bw": round(100 * r["gbps"] / copy_bw)})
    return pd.DataFrame(out).sort_values(["buffer (MiB)", "kernel"], ascending=[True, False]).reset_index(drop=True)


def mib_axis(ax, sizes_mib) -> None:
    """A log x axis in MiB with one plain-number tick per measured size (no 2^k or 10^k labels)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(float(s) for s in sizes_mib)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("buffer size (MiB)")


def _log_y(ax) -> None:
    """A log y axis with 1-2-5 ticks in plain numbers (a GPU's GB/s and a CPU's differ by orders of magnitude)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5), numticks=30))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def plot_copy_sweep(rows: list[dict], copy_bw: float, ref_label: str | None = None, ref_rows=()):
    """GB/s against the buffer size for each timed kernel of this machine (solid), the committed GPU run's
    (dashed, labelled ``ref_label``), and ``copy_bw`` as a dotted line. Returns the Figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    sizes = []
    for kernel in dict.fromkeys(r["kernel"] for r in rows if r.get("time_ms") is not None):
        pts = sorted((r["memory_bytes"] / 2**20, r["gbps"]) for r in rows if r["kernel"] == kernel and r.get("time_ms"))
        ax.plot(*zip(*pts), marker="o", label=kernel)
        sizes += [p[0] for p in pts]
    ref = [r for r in ref_rows if r.get("time_ms") is not None]
    for kernel in dict.fromkeys(r["kernel"] for r in ref):
        pts = sorted((r["memory_bytes"] / 2**20, r["gbps"]) for r in ref if r["kernel"] == kernel)
        ax.plot(*zip(*pts), linestyle="--", marker="x", label=f"{kernel} [{ref_label.split(',')[0]}]")
        sizes += [p[0] for p in pts]
    if ref:
        _log_y(ax)
    else:
        ax.set_ylim(bottom=0)
    ax.axhline(copy_bw, color="gray", linestyle=":", linewidth=1.5, label=f"copy_bw {copy_bw:,.1f} GB/s (= 100%)")
    mib_axis(ax, sizes)
    if runtime.INTERPRETER:
        ax.text(0.01, 0.98, "triton add: not timed on this CPU (the interpreter runs each program in Python)",
                transform=ax.transAxes, fontsize=7, color="gray", va="top")
    title = f"copy sweep: bytes read + written per second\n{runtime.device_name()}"
    ax.set(ylabel="achieved bandwidth (GB/s)", title=title + (" (solid); dashed: " + ref_label if ref else ""))
    ax.title.set_fontsize(8 if ref else 11)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------
# each size against a copy of its own size, interleaved
# ------------------------------------------------------------------------------------------------


def interleaved(sizes_mib, *, rounds: int = 5, budget_s: float = 8.0) -> dict:
    """{MiB: {"copy": [GB/s per round], "add": [...]}}: a copy and an add of each buffer size, alternated for up
    to ``rounds`` rounds (at least 2; no new round once ``budget_s`` seconds are spent), so that both see the
    same background load. GB/s counts bytes read + written (copy: 2 per element byte, add: 3)."""
    from tqdm.auto import tqdm

    kw = dict(warmup=1, rep=3, gpu_warmup_ms=5, gpu_rep_ms=25)
    meas, t_start = {}, time.perf_counter()
    for m in tqdm(sizes_mib, desc="copy vs add at each size"):
        n = m * 2**20 // 4
        a, b = torch.randn(n, device=runtime.DEVICE), torch.randn(n, device=runtime.DEVICE)
        dst = torch.empty_like(a)
        meas[m] = {"copy": [], "add": []}
        for r in range(rounds):
            meas[m]["copy"].append(bench.gbps(2 * a.nbytes, bench.time_ms(lambda: dst.copy_(a), **kw)))
            meas[m]["add"].append(bench.gbps(3 * a.nbytes, bench.time_ms(lambda: torch.add(a, b, out=dst), **kw)))
            if r >= 1 and time.perf_counter() - t_start > budget_s:
                break
        del a, b, dst
    return meas


def _spread(xs) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def add_vs_copy(meas: dict) -> dict:
    """{MiB: [add's GB/s ÷ the copy's of the same round, in %]}."""
    return {m: [100 * a / c for a, c in zip(d["add"], d["copy"])] for m, d in meas.items()}


def interleaved_table(meas: dict, copy_bw: float, largest_cache: int | None):
    """One row per size: median (min–max over the rounds) of the copy's and the add's GB/s, the add as % of the
    copy of the same round, and the copy as % of ``copy_bw``; the add's working set against the largest cache."""
    import pandas as pd

    fmt = lambda s, d=1: f"{s[0]:,.{d}f} ({s[1]:,.{d}f}–{s[2]:,.{d}f})"  # noqa: E731
    ratio = add_vs_copy(meas)
    out = []
    for m, d in meas.items():
        out.append({"buffer (MiB)": m, "rounds": len(d["copy"]),
                    "add's working set ÷ largest cache": None if not largest_cache else round(3 * m * 2**20 / largest_cache, 2),
                    "copy GB/s": fmt(_spread(d["copy"])), "add GB/s": fmt(_spread(d["add"])),
                    "add, % of same-size copy": fmt(_spread(ratio[m]), 0),
                    "copy, % of copy_bw": fmt(_spread([100 * x / copy_bw for x in d["copy"]]), 0)})
    return pd.DataFrame(out)


def plot_interleaved(meas: dict, copy_bw: float, largest_cache: int | None):
    """Left: copy and add GB/s per size (median, min–max bars). Right: the add as % of the copy of its own size
    and round (100% line drawn). A red band marks where the add's working set fits the largest cache."""
    import matplotlib.pyplot as plt

    sizes = list(meas)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.4))
    for name, off in (("copy", 0.95), ("add", 1.05)):  # side by side, so the error bars do not hide each other
        med = [_spread(meas[m][name]) for m in sizes]
        ax1.errorbar([m * off for m in sizes], [s[0] for s in med], yerr=[[s[0] - s[1] for s in med],
                     [s[2] - s[0] for s in med]], marker="o", capsize=3, label=f"torch {name}")
    ax1.axhline(copy_bw, color="gray", linestyle=":", linewidth=1.5, label=f"copy_bw {copy_bw:,.1f} GB/s")
    rounds = max(len(d["copy"]) for d in meas.values())
    ax1.set(ylabel="achieved bandwidth (GB/s)",
            title=f"copy and add, median and min–max of up to {rounds} rounds\n{runtime.device_name()}")
    pct = [_spread(v) for v in add_vs_copy(meas).values()]
    ax2.errorbar(sizes, [s[0] for s in pct], yerr=[[s[0] - s[1] for s in pct], [s[2] - s[0] for s in pct]],
                 marker="o", capsize=3, label="torch add")
    ax2.axhline(100, color="gray", linestyle=":", linewidth=1.5, label="100% = a copy of the same size")
    ax2.set(ylabel="add's GB/s ÷ same-size copy's (%)", title=f"add against a copy of its own size\n{runtime.device_name()}")
    for ax in (ax1, ax2):
        ax.set_ylim(bottom=0)
        mib_axis(ax, sizes)
        if largest_cache:
            ax.axvspan(min(sizes) / 1.5, largest_cache / 2**20 / 3, color="tab:red", alpha=0.08,
                       label="add's working set fits the largest cache")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------
# what the interpreter's time measures
# ------------------------------------------------------------------------------------------------


def interpreter_cost(n: int, tiles, *, rep: int = 3):
    """The Triton add on ``n`` fp32 elements at each tile size, and torch's add beside it: a table with the
    programs launched, the lanes masked off, the median time and the time per program. (In GPU mode these
    are compiled launches; in CPU mode the interpreter's.)"""
    import pandas as pd

    from ..vector_add import add

    x = torch.randn(n, device=runtime.DEVICE)
    out = []
    for tile in tiles:
        programs = -(-n // tile)
        ms = bench.time_ms(lambda: add(x, x, tile=tile), warmup=1, rep=rep)
        out.append({"kernel": f"triton add, tile {tile}", "programs": programs, "masked lanes": programs * tile - n,
                    "ms per call": round(ms, 3), "µs per program": round(1e3 * ms / programs, 1)})
    ms = bench.time_ms(lambda: x + x, warmup=1, rep=max(rep, 10))
    out.append({"kernel": "torch add", "programs": None, "masked lanes": None, "ms per call": round(ms, 4),
                "µs per program": None})
    return pd.DataFrame(out).astype({"programs": "Int64", "masked lanes": "Int64",
                                     "µs per program": "Float64"})  # integers, blank for torch
