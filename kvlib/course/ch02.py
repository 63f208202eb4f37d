"""Chapter 02's plumbing: the counters, clocks, tables and plots that notebook 02's cells call.

What the chapter teaches stays in its cells and in ``kvlib.model`` / ``kvlib.generate``; this module
holds what would only make those cells long:

- ``count_rows`` and ``trace_naive``: a counter on a key projection, so a cell can say how many K/V rows
  a generation loop *actually* computed at each step (not a formula: the shapes the layer was given);
- ``keep_freed_memory`` and ``StepLog``: a clock around each step (wall time, CPU time of the thread,
  page faults), on an allocator told to keep the memory it frees, so a step's time is the model's and
  not the operating system's (the deep dive ``02_deep_dive_page_faults.ipynb`` shows the difference);
- ``probe``: a step timed whole, without attention, and attention alone, alternating;
- the tables, the ratios and the figures of sections 2 and 4.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

try:
    import resource  # page faults of this process (Unix)
except ImportError:  # Windows
    resource = None

__all__ = ["count_rows", "NaiveTrace", "trace_naive", "trace_cached", "keep_freed_memory", "page_faults", "StepLog",
           "timed_run",
           "NoAttention", "probe", "print_probe", "step_ratio", "paired_ratio", "total_growth", "plot_costs", "plot_rope",
           "print_rope_scores", "fault_cost", "steepest_rise", "cache_bytes", "plot_faults"]


# ---------------------------------------------------------------- counting what a loop computes ----------


@contextlib.contextmanager
def count_rows(layer: torch.nn.Module):
    """Record, for every call of ``layer`` (a key projection, say), how many rows it was given.

    A row is one token of one sequence: an input (B, T, C) counts B·T. Yields the list it fills::

        with count_rows(model.layers[0].attn.wk) as rows:
            generate_naive(model, [prompt], 5)
        rows  # [p, p + 1, ..., p + 4]: the naive loop feeds the whole prefix at every step
    """
    rows: list[int] = []
    handle = layer.register_forward_hook(lambda module, args, out: rows.append(int(args[0].shape[:-1].numel())))
    try:
        yield rows
    finally:
        handle.remove()


@dataclass
class NaiveTrace:
    """What a generation loop computed, step by step, as the counter saw it.

    tokens: the prompt's ids and the generated ones; rows[i]: K/V rows (per layer, per K/V head) computed at
    step i; lengths[i]: the sequence length at step i (the rows computed are the last ``rows[i]`` positions).
    """

    prompt_len: int
    tokens: list[int]
    rows: list[int]
    lengths: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.lengths:
            self.lengths = [self.prompt_len + i for i in range(len(self.rows))]

    @property
    def computed(self) -> int:
        """K/V rows computed in all (per layer, per K/V head)."""
        return sum(self.rows)

    @property
    def needed(self) -> int:
        """Distinct positions that ever needed K/V: each one's rows computed once would be enough."""
        return len({p for length, r in zip(self.lengths, self.rows) for p in range(length - r, length)})

    @property
    def recomputed(self) -> int:
        return self.computed - self.needed


def trace_naive(model, prompt_ids: list[int], n: int) -> NaiveTrace:
    """Run ``kvlib.generate.generate_naive`` for ``n`` tokens with a counter on layer 0's key projection."""
    from kvlib.generate import generate_naive

    with count_rows(model.layers[0].attn.wk) as rows:
        new = generate_naive(model, [list(prompt_ids)], n)[0]
    return NaiveTrace(len(prompt_ids), list(prompt_ids) + new.tolist(), rows)


def trace_cached(model, prompt_ids: list[int], n: int) -> NaiveTrace:
    """The same count for ``kvlib.generate.generate`` (chapter 03's loop with a KV cache): the prompt once,
    then one row per step."""
    from kvlib.generate import generate

    with count_rows(model.layers[0].attn.wk) as rows:
        new = generate(model, [list(prompt_ids)], n)[0]
    return NaiveTrace(len(prompt_ids), list(prompt_ids) + new.tolist(), rows)


# ---------------------------------------------------------------- clocks ----------


def keep_freed_memory() -> bool:
    """Tell glibc's allocator to keep the memory this process frees, so that later steps reuse it.

    By default glibc gives large freed blocks back to the operating system (and adjusts the size it
    calls large as the program runs: ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` in mallopt(3)); the next
    step then takes fresh pages, and the kernel zeroes each one at its first touch (a page fault). Fixing
    the two thresholds high makes freed blocks stay in the heap. Returns False where there is no glibc
    (macOS, Windows): the allocator is then left as it is, and ``StepLog`` still counts its page faults.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    # 32 MiB is glibc's largest mmap threshold on 64-bit systems; trim only past 1 GiB of free heap
    return bool(mallopt(M_MMAP_THRESHOLD, 32 * 2**20)) and bool(mallopt(M_TRIM_THRESHOLD, 2**30))


def page_faults() -> int | None:
    """Minor page faults of this process so far (fresh pages the kernel handed out); None without ``resource``."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else None


class StepLog:
    """Per step: the position (tokens given to the model), wall ms, CPU ms of this thread, page faults.

    ``with log.clock(t): ...`` times one step. CPU time of the thread leaves out the time spent waiting for
    a core that another program holds, so it is the steadier measure on a busy machine.
    """

    def __init__(self):
        self.pos, self.wall_ms, self.cpu_ms, self.faults = [], [], [], []
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def clock(self, position: int):
        f0, c0, t0 = page_faults(), time.thread_time(), time.perf_counter()
        yield
        self.wall_ms.append((time.perf_counter() - t0) * 1e3)
        self.cpu_ms.append((time.thread_time() - c0) * 1e3)
        f1 = page_faults()
        self.faults.append(None if f0 is None else f1 - f0)
        self.pos.append(int(position))

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self._start

    def arrays(self):
        """(positions, wall ms, CPU ms, faults) as float arrays (faults: NaN where they are not counted)."""
        faults = [math.nan if f is None else f for f in self.faults]
        return tuple(np.asarray(a, dtype=float) for a in (self.pos, self.wall_ms, self.cpu_ms, faults))

    def __len__(self):
        return len(self.pos)


@torch.no_grad()
def timed_run(model, prompt_ids: list[int], n_new: int, *, budget_s: float = 60.0, warm_up: bool = True,
              progress=None) -> tuple[StepLog, torch.Tensor]:
    """The naive greedy loop with a clock around every step (notebook 02's timing loop, as one call).

    warm_up: run the longest step once, untimed, first (with ``keep_freed_memory`` the heap then already
    holds what every later step needs). Stops early once ``budget_s`` is spent. Returns (log, sequence).
    """
    seq, log = torch.tensor([list(prompt_ids)]), StepLog()
    if warm_up:
        model(torch.zeros(1, len(prompt_ids) + n_new, dtype=torch.long))
    for _ in (progress or (lambda x, **k: x))(range(n_new), desc="naive decoding, timing every step"):
        with log.clock(seq.shape[1]):
            nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        if log.elapsed_s > budget_s:
            break
    return log, seq


# ---------------------------------------------------------------- where a step's time goes ----------


class NoAttention:
    """Stands where attention stands (the model's ``cache.attend(layer, q, k, v)`` call, where chapter 03
    plugs its cache in) and returns q: a tensor of the attention output's shape, at no cost."""

    def attend(self, layer_idx, q, k, v):
        return q


def _cpu_ms(fn) -> float:
    t0 = time.thread_time()
    fn()
    return (time.thread_time() - t0) * 1e3


@torch.no_grad()
def probe(model, seq: torch.Tensor, positions, rounds: int = 7, budget_s: float = 30.0, progress=None) -> dict:
    """At each position t: CPU ms of (the forward pass, the forward pass without attention, attention alone
    for every layer at t's shapes), the three alternating for ``rounds`` rounds so that all see the same load.

    Returns {t: array (3, rounds run)}. Stops adding rounds (keeping at least 3) once ``budget_s`` is spent.
    """
    from kvlib.model import naive_attention

    cfg, g, out, start = model.config, torch.Generator().manual_seed(0), {}, time.perf_counter()
    for t in (progress or (lambda x, **k: x))(positions, desc="forward / without attention / attention alone"):
        x = seq[:, :t]
        qkv = [torch.randn(1, cfg.n_heads, t, cfg.head_dim, generator=g) for _ in range(3)]
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        three = (lambda: model(x), lambda: model(x, cache=NoAttention()),
                 lambda: [naive_attention(*qkv, mask) for _ in range(cfg.n_layers)])
        for fn in three:  # warm-up
            fn()
        runs = []
        for r in range(rounds):
            runs.append([_cpu_ms(fn) for fn in three])
            if r >= 2 and time.perf_counter() - start > budget_s:
                break
        out[t] = np.array(runs).T
    return out


def print_probe(probes: dict, flops_of_step) -> None:
    """One table: per position, the median CPU ms of the three and attention's share of the time and FLOPs."""
    print(f"{'t':>4} | {'forward ms':>10} | {'without attention':>17} | {'attention alone':>15} | "
          f"{'attention % of time':>19} | {'% of FLOPs':>10}")
    for t, (fwd, rest, att) in probes.items():
        fm, fa = flops_of_step(t)
        share = 100 * np.median((fwd - rest) / fwd)
        print(f"{t:>4} | {np.median(fwd):>10.2f} | {np.median(rest):>17.2f} | {np.median(att):>15.2f} | "
              f"{share:>19.0f} | {100 * fa / (fm + fa):>10.0f}")


def attention_share(probes: dict, t: int) -> float:
    """Attention's share of the step's time at t: (forward - forward without attention) / forward, median."""
    fwd, rest, _ = probes[t]
    return float(np.median((fwd - rest) / fwd))


# ---------------------------------------------------------------- how the time grows ----------


def _window(pos, ms, p, half=8):
    sel = (pos >= p - half) & (pos <= p + half)
    return float(np.median(ms[sel]))


@dataclass
class Ratio:
    lo: int
    hi: int
    lo_ms: float
    hi_ms: float
    flop: float

    @property
    def measured(self) -> float:
        return self.hi_ms / self.lo_ms


def step_ratio(log: StepLog, flops_of_step, lo: int = 32, hi: int = 512) -> Ratio:
    """One step at position ``hi`` against one at ``lo`` (median CPU ms of the steps within ±8 positions),
    and the same ratio by the FLOP model. ``hi`` is lowered to what the run reached."""
    pos, _, cpu, _ = log.arrays()
    hi = int(min(hi, pos.max() - 8))
    return Ratio(lo, hi, _window(pos, cpu, lo), _window(pos, cpu, hi), sum(flops_of_step(hi)) / sum(flops_of_step(lo)))


@torch.no_grad()
def paired_ratio(model, seq: torch.Tensor, lo: int = 32, hi: int = 512, rounds: int = 15) -> tuple[float, float, float]:
    """One step at position ``hi`` against one at ``lo`` (CPU ms of the thread), the two lengths alternating
    round by round so that both see the same background load; each round gives one ratio.

    Each timed call comes right after an untimed call of the same length, so it finds the CPU's caches and the
    allocator as a decoding loop leaves them (a step after a similar step). Timing the short step right after
    the long one would charge it for the long step's traffic through the caches and shrink the ratio.

    Returns (median, 10th percentile, 90th percentile) of the rounds' ratios.
    """
    short, long = seq[:, :lo], seq[:, :hi]

    def settled_ms(x):
        model(x)  # untimed: the same length just before, as in a decoding loop
        return _cpu_ms(lambda: model(x))

    ratios = [settled_ms(long) / settled_ms(short) for _ in range(rounds)]
    return float(np.median(ratios)), float(np.percentile(ratios, 10)), float(np.percentile(ratios, 90))


def total_growth(log: StepLog, flops_of_step, n: int | None = None) -> tuple[int, float, float]:
    """(n, measured, FLOP model): how much the total time of the first n steps (default: all, made even)
    exceeds that of the first n/2."""
    pos, _, cpu, _ = log.arrays()
    n = min(n or len(cpu), len(cpu))
    n -= n % 2
    model = np.cumsum([sum(flops_of_step(t)) for t in pos[:n]])
    return n, float(cpu[:n].sum() / cpu[: n // 2].sum()), float(model[-1] / model[n // 2 - 1])


def plot_costs(log: StepLog, probes: dict, flops_of_step, device: str, lo: int = 32):
    """Three panels: one step's CPU time against t (with the FLOP model at a constant rate, matched at t = lo),
    the total time against the tokens generated, and attention's share of a step's time and of its FLOPs."""
    import matplotlib.pyplot as plt

    pos, _, cpu, _ = log.arrays()
    flops = np.array([sum(flops_of_step(t)) for t in pos])
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.3))
    ax1.plot(pos, cpu, ".", ms=3, alpha=0.5, label="each step of the run")
    ax1.plot(pos, _window(pos, cpu, lo) * flops / sum(flops_of_step(lo)), "g-",
             label=f"FLOP model at a constant rate (matched at t = {lo})")
    ts = [t for t in probes if t > 1]
    ax1.plot(ts, [np.median(probes[t][0]) for t in ts], "kD", ms=5, label="the same step timed again (probe)")
    ax1.set(xlabel="position t (tokens the model processes this step)", ylabel="CPU time of one step (ms)",
            title=f"Naive decoding: one step (1 thread)\n{device}")
    n = np.arange(1, len(cpu) + 1)
    total, model_total = np.cumsum(cpu) / 1e3, np.cumsum(flops)
    k = len(n) // 4
    ax2.plot(n, total, label="measured (sum of the steps)")
    ax2.plot(n, total[k] * model_total / model_total[k], "g-", label="FLOP model at a constant rate (matched at n/4)")
    ax2.set(xlabel="tokens generated n", ylabel="total CPU time (s)", title=f"Naive decoding: total\n{device}")
    ax3.plot(ts, [100 * attention_share(probes, t) for t in ts], "o-", label="share of the time (probe)")
    ax3.plot(ts, [100 * flops_of_step(t)[1] / sum(flops_of_step(t)) for t in ts], "s--",
             label="share of the FLOPs (FLOP model)")
    ax3.axhline(100, color="k", lw=0.8)
    ax3.set(xlabel="position t", ylabel="attention's share of a step (%)", ylim=(0, 105),
            title=f"Attention: time vs FLOPs\n{device}")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- RoPE (section 2) ----------


def print_rope_scores(distances, key_positions, scores) -> None:
    """The q·k table of section 2: one row per distance, one column per absolute position of the key."""
    print(f"{'m - n':>6} | " + " | ".join(f"{'n = ' + str(n):>10}" for n in key_positions) + f" | {'spread':>8}")
    for d, row in zip(distances, scores):
        print(f"{d:>6} | " + " | ".join(f"{s:>10.4f}" for s in row) + f" | {row.max() - row.min():>8.1e}")


def plot_rope(theta: torch.Tensor, max_seq_len: int, train_window: int = 256):
    """Left: the angle of every pair at every position (cyclic colours). Right: tokens per full turn of each
    pair, against the training window and the configured maximum length. Computed, not measured."""
    import matplotlib.pyplot as plt

    D2 = len(theta)
    positions = np.arange(0, train_window + 1)
    angles = np.outer(theta.numpy(), positions)  # (D/2, positions): pair i at position m turns m*theta_i
    wavelength = 2 * np.pi / theta.numpy()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1.6, 1]})
    im = ax1.imshow(np.mod(angles, 2 * np.pi), aspect="auto", origin="lower", cmap="twilight",
                    interpolation="nearest", extent=(-0.5, positions[-1] + 0.5, -0.5, D2 - 0.5), vmin=0,
                    vmax=2 * np.pi)
    bar = fig.colorbar(im, ax=ax1, ticks=[0, np.pi / 2, np.pi, 3 * np.pi / 2, 2 * np.pi])
    bar.ax.set_yticklabels(["0", "π/2", "π", "3π/2", "2π"])
    bar.set_label("angle m·θ_i, modulo one turn (rad)")
    ax1.set(xlabel="position m (tokens)", ylabel="pair i (dimensions i and i + D/2)",
            title=f"RoPE: angle of each pair at each position\n(computed from model.inv_freq, D = {2 * D2})")
    ax2.semilogy(np.arange(D2), wavelength, "o-", label="tokens per full turn, 2π/θ_i")
    ax2.axhline(train_window, color="k", ls="--", lw=1, label=f"the tiny model's training window ({train_window})")
    ax2.axhline(max_seq_len, color="g", ls=":", lw=1.5, label=f"its max_seq_len ({max_seq_len:,})")
    ax2.set_yticks([10, 100, 1000, 10000], ["10", "100", "1,000", "10,000"])
    ax2.yaxis.set_minor_formatter(plt.NullFormatter())
    ax2.set(xlabel="pair i", ylabel="wavelength (tokens per turn, log scale)",
            title="RoPE: how far a pair turns\n(computed, the same on every device)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- the deep dive: page faults ----------


def fault_cost(log: StepLog) -> float:
    """CPU µs one page fault cost in this run: least squares of each step's CPU time on 1, t, t² and its faults."""
    pos, _, cpu, faults = log.arrays()
    X = np.stack([np.ones_like(pos), pos, pos**2, faults], 1)
    return float(np.linalg.lstsq(X, cpu, rcond=None)[0][3]) * 1e3


def steepest_rise(log: StepLog, window: int = 16, start_t: int = 64):
    """Where the CPU time per step rose fastest against t, between two windows of ``window`` steps.

    Returns (t at the window after the rise, median ms before, after, median faults before, after)."""
    pos, _, cpu, faults = log.arrays()
    edges = np.arange(int(np.searchsorted(pos, start_t)), len(cpu) - window + 1, window)
    med = np.array([np.median(cpu[i:i + window]) for i in edges])
    local_exp = np.log(med[1:] / med[:-1]) / np.log(pos[edges[1:]] / pos[edges[:-1]])
    k = int(np.argmax(local_exp))
    b, a = slice(edges[k], edges[k] + window), slice(edges[k + 1], edges[k + 1] + window)
    return (int(pos[edges[k + 1]]), float(np.median(cpu[b])), float(np.median(cpu[a])),
            float(np.median(faults[b])), float(np.median(faults[a])))


def cache_bytes(level: int) -> int | None:
    """This CPU's data cache of one level, from Linux's sysfs (None elsewhere)."""
    import glob

    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(f"{d}/level") as f_level, open(f"{d}/type") as f_type, open(f"{d}/size") as f_size:
                if int(f_level.read()) == level and f_type.read().strip() != "Instruction":
                    size = f_size.read().strip()
                    return int(size[:-1]) * {"K": 2**10, "M": 2**20}[size[-1]]
        except (OSError, ValueError, KeyError):
            pass
    return None


def plot_faults(runs: dict, device: str):
    """Two panels for several runs ({label: StepLog}): CPU time per step, and page faults per step, against t."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4))
    for name, log in runs.items():
        pos, _, cpu, faults = log.arrays()
        ax1.plot(pos, cpu, ".", ms=3, alpha=0.6, label=name)
        ax2.plot(pos, faults, ".", ms=3, alpha=0.6, label=name)
    ax1.set(ylabel="CPU time of one step (ms)", title=f"Naive decoding: one step (1 thread)\n{device}")
    ax2.set(ylabel="minor page faults in the step", title=f"Naive decoding: fresh pages per step\n{device}")
    for ax in (ax1, ax2):
        ax.set(xlabel="position t (tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
