"""Measuring: time a callable, count bytes, measure copy bandwidth, plot curves.

Every curve in the course goes through these few functions, so that all chapters time things
the same way:
- ``time_ms(fn)``: median milliseconds per call. On a GPU this is ``triton.testing.do_bench``
  (CUDA events, L2 flushed between calls); on the CPU, ``time.perf_counter`` around each call
  after a warm-up, median of the repeats.
- ``tensor_bytes(obj)``: bytes held by the tensors in a tensor / module / list / dict.
- ``peak_memory_bytes(fn)``: peak GPU memory allocated while ``fn`` runs (GPU only).
- ``copy_bandwidth_gbps()``: measured device-to-device copy bandwidth, the roofline that later
  chapters compare their kernels with ("% of the bandwidth this machine can actually move").
- ``plot_curves(...)``: a labelled matplotlib figure with units, log axes and the device name.
"""

from __future__ import annotations

import numbers
import statistics
import time
from functools import lru_cache

import torch

from .. import runtime

__all__ = ["time_ms", "tensor_bytes", "peak_memory_bytes", "copy_bandwidth_gbps", "plot_curves", "gbps"]


def _sync():
    if runtime.DEVICE == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, *, warmup: int = 3, rep: int = 10, min_time_s: float = 0.0, gpu_warmup_ms: float = 25,
            gpu_rep_ms: float = 100) -> float:
    """Median wall time of ``fn()`` in milliseconds.

    GPU: ``triton.testing.do_bench`` with a warm-up and repeat budget of ``gpu_warmup_ms`` /
    ``gpu_rep_ms`` milliseconds and a cold L2 cache for every call (it zeroes a 256 MB buffer
    between calls); ``warmup``/``rep`` apply to the CPU path only.
    CPU: ``warmup`` untimed calls, then ``rep`` timed calls (more if ``min_time_s`` is not reached).
    """
    if runtime.DEVICE == "cuda" and runtime.HAS_TRITON and not runtime.INTERPRETER:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=gpu_warmup_ms, rep=gpu_rep_ms, return_mode="median"))
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < rep or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def time_runs(fn, *, budget_s: float = 2.0, min_rep: int = 3, max_rep: int = 50, warmup: int = 1) -> list[float]:
    """Wall times of ``fn()`` in milliseconds, one per call, for timing cells on a busy laptop.

    ``warmup`` untimed calls, then at least ``min_rep`` timed calls and more while the total stays
    under ``budget_s`` seconds (at most ``max_rep``). Show the spread with :func:`spread`.
    """
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_rep or (len(times) < max_rep and time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def spread(times_ms: list[float], unit: str = "ms") -> str:
    """'median 1.23 ms (min 1.10, max 1.52, 9 runs)' for a list of timings."""
    return (f"median {statistics.median(times_ms):.3g} {unit} "
            f"(min {min(times_ms):.3g}, max {max(times_ms):.3g}, {len(times_ms)} runs)")


def tensor_bytes(obj) -> int:
    """Bytes of tensor storage reachable from ``obj`` (tensor, nn.Module, list/tuple/dict, object
    with tensor attributes). Tensors sharing one storage are counted once."""
    seen: set[int] = set()
    total = 0

    def visit(o):
        nonlocal total
        if isinstance(o, torch.Tensor):
            key = o.untyped_storage().data_ptr() if o.device.type != "meta" else id(o)
            if key not in seen:
                seen.add(key)
                total += o.untyped_storage().nbytes() if o.device.type != "meta" else o.nbytes
        elif isinstance(o, torch.nn.Module):
            for t in list(o.parameters()) + list(o.buffers()):
                visit(t)
        elif isinstance(o, dict):
            for v in o.values():
                visit(v)
        elif isinstance(o, (list, tuple, set)):
            for v in o:
                visit(v)
        elif hasattr(o, "__dict__") and not isinstance(o, type):
            for v in vars(o).values():
                visit(v)

    visit(obj)
    return total


def peak_memory_bytes(fn) -> int | None:
    """Peak GPU memory allocated by PyTorch while ``fn()`` runs, above what was allocated before.

    Returns None on the CPU: PyTorch's CPU allocator keeps no peak counter, so CPU chapters count
    bytes with ``tensor_bytes`` instead (exact for the tensors we create).
    """
    if runtime.DEVICE != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def gbps(nbytes: float, ms: float) -> float:
    """Bytes moved in ``ms`` milliseconds, as GB/s (1 GB = 1e9 bytes, as GPU data sheets count)."""
    return nbytes / (ms * 1e-3) / 1e9


@lru_cache(maxsize=None)
def copy_bandwidth_gbps(nbytes: int | None = None) -> float:
    """Measured copy bandwidth of this device in GB/s, counting bytes read + bytes written.

    Copies a buffer large enough to defeat caches (1 GiB on a GPU, 256 MiB on the CPU). A GPU
    data sheet's peak is higher than a copy reaches; this number is the yardstick the course compares kernels
    with. A kernel that only reads (a decode step reading its cache) can pass it: a copy also writes every byte.
    """
    if nbytes is None:
        nbytes = runtime.by_mode(cpu=256 * 2**20, gpu=2**30)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=runtime.DEVICE).fill_(1.0)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=2, rep=10)
    return gbps(2 * src.nbytes, ms)


def plot_curves(x, series: dict, *, xlabel: str, ylabel: str, title: str, logx: bool = True,
                logy: bool = True, device: str | None = None, reference: dict | None = None,
                reference_device: str | None = None, ax=None, marker: str = "o"):
    """One labelled figure: each ``series`` is {label: y values over x} (None = not measured), or,
    with ``x=None``, {label: (xs, ys)} (curves with their own x values, as ``results.curves`` gives).

    ``reference``: optional curves measured elsewhere (e.g. committed results from a real GPU),
    drawn dashed and labelled with ``reference_device``. The title ends with the device name.
    Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.2))
    for label, ys in series.items():
        xs, ys = ys if x is None else (x, ys)
        pts = [(a, b) for a, b in zip(xs, ys) if b is not None]
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=label)
    for label, (rx, ry) in (reference or {}).items():
        ax.plot(rx, ry, linestyle="--", marker="x", label=f"{label} [{reference_device or 'reference'}]")
    if logx:
        ax.set_xscale("log", base=2)
        xs_all = [a for ys in series.values() for a in list(ys[0] if x is None else x)]
        xs_all += [a for rx, _ in (reference or {}).values() for a in list(rx)]
        plotted = sorted({float(a) for a in xs_all if isinstance(a, numbers.Real) and a > 0})
        if 3 <= len(plotted) <= 12:  # plain numbers at the plotted sizes, not 2^k powers between them
            ax.set_xticks(plotted, [f"{a:,g}" if a < 1e6 else f"{a:.3g}" for a in plotted])
            ax.xaxis.set_minor_formatter(plt.NullFormatter())
    if logy:
        from matplotlib.ticker import FuncFormatter, LogLocator
        ax.set_yscale("log")
        # 1, 2, 5 per decade, labelled plainly: a curve within one or two decades still shows >= 3 labelled ticks
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\n{device or runtime.device_name()}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax
