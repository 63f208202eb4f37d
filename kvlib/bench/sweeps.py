"""The benchmark sweeps: one generator per kernel family, all run by one loop (``run``).

Each sweep yields ``Point`` descriptions (a shape, and a ``build`` function that allocates the
inputs and returns the callables to time). ``run`` builds each point, runs every callable once to
check its output against the point's baseline, times it with ``bench.time_ms`` and turns it into a
result row (see ``results.COLUMNS``).

- GPU: every callable is timed (``triton.testing.do_bench``, cold L2). Workloads (``WORKLOADS``)
  follow the course's targets: heads 32/8/128, 64/8/128, 32/32/128; batch 1, 8, 32, 128; context 1K
  to 128K where memory allows. An out-of-memory error ends that curve; the sweep goes on with the
  next one. ``quick`` runs a few points per sweep.
- CPU (``quick`` or not): the PyTorch paths are timed at small sizes, and every Triton kernel runs
  once in the interpreter at a small awkward shape, for correctness only (no time: the interpreter's
  speed says nothing about the kernel's).

Sweeps, in run order: copy (the roofline), decode, paged, int8, grouped, store, prefill, memory, engine,
keepless, ragged, sparse.

The ragged sweep times one serving step's attention (B decodes and a prefill chunk of C tokens of B + 1
sequences, end to end) as one fused ``kvlib.ragged.ragged_paged_attention`` call against the separate calls
the engine made before (``paged_decode_attention`` for the decodes, ``flash_attention`` for the chunk), and a
decode-only step against ``paged_decode_attention`` alone (see ``ragged``).

The sparse sweep (chapter 11) times Quest's ``kvlib.sparse.sparse_decode_attention`` at fixed token budgets as S
grows, contiguous and through a block table, against the dense decode over all S (chapter 03's, and chapter 05's
paged one); bytes are the rows it must read (each K/V head's selected rows once), so its GB/s and its ratio to the
dense kernel say what reading less buys. The selection (bound + top blocks) is a row of its own (see ``sparse``).

The engine sweep is not a kernel: it serves one seeded trace of requests (Poisson arrivals, skewed
prompt and output lengths) through ``kvlib.engine.Engine`` with the tiny model at several loads, and
the same requests through static batching (``generate`` in batches of ``max_num_seqs``): generated
tokens/s, TTFT and TPOT percentiles (wall clock) and preemptions, one row per load and mode. Its
outputs are checked token for token against ``generate`` alone, at every load. Arrivals are counted in
engine steps (the logical clock), so the schedule and its preemptions are the same on every machine; a
step spent waiting for an arrival computes nothing, so tokens/s says how well a load fills the batches.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from .. import runtime
from . import copy_bandwidth_gbps, gbps, peak_memory_bytes, tensor_bytes, time_ms
from .results import COLUMNS, stamp

__all__ = ["SWEEPS", "Point", "Kernel", "run", "plan", "prefill_flops", "FAULT_ENV"]

HEADS = [(32, 8, 128), (64, 8, 128), (32, 32, 128)]  # (H, H_KV, D): Llama-3-8B, Llama-3-70B, Llama-2-7B
K = 1024

# What each sweep measures, per run kind: "gpu" (the full run), "gpu_quick" (--quick on a GPU) and "cpu"
# (the timed PyTorch paths; each Triton kernel also runs once at a small shape in the interpreter).
# heads: (H, H_KV, D); batch: B; ctx: cached length S; tokens: new tokens T written; mib: buffer sizes.
# sparse: budgets = token budgets, the positions each query head reads (Quest's; blocks of 16, the current one
# included), one selection and two sparse rows (contiguous, paged) per budget at each S;
# ragged: decodes = B sequences decoding one token each at context S; chunk = the step's prefill chunk C (after
# S cached positions; 0: a decode-only step); --smoke runs the first chunk size, so a mixed step.
WORKLOADS = {
    "gpu": {
        "copy": {"mib": [1, 4, 16, 64, 256, 1024]},
        "decode": {"heads": HEADS, "batch": [1, 8, 32, 128], "ctx": [1 * K, 4 * K, 16 * K, 64 * K, 128 * K]},
        "paged": {"heads": HEADS[:1], "batch": [8, 32], "ctx": [4 * K, 16 * K, 64 * K]},
        "int8": {"heads": HEADS[:1], "batch": [8, 32], "ctx": [4 * K, 16 * K, 64 * K]},
        "keepless": {"heads": HEADS[:1], "batch": [8, 32], "ctx": [4 * K, 16 * K, 64 * K]},
        "sparse": {"heads": HEADS[:1], "batch": [8, 32], "ctx": [4 * K, 16 * K, 64 * K], "budgets": [256, 1 * K]},
        "ragged": {"heads": HEADS[:1], "decodes": [8, 32], "chunk": [512, 2 * K, 0],
                   "ctx": [1 * K, 4 * K, 16 * K, 32 * K]},
        "grouped": {"heads": HEADS[:2], "batch": [1, 8, 32], "ctx": [4 * K, 16 * K, 64 * K]},
        "store": {"tokens": [1 * K, 4 * K, 16 * K, 64 * K]},
        "prefill": {"heads": HEADS, "batch": [1], "ctx": [1 * K, 2 * K, 4 * K, 8 * K, 16 * K]},
        "memory": {"ctx": [1 * K, 4 * K, 16 * K, 64 * K, 128 * K]},
        "engine": {"loads": [0.1, 0.25, 0.5, 1, 2, 4], "requests": 128, "prompt": (64, 512), "output": (32, 256),
                   "max_num_seqs": 32, "max_batched_tokens": 512, "block_size": 16, "num_blocks": 192},
    },
    "gpu_quick": {
        "copy": {"mib": [16, 256, 1024]},
        "decode": {"heads": HEADS[:1], "batch": [8], "ctx": [4 * K, 16 * K, 64 * K]},
        "paged": {"heads": HEADS[:1], "batch": [8], "ctx": [16 * K, 64 * K]},
        "int8": {"heads": HEADS[:1], "batch": [8], "ctx": [16 * K, 64 * K]},
        "keepless": {"heads": HEADS[:1], "batch": [8], "ctx": [16 * K, 64 * K]},
        "sparse": {"heads": HEADS[:1], "batch": [8], "ctx": [16 * K, 64 * K], "budgets": [256, 1 * K]},
        "ragged": {"heads": HEADS[:1], "decodes": [8], "chunk": [512, 0], "ctx": [4 * K, 16 * K]},
        "grouped": {"heads": HEADS[:1], "batch": [8], "ctx": [16 * K, 64 * K]},
        "store": {"tokens": [16 * K, 64 * K]},
        "prefill": {"heads": HEADS[:1], "batch": [1], "ctx": [4 * K, 16 * K]},
        "memory": {"ctx": [4 * K, 64 * K]},
        "engine": {"loads": [0.1, 0.5, 2], "requests": 64, "prompt": (64, 512), "output": (32, 256),
                   "max_num_seqs": 32, "max_batched_tokens": 512, "block_size": 16, "num_blocks": 192},
    },
    "cpu": {
        "copy": {"mib": [1, 4, 16, 64]},
        "decode": {"heads": HEADS[:1], "batch": [1], "ctx": [512, 2 * K, 8 * K]},
        "paged": {"heads": HEADS[:1], "batch": [1], "ctx": [512, 2 * K, 8 * K]},
        "int8": {"heads": HEADS[:1], "batch": [1], "ctx": [512, 2 * K, 8 * K]},
        "keepless": {"heads": HEADS[:1], "batch": [1], "ctx": [512, 2 * K, 8 * K]},
        "sparse": {"heads": HEADS[:1], "batch": [1], "ctx": [512, 2 * K, 8 * K], "budgets": [256]},
        "ragged": {"heads": [(8, 2, 64)], "decodes": [4], "chunk": [128, 0], "ctx": [512, 2 * K]},  # O(C * S) chunk
        "grouped": {"heads": HEADS[:1], "batch": [1], "ctx": [512, 2 * K, 8 * K]},
        "store": {"tokens": [1 * K, 4 * K, 16 * K]},
        "prefill": {"heads": [(8, 2, 64)], "batch": [1], "ctx": [256, 512, 1 * K]},  # CPU attention is O(S^2)
        "memory": {"ctx": [1 * K, 4 * K, 16 * K]},
        "engine": {"loads": [0.05, 0.2, 1], "requests": 32, "prompt": (24, 96), "output": (12, 48),
                   "max_num_seqs": 4, "max_batched_tokens": 64, "block_size": 16, "num_blocks": 12},
    },
}
# --smoke: the first (smallest) entry of every list, one point per sweep: the harness end to end in seconds.
WORKLOADS.update({f"{kind}_smoke": {sweep: {k: v[:1] if isinstance(v, list) else v for k, v in w.items()}
                                    for sweep, w in WORKLOADS[kind].items()} for kind in ("gpu", "cpu")})
for _kind in ("gpu_smoke", "cpu_smoke"):  # a smoke engine trace: 8 requests, each also run through generate alone
    WORKLOADS[_kind]["engine"] = dict(WORKLOADS[_kind]["engine"], requests=8)
# engine: loads = mean requests arriving per engine step (Poisson), from about one request running at a
# time to more than max_num_seqs can serve; requests in the trace; prompt and output = (median, cap) of
# their log-normal lengths in tokens; the rest are Engine's arguments (the pool, num_blocks, is kept below
# what max_num_seqs typical requests need, so the high loads preempt).
HEADLINE_KV_BYTES = 256 * 10**6  # GPU headline points read at least this much K/V
TOL = {torch.float16: 2e-2, torch.float32: 1e-4}


@dataclass
class Kernel:
    fn: Callable  # the call to time
    triton: bool  # True: a Triton kernel (interpreter on CPU: run once for correctness, not timed)
    bytes_moved: int | None = None  # least bytes read + written per call
    result: Callable | None = None  # what to compare after fn() ran (default: fn's return value)
    expected: str | None = None  # compare with this kernel's output instead of the baseline's
    tol: float | None = None  # max |difference| allowed (default: by dtype)
    compare: bool = True  # False: nothing to compare with (a different computation than the baseline)
    columns: dict = field(default_factory=dict)  # more columns for this kernel's row (e.g. block_size)


@dataclass
class Point:
    sweep: str
    shape: dict  # B, H, H_KV, S, T, D, block_size, dtype (any subset)
    build: Callable  # allocates the inputs -> {name: Kernel}, first timed entry = the baseline (memory: rows)
    curve: tuple = ()  # points of one curve share this key; out of memory ends the curve
    headline: bool = False
    flops: float | None = None  # useful FLOPs per call (prefill)
    need_bytes: int = 0  # rough device memory the point needs (skip if clearly more than free)
    timed: bool = True  # False: a correctness-only point (CPU interpreter)
    extra: dict = field(default_factory=dict)  # more columns for every row (memory sweep)


def _dt(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _randn(*shape, dtype, device, gen=None):
    return torch.randn(*shape, dtype=dtype, device=device, generator=gen)


def _shapes(ctx, sweep):
    """(H, H_KV, D, B, S) of a sweep's timed points, in curve order (S innermost)."""
    w = ctx.sizes[sweep]
    for H, H_KV, D in w["heads"]:
        for B in w["batch"]:
            for S in w["ctx"]:
                yield H, H_KV, D, B, S


class Ctx:
    """What a sweep needs to know about this run."""

    def __init__(self, quick: bool, smoke: bool = False, measure: bool = True):
        """measure=False: leave ``copy_bw`` unmeasured (None), for counting points without touching the device."""
        self.gpu = runtime.mode() == "gpu"
        self.quick = quick
        kind = ("gpu_quick" if quick else "gpu") if self.gpu else "cpu"
        self.sizes = WORKLOADS[f"{kind.split('_')[0]}_smoke" if smoke else kind]
        self.device = runtime.DEVICE
        self.dtype = torch.float16 if self.gpu else torch.float32  # CPU matmuls are slow in fp16
        self.check_dtype = torch.float16  # interpreter correctness points: the GPU's dtype
        self.copy_bw = copy_bandwidth_gbps() if measure else None
        # GPU: do_bench repeats a call for rep_ms (each after flushing L2): 40 ms keeps a full sweep in a
        # few minutes and still gives hundreds of repeats of a sub-millisecond kernel.
        # CPU: at least 5 calls and 50 ms, so a busy core shows as noise rather than as the curve.
        self.time_kw = ({"gpu_warmup_ms": 10, "gpu_rep_ms": 40} if self.gpu
                        else {"warmup": 2, "rep": 5, "min_time_s": 0.05})


# --------------------------------------------------------------------------------------------
# copy: the roofline every bandwidth-bound kernel is compared with
# --------------------------------------------------------------------------------------------


def copy(ctx: Ctx) -> Iterator[Point]:
    from ..vector_add import add

    for m in ctx.sizes["copy"]["mib"]:
        n = m * 2**20 // 4

        def build(n=n):
            a = torch.randn(n, device=ctx.device)
            b = torch.randn(n, device=ctx.device)
            dst = torch.empty_like(a)
            # into a preallocated output: on a CPU, a fresh 64 MiB result per call would time page faults
            ks = {"torch copy": Kernel(lambda: dst.copy_(a), False, 2 * a.nbytes),
                  "torch add": Kernel(lambda: torch.add(a, b, out=dst), False, 3 * a.nbytes, compare=False)}
            if ctx.gpu:  # on CPU the interpreter checks add once, at the small point below
                ks["triton add"] = Kernel(lambda: add(a, b), True, 3 * a.nbytes, expected="torch add")
            return ks

        yield Point("copy", {"dtype": "float32"}, build, curve=("copy",), headline=m * 2**20 >= HEADLINE_KV_BYTES,
                    need_bytes=4 * n * 4, extra={"memory_bytes": n * 4})
    if not ctx.gpu:  # the interpreter's correctness point
        def build_check():
            a = torch.randn(1000, device=ctx.device)
            return {"torch add": Kernel(lambda: a + a, False, 12000),
                    "triton add": Kernel(lambda: add(a, a), True, 12000)}

        yield Point("copy", {"dtype": "float32"}, build_check, curve=("copy-check",), timed=False,
                    extra={"memory_bytes": 4000})


# --------------------------------------------------------------------------------------------
# prefill: the flash-attention kernel vs SDPA
# --------------------------------------------------------------------------------------------


def prefill(ctx: Ctx) -> Iterator[Point]:
    from ..attention import attention_ref, flash_attention

    for H, H_KV, D, B, S in _shapes(ctx, "prefill"):
        yield _prefill_point(ctx, B, H, H_KV, S, D, ctx.dtype, timed=True, flash=flash_attention,
                             ref=None if ctx.gpu else attention_ref)
    if not ctx.gpu:
        yield _prefill_point(ctx, 1, 4, 2, 100, 64, ctx.check_dtype, timed=False, flash=flash_attention, ref=None)


def prefill_flops(B: int, H: int, S: int, D: int, causal: bool = True) -> float:
    """Useful FLOPs of attention over S tokens (T = S), counted as 2 per multiply-add.

    Q K^T is S x S dot products of length D per (batch, query head): S*S*D multiply-adds; P V the same.
    Dense: 2 * 2 * B*H*S*S*D = 4*B*H*S^2*D FLOPs. Causal: only the S(S+1)/2 pairs on or below the
    diagonal are needed, counted as half of the dense products: 2*B*H*S^2*D FLOPs (notebook 01 derives it).
    """
    dense = 4 * B * H * S * S * D
    return dense / 2 if causal else float(dense)


def _prefill_point(ctx, B, H, H_KV, S, D, dtype, *, timed, flash, ref):
    def build():
        q = _randn(B, H, S, D, dtype=dtype, device=ctx.device)
        k = _randn(B, H_KV, S, D, dtype=dtype, device=ctx.device)
        v = _randn(B, H_KV, S, D, dtype=dtype, device=ctx.device)
        kr, vr = k.repeat_interleave(H // H_KV, 1), v.repeat_interleave(H // H_KV, 1)  # SDPA gets K/V pre-repeated
        nbytes = 2 * q.nbytes + k.nbytes + v.nbytes
        cast = dtype == torch.float16 and not ctx.gpu  # CPU SDPA reference in fp32 for the fp16 check
        ks = {"SDPA": Kernel(lambda: F.scaled_dot_product_attention(
            *((t.float() for t in (q, kr, vr)) if cast else (q, kr, vr)), is_causal=True), False, nbytes)}
        if ref is not None:
            ks["attention_ref"] = Kernel(lambda: ref(q, k, v), False, nbytes)
        if ctx.gpu or not timed:
            ks["flash_attention"] = Kernel(lambda: flash(q, k, v), True, nbytes)
        return ks

    flops = prefill_flops(B, H, S, D, causal=True)  # 2*B*H*S^2*D: half of the dense 4*B*H*S^2*D
    return Point("prefill", {"B": B, "H": H, "H_KV": H_KV, "S": S, "T": S, "D": D, "dtype": _dt(dtype)}, build,
                 curve=("prefill", H, H_KV, D, timed), headline=S >= 4096, flops=flops,
                 need_bytes=B * (2 * H + 4 * H) * S * D * 2, timed=timed)


# --------------------------------------------------------------------------------------------
# decode: split-K decode kernel vs SDPA on the same contiguous cache
# --------------------------------------------------------------------------------------------


def _kv(ctx, B, H, H_KV, S, D, dtype):
    q = _randn(B, H, D, dtype=dtype, device=ctx.device)
    k = _randn(B, H_KV, S, D, dtype=dtype, device=ctx.device)
    v = _randn(B, H_KV, S, D, dtype=dtype, device=ctx.device)
    lens = torch.full((B,), S, dtype=torch.int32, device=ctx.device)
    return q, k, v, lens


def _kv_bytes(B, H_KV, S, D, elt):
    return 2 * B * H_KV * S * D * elt


def decode(ctx: Ctx) -> Iterator[Point]:
    from ..cache import decode_attention, decode_attention_ref

    def point(H, H_KV, D, B, S, dtype, timed):
        def build():
            q, k, v, lens = _kv(ctx, B, H, H_KV, S, D, dtype)
            nbytes = _kv_bytes(B, H_KV, S, D, k.element_size()) + 2 * q.nbytes
            qs, ks_, vs_ = ((t.float() for t in (q, k, v)) if dtype == torch.float16 and not ctx.gpu else (q, k, v))
            def sdpa():  # one query token: (B, H, 1, D) over the whole cache
                return F.scaled_dot_product_attention(qs[:, :, None], ks_, vs_, enable_gqa=H != H_KV)[:, :, 0]

            ks = {"SDPA": Kernel(sdpa, False, nbytes)}
            if not ctx.gpu and timed:
                ks["decode_attention_ref"] = Kernel(lambda: decode_attention_ref(q, k, v, lens), False, nbytes)
            if ctx.gpu or not timed:
                ks["decode (split-K auto)"] = Kernel(lambda: decode_attention(q, k, v, lens), True, nbytes)
                ks["decode (no split)"] = Kernel(lambda: decode_attention(q, k, v, lens, num_splits=1), True, nbytes)
                if not timed:
                    ks["decode (4 splits)"] = Kernel(lambda: decode_attention(q, k, v, lens, num_splits=4), True, nbytes)
            return ks

        kvb = _kv_bytes(B, H_KV, S, D, torch.empty((), dtype=dtype).element_size())
        return Point("decode", {"B": B, "H": H, "H_KV": H_KV, "S": S, "T": 1, "D": D, "dtype": _dt(dtype)}, build,
                     curve=("decode", H, H_KV, D, B, timed), headline=kvb >= HEADLINE_KV_BYTES,
                     need_bytes=int(kvb * 1.1), timed=timed)  # SDPA may need more (GQA): that row alone runs out

    for H, H_KV, D, B, S in _shapes(ctx, "decode"):
        yield point(H, H_KV, D, B, S, ctx.dtype, True)
    if not ctx.gpu:
        yield point(8, 2, 64, 2, 300, ctx.check_dtype, False)


# --------------------------------------------------------------------------------------------
# paged: the decode kernel through block tables (random physical blocks) vs contiguous
# --------------------------------------------------------------------------------------------


def _to_blocks(k, block_size, perm):
    """(B, H_KV, S, D) -> a pool (num_blocks, block_size, H_KV, D) where logical block i of
    sequence b lives in physical block perm[b * blocks_per_seq + i] (a last, partly filled block: zeros after S)."""
    B, H_KV, S, D = k.shape
    nb = -(-S // block_size)
    if S % block_size:
        k = F.pad(k, (0, 0, 0, nb * block_size - S))
    pool = torch.empty(B * nb, block_size, H_KV, D, dtype=k.dtype, device=k.device)
    pool[perm] = k.permute(0, 2, 1, 3).reshape(B * nb, block_size, H_KV, D)
    return pool


def paged(ctx: Ctx) -> Iterator[Point]:
    """The paged decode against the same kernel over a contiguous cache (both one program per K/V head and
    its query group, kvlib.gqa): what the block table costs, nothing else."""
    from ..cache import decode_attention_ref
    from ..gqa import grouped_decode_attention
    from ..paged import paged_decode_attention, paged_decode_attention_ref

    block_sizes = (1, 16, 128)

    def point(H, H_KV, D, B, S, dtype, timed, lens_list=None):
        def build():
            q, k, v, lens = _kv(ctx, B, H, H_KV, S, D, dtype)
            if lens_list is not None:
                lens = torch.tensor(lens_list, dtype=torch.int32, device=ctx.device)
            nbytes = _kv_bytes(B, H_KV, S, D, k.element_size()) + 2 * q.nbytes
            gen = torch.Generator(device=ctx.device).manual_seed(0)
            ks = {}
            if ctx.gpu:
                ks["contiguous decode"] = Kernel(lambda: grouped_decode_attention(q, k, v, lens), True, nbytes)
            else:
                ks["decode_attention_ref"] = Kernel(lambda: decode_attention_ref(q, k, v, lens), False, nbytes)
            for bs in block_sizes:
                nb = S // bs
                perm = torch.randperm(B * nb, device=ctx.device, generator=gen)
                kb, vb = _to_blocks(k, bs, perm), _to_blocks(v, bs, perm)
                tables = perm.view(B, nb).to(torch.int32)
                nbytes_p = nbytes + tables.nbytes
                if ctx.gpu or not timed:
                    ks[f"paged block {bs}"] = Kernel(
                        lambda kb=kb, vb=vb, t=tables: paged_decode_attention(q, kb, vb, t, lens), True, nbytes_p,
                        columns={"block_size": bs})
                else:
                    ks[f"paged_decode_attention_ref block {bs}"] = Kernel(
                        lambda kb=kb, vb=vb, t=tables: paged_decode_attention_ref(q, kb, vb, t, lens), False, nbytes_p,
                        columns={"block_size": bs})
            return ks

        kvb = _kv_bytes(B, H_KV, S, D, torch.empty((), dtype=dtype).element_size())
        return Point("paged", {"B": B, "H": H, "H_KV": H_KV, "S": S, "T": 1, "D": D, "dtype": _dt(dtype)}, build,
                     curve=("paged", H, H_KV, D, B, timed), headline=kvb >= HEADLINE_KV_BYTES,
                     need_bytes=kvb * (1 + len(block_sizes)), timed=timed)

    for H, H_KV, D, B, S in _shapes(ctx, "paged"):
        yield point(H, H_KV, D, B, S, ctx.dtype, True)
    if not ctx.gpu:  # ragged lengths: partly filled last blocks
        yield point(4, 2, 64, 2, 256, ctx.check_dtype, False, lens_list=[256, 201])


# --------------------------------------------------------------------------------------------
# int8: the decode kernel reading int8 + scales vs fp16, and vs dequantize-then-attend
# --------------------------------------------------------------------------------------------


def _int8_kv(ctx, B, H_KV, S, D, dtype, gen):
    """Random int8 rows and fp16 scales, and the same numbers in ``dtype`` (so both paths see one cache)."""
    kq = torch.randint(-127, 128, (B, H_KV, S, D), dtype=torch.int8, device=ctx.device, generator=gen)
    ks = (0.01 + 0.02 * torch.rand(B, H_KV, S, device=ctx.device, generator=gen)).half()
    return kq, ks, (kq.to(dtype) * ks[..., None].to(dtype))


def int8(ctx: Ctx) -> Iterator[Point]:
    """The int8 decode against the same kernel reading fp16 (both one program per K/V head and its query
    group, kvlib.gqa), and against dequantizing first: what halving the bytes buys, nothing else."""
    from ..cache import decode_attention_ref
    from ..gqa import grouped_decode_attention
    from ..quant import dequantize_int8, int8_decode_attention, int8_decode_attention_ref

    def point(H, H_KV, D, B, S, dtype, timed):
        def build():
            gen = torch.Generator(device=ctx.device).manual_seed(0)
            q = _randn(B, H, D, dtype=dtype, device=ctx.device)
            kq, ks, k = _int8_kv(ctx, B, H_KV, S, D, dtype, gen)
            vq, vs, v = _int8_kv(ctx, B, H_KV, S, D, dtype, gen)
            lens = torch.full((B,), S, dtype=torch.int32, device=ctx.device)
            b16 = _kv_bytes(B, H_KV, S, D, k.element_size()) + 2 * q.nbytes
            b8 = _kv_bytes(B, H_KV, S, D, 1) + 2 * ks.nbytes + 2 * q.nbytes
            deq = b8 + 2 * b16  # read int8 + scales, write the fp16 copy, read it again
            if ctx.gpu or not timed:
                fp16 = lambda: grouped_decode_attention(q, k, v, lens)  # noqa: E731
                fused = lambda: int8_decode_attention(q, kq, ks, vq, vs, lens)  # noqa: E731
                name16 = f"{_dt(dtype)} decode"
            else:
                fp16 = lambda: decode_attention_ref(q, k, v, lens)  # noqa: E731
                fused = lambda: int8_decode_attention_ref(q, kq, ks, vq, vs, lens)  # noqa: E731
                name16 = f"{_dt(dtype)} decode_attention_ref"
            two_step = lambda: grouped_decode_attention(  # noqa: E731
                q, dequantize_int8(kq, ks[..., None], dtype), dequantize_int8(vq, vs[..., None], dtype), lens)
            ks_ = {name16: Kernel(fp16, ctx.gpu or not timed, b16),
                   ("int8 decode (fused dequant)" if ctx.gpu or not timed else "int8_decode_attention_ref"):
                       Kernel(fused, ctx.gpu or not timed, b8)}
            if ctx.gpu:
                ks_["dequantize, then fp16 decode"] = Kernel(two_step, True, deq)
            return ks_

        kvb = _kv_bytes(B, H_KV, S, D, 2)
        return Point("int8", {"B": B, "H": H, "H_KV": H_KV, "S": S, "T": 1, "D": D, "dtype": _dt(dtype)}, build,
                     curve=("int8", H, H_KV, D, B, timed), headline=kvb >= HEADLINE_KV_BYTES,
                     need_bytes=kvb * 2, timed=timed)

    for H, H_KV, D, B, S in _shapes(ctx, "int8"):
        yield point(H, H_KV, D, B, S, ctx.dtype, True)
    if not ctx.gpu:
        yield point(8, 2, 64, 2, 300, ctx.check_dtype, False)


# --------------------------------------------------------------------------------------------
# grouped: one program per K/V head for its whole query group vs repeating K/V
# --------------------------------------------------------------------------------------------


def grouped(ctx: Ctx) -> Iterator[Point]:
    from ..cache import decode_attention, decode_attention_ref
    from ..gqa import grouped_decode_attention, grouped_decode_attention_ref, repeat_kv

    def point(H, H_KV, D, B, S, dtype, timed):
        n_rep = H // H_KV

        def build():
            q, k, v, lens = _kv(ctx, B, H, H_KV, S, D, dtype)
            nbytes = _kv_bytes(B, H_KV, S, D, k.element_size()) + 2 * q.nbytes
            rep_bytes = nbytes + 2 * n_rep * _kv_bytes(B, H_KV, S, D, k.element_size())  # + write and read the copy
            dec = decode_attention if ctx.gpu else decode_attention_ref
            name = "repeat K/V + decode" if ctx.gpu else "repeat K/V + decode_attention_ref"
            ks = {name: Kernel(lambda: dec(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), lens), ctx.gpu, rep_bytes)}
            if ctx.gpu or not timed:
                ks["per-query-head decode"] = Kernel(lambda: decode_attention(q, k, v, lens), True, nbytes)
                ks["grouped decode"] = Kernel(lambda: grouped_decode_attention(q, k, v, lens), True, nbytes)
            else:
                ks["grouped_decode_attention_ref"] = Kernel(lambda: grouped_decode_attention_ref(q, k, v, lens),
                                                            False, nbytes)
            return ks

        kvb = _kv_bytes(B, H_KV, S, D, torch.empty((), dtype=dtype).element_size())
        return Point("grouped", {"B": B, "H": H, "H_KV": H_KV, "S": S, "T": 1, "D": D, "dtype": _dt(dtype)}, build,
                     curve=("grouped", H, H_KV, D, B, timed), headline=kvb >= HEADLINE_KV_BYTES,
                     need_bytes=int(kvb * 1.1), timed=timed)  # repeat K/V needs n_rep x more: that row alone runs out

    for H, H_KV, D, B, S in _shapes(ctx, "grouped"):
        yield point(H, H_KV, D, B, S, ctx.dtype, True)
    if not ctx.gpu:
        yield point(8, 2, 64, 2, 300, ctx.check_dtype, False)


# --------------------------------------------------------------------------------------------
# store: writing T new tokens' K/V into the caches (prefill-sized writes)
# --------------------------------------------------------------------------------------------


def store(ctx: Ctx) -> Iterator[Point]:
    from ..cache import store_kv, store_kv_ref
    from ..paged import store_paged, store_paged_ref
    from ..quant import store_kv_int8, store_kv_int8_ref

    H_KV, D, bs = 8, 128, 16

    def point(B, T, dtype, timed, D=D, H_KV=H_KV):
        def build():
            kn = _randn(B, H_KV, T, D, dtype=dtype, device=ctx.device)
            vn = _randn(B, H_KV, T, D, dtype=dtype, device=ctx.device)
            S_max = T + 7  # written at an odd offset
            start = torch.full((B,), 7, dtype=torch.int64, device=ctx.device)
            kc, vc, kc0, vc0 = (torch.zeros(B, H_KV, S_max, D, dtype=dtype, device=ctx.device) for _ in range(4))
            n_blocks = B * math.ceil(S_max / bs)
            kb, vb = (torch.zeros(n_blocks, bs, H_KV, D, dtype=dtype, device=ctx.device) for _ in range(2))
            slots = torch.randperm(n_blocks * bs, device=ctx.device)[: B * T]  # scattered rows
            kp, vp = (t.transpose(1, 2).reshape(B * T, H_KV, D).contiguous() for t in (kn, vn))  # (N, H_KV, D)
            kq, vq = (torch.zeros(B, H_KV, S_max, D, dtype=torch.int8, device=ctx.device) for _ in range(2))
            ksc, vsc = (torch.ones(B, H_KV, S_max, dtype=torch.float16, device=ctx.device) for _ in range(2))
            b16 = 2 * (kn.nbytes + vn.nbytes)  # read the new rows, write them
            b8 = kn.nbytes + vn.nbytes + 2 * B * H_KV * T * (D + 2)  # read fp16/fp32, write int8 + fp16 scale

            def torch_copy():
                kc0[:, :, 7:7 + T] = kn
                vc0[:, :, 7:7 + T] = vn
                return kc0[:, :, 7:7 + T]

            triton = ctx.gpu or not timed
            written = lambda: kc[:, :, 7:7 + T]  # noqa: E731
            paged_rows = lambda: kb.view(-1, H_KV, D)[slots]  # noqa: E731
            int8_rows = lambda: kq[:, :, 7:7 + T].float() * ksc[:, :, 7:7 + T, None].float()  # noqa: E731
            ks = {"torch slice copy": Kernel(torch_copy, False, b16)}
            names = ("store_kv", "store_paged (block 16)", "store_kv_int8") if triton else \
                    ("store_kv_ref", "store_paged_ref (block 16)", "store_kv_int8_ref")
            fns = (store_kv, store_paged, store_kv_int8) if triton else (store_kv_ref, store_paged_ref, store_kv_int8_ref)
            ks[names[0]] = Kernel(lambda: fns[0](kc, vc, kn, vn, start), triton, b16, result=written)
            ks[names[1]] = Kernel(lambda: fns[1](kb, vb, kp, vp, slots), triton, b16 + slots.nbytes, result=paged_rows,
                                  expected="new rows")
            ks[names[2]] = Kernel(lambda: fns[2](kq, ksc, vq, vsc, kn, vn, start), triton, b8, result=int8_rows,
                                  expected="new K", tol=float(kn.abs().max()) / 127 * 0.6 + 1e-3)  # half a step + fp16 scale rounding
            ks["new rows"] = Kernel(lambda: kp, False, None)  # the expected contents (not timed)
            ks["new K"] = Kernel(lambda: kn.float(), False, None)
            return ks

        elt = torch.empty((), dtype=dtype).element_size()
        return Point("store", {"B": B, "H_KV": H_KV, "T": T, "D": D, "block_size": bs, "dtype": _dt(dtype)}, build,
                     curve=("store", timed), headline=T >= 16384, need_bytes=12 * B * H_KV * T * D * elt, timed=timed)

    for T in ctx.sizes["store"]["tokens"]:
        yield point(1, T, ctx.dtype, True)
    if not ctx.gpu:
        yield point(2, 37, ctx.check_dtype, False, D=64, H_KV=2)


# --------------------------------------------------------------------------------------------
# memory: bytes a cache holds per context length, formula vs measured
# --------------------------------------------------------------------------------------------


def memory(ctx: Ctx) -> Iterator[Point]:
    from ..cache import KVCache
    from ..memory import kv_cache_bytes
    from ..paged import PagedKVCache
    from ..quant import Int8KVCache

    L, H_KV, D, bs = 4, 8, 128, 16
    for S in ctx.sizes["memory"]["ctx"]:
        caches = {
            "KVCache fp16, H_KV=8": (lambda S=S: KVCache(L, 1, H_KV, S, D, torch.float16, ctx.device),
                                     kv_cache_bytes(L, H_KV, D, S, 1, "fp16")),
            "KVCache fp16, H_KV=32 (MHA)": (lambda S=S: KVCache(L, 1, 32, S, D, torch.float16, ctx.device),
                                            kv_cache_bytes(L, 32, D, S, 1, "fp16")),
            "Int8KVCache, H_KV=8": (lambda S=S: Int8KVCache(L, 1, H_KV, S, D, ctx.device),
                                    kv_cache_bytes(L, H_KV, D, S, 1, "int8") + 2 * L * H_KV * S * 2),
            "PagedKVCache block 16, H_KV=8": (
                lambda S=S: PagedKVCache(L, math.ceil(S / bs), bs, H_KV, D, torch.float16, ctx.device),
                kv_cache_bytes(L, H_KV, D, math.ceil(S / bs) * bs, 1, "fp16")),
        }
        for name, (make, predicted) in caches.items():
            def build(make=make, name=name):
                holder = {}

                def measure():
                    holder["cache"] = make()

                used = peak_memory_bytes(measure)  # GPU: bytes the allocator handed out
                if used is None:  # CPU: no peak counter; count the cache's tensors (exact for what we allocate)
                    c = make()
                    used = tensor_bytes([c.k, c.v, getattr(c, "k_scale", []), getattr(c, "v_scale", [])])
                holder.clear()
                return [{"kernel": name, "memory_bytes": used, "status": "ok"}]

            yield Point("memory", {"B": 1, "H_KV": 32 if "MHA" in name else H_KV, "S": S, "D": D, "dtype":
                                   "int8" if "Int8" in name else "float16",
                                   "block_size": bs if "Paged" in name else None}, build,
                        curve=("memory", name), need_bytes=2 * predicted, timed=False,
                        extra={"predicted_bytes": predicted})


# --------------------------------------------------------------------------------------------
# engine: continuous batching on the paged cache vs static batching, throughput vs load
# --------------------------------------------------------------------------------------------


def _one_thread(fn):
    """fn with one torch thread (CPU timing): on a 2-core machine busy elsewhere, a second thread makes a CPU
    attention call up to 50x slower at random (measured: 5 ms calls timed at 250 ms), and an engine step up to
    10x, which would be the curve and the ratios."""
    def wrapped():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn()
        finally:
            torch.set_num_threads(threads)
    return wrapped


def engine_trace(w: dict, vocab_size: int, seed: int = 0) -> list[dict]:
    """The sweep's trace at load 1: per request its prompt (token ids), new tokens and arrival time in
    engine steps. Lengths are log-normal (sigma 0.8: most short, a few long) around w's medians, at
    least 2 and at most the caps; prompts are byte slices of kvlib's own docstrings (text the tiny
    model has seen the like of). Arrivals are a Poisson process of rate 1 per step; a load L divides
    the times by L, so every load serves the same requests in the same order."""
    from .. import engine as _engine, generate as _generate, paged as _paged

    text = "\n".join(m.__doc__ or "" for m in (_engine, _generate, _paged)).encode("utf-8", "replace")
    gen = torch.Generator().manual_seed(seed)
    n = w["requests"]

    def lengths(median, cap):
        z = torch.randn(n, generator=gen)
        return [int(min(cap, max(2, round(median * math.exp(0.8 * float(x)))))) for x in z]

    prompts, outputs = lengths(*w["prompt"]), lengths(*w["output"])
    gaps = torch.empty(n).exponential_(1.0, generator=gen)
    arrivals = torch.cumsum(gaps, 0) - gaps[0]  # the first request arrives at step 0
    trace = []
    for p, o, t in zip(prompts, outputs, arrivals.tolist()):
        start = int(torch.randint(0, len(text) - p, (1,), generator=gen))
        trace.append({"prompt": [b % vocab_size for b in text[start:start + p]], "new": o, "arrival": t})
    return trace


def _quantile(vals, q):
    """The q-quantile (linear interpolation between order statistics), None for no values."""
    vals = [v for v in vals if v is not None]
    return float(torch.tensor(vals, dtype=torch.float64).quantile(q)) if vals else None


def _serve(model, trace, w, load, kernels):
    """The trace at this load through a fresh Engine: (outputs by request, metrics by request, wall s)."""
    from ..engine import Engine

    eng = Engine(model, w["num_blocks"], w["block_size"], max_num_seqs=w["max_num_seqs"],
                 max_batched_tokens=w["max_batched_tokens"], kernels=kernels)
    order = sorted(range(len(trace)), key=lambda i: trace[i]["arrival"])
    ids, nxt = {}, 0
    t0 = time.perf_counter()
    while nxt < len(order) or eng.has_unfinished():
        while nxt < len(order) and trace[order[nxt]]["arrival"] / load <= eng.clock:  # arrived by this step
            i = order[nxt]
            ids[i] = eng.add_request(trace[i]["prompt"], trace[i]["new"])
            nxt += 1
        eng.step()  # with nothing to do (waiting for an arrival) a step computes nothing and costs ~nothing
    if runtime.DEVICE == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    out = {i: eng.requests[rid].output for i, rid in ids.items()}
    return out, {i: eng.metrics(rid) for i, rid in ids.items()}, wall


def _static(model, trace, w, kernels):
    """Static batching: the requests in arrival order, max_num_seqs at a time, each batch through
    ``generate`` to its longest output (the others wait, their extra tokens thrown away); all requests
    are taken as present from the start (the baseline's best case for throughput; its TTFT and TPOT are
    not measured). Returns the wall seconds."""
    from ..generate import generate

    order = sorted(range(len(trace)), key=lambda i: trace[i]["arrival"])
    t0 = time.perf_counter()
    for s in range(0, len(order), w["max_num_seqs"]):
        batch = order[s:s + w["max_num_seqs"]]
        generate(model, [trace[i]["prompt"] for i in batch], max(trace[i]["new"] for i in batch),
                 kernels=kernels)  # (B, N): each request keeps its first trace[i]["new"] tokens
    if runtime.DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def engine(ctx: Ctx) -> Iterator[Point]:
    from ..generate import generate
    from ..model import load_tiny

    w = ctx.sizes["engine"]
    kernels = "triton" if ctx.gpu else "torch"  # CPU: the interpreter would time Python, not the engine
    state = {}  # the model, trace, references and static baseline, shared by the points

    def setup():
        if not state:
            model, _ = load_tiny(device=ctx.device)
            trace = engine_trace(w, model.config.vocab_size)
            need = max(-(-(len(r["prompt"]) + r["new"] - 1) // w["block_size"]) for r in trace)
            state.update(model=model, trace=trace, w={**w, "num_blocks": max(w["num_blocks"], need)})
            # the references: generate alone, on a paged cache with the same kernels (on a GPU, other kernels
            # could round differently and flip a near-tied argmax); they also run the model once before
            # anything is timed
            state["alone"] = [generate(model, [r["prompt"]], r["new"], cache="paged", kernels=kernels)[0].tolist()
                              for r in trace]
            if runtime.DEVICE == "cuda":  # Triton compiles each kernel specialization at its first call
                _serve(model, trace[:4], state["w"], 1.0, kernels)  # the engine's batched forwards
                _static(model, trace[: w["max_num_seqs"]], state["w"], kernels)  # the contiguous cache's kernels
            state["static"] = _static(model, trace, state["w"], kernels)
        return state

    def row(kernel, tokens, wall, mets, mismatches, n, **more):
        ttft = [m["ttft_s"] * 1e3 for m in mets]
        tpot = [m["tpot_s"] * 1e3 for m in mets if m["tpot_s"] is not None]
        status = "ok" if not mismatches else f"MISMATCH: {mismatches} of {n} requests differ from generate alone"
        return {"kernel": kernel, "tokens_per_s": tokens / wall, "ttft_p50_ms": _quantile(ttft, 0.5),
                "ttft_p99_ms": _quantile(ttft, 0.99), "tpot_p50_ms": _quantile(tpot, 0.5),
                "tpot_p99_ms": _quantile(tpot, 0.99), "status": status, **more}

    for load in w["loads"]:
        def build(load=load):
            st = setup()
            trace, alone = st["trace"], st["alone"]
            tokens = sum(r["new"] for r in trace)
            s_wall = st["static"]  # static batching is generate itself (batched): nothing to check
            out, mets, wall = _serve(st["model"], trace, st["w"], load, kernels)
            bad = sum(out[i] != alone[i] for i in range(len(trace)))
            static = row("static batching (generate)", tokens, s_wall, [], 0, len(trace), preemptions=0)
            eng = row("engine (continuous batching)", tokens, wall, list(mets.values()), bad, len(trace),
                      preemptions=sum(m["preemptions"] for m in mets.values()), baseline=static["kernel"],
                      vs_baseline=tokens / wall / static["tokens_per_s"])
            return [static, eng]

        if not ctx.gpu:  # CPU: one torch thread (see _one_thread)
            build = _one_thread(build)
        yield Point("engine", {"B": w["max_num_seqs"], "block_size": w["block_size"],
                               "dtype": _dt(torch.float32)}, build, curve=("engine",), timed=False,
                    extra={"load": float(load), "requests": w["requests"]})


# in run order: the roofline first, then the decode-side kernels the targets are about (a time budget
# that runs out cuts the end of this list)
# --------------------------------------------------------------------------------------------
# keepless (chapter 09): decode over a budget of held rows (index layout) and over 2-bit KIVI codes
# --------------------------------------------------------------------------------------------


def _kivi_inputs(ctx, B, H_KV, S, D, dtype, group=32, residual=32, v_group=32):
    """Random 2-bit codes (packed), fp16 scales / zeros and exact windows, laid out as KiviCache holds S
    positions: the values' window the ``residual`` newest, the keys' the newest S - group * ceil((S - residual)
    / group); value scales per (token, group of ``v_group`` channels)."""
    gen = torch.Generator(device=ctx.device).manual_seed(1)
    v_group = v_group if D % v_group == 0 else D
    n_vq = max(0, S - residual)
    n_kq = (n_vq + group - 1) // group * group
    codes = lambda n: torch.randint(0, 256, (B, H_KV, n, D // 4), dtype=torch.uint8, device=ctx.device,  # noqa: E731
                                    generator=gen)
    small = lambda *shape: (0.01 + 0.02 * torch.rand(*shape, device=ctx.device, generator=gen)).half()  # noqa: E731
    kp, vp = codes(n_kq), codes(n_vq)
    ks, kz = small(B, H_KV, n_kq // group, D), -small(B, H_KV, n_kq // group, D)
    vs, vz = small(B, H_KV, n_vq, D // v_group), -small(B, H_KV, n_vq, D // v_group)
    k_res = _randn(B, H_KV, S - n_kq, D, dtype=dtype, device=ctx.device)
    v_res = _randn(B, H_KV, S - n_vq, D, dtype=dtype, device=ctx.device)
    lens = lambda n: torch.full((B,), n, dtype=torch.int32, device=ctx.device)  # noqa: E731
    args = (kp, ks, kz, lens(n_kq), k_res, lens(S - n_kq), vp, vs, vz, lens(n_vq), v_res, lens(S - n_vq), group)
    nbytes = kp.nbytes + vp.nbytes + ks.nbytes + kz.nbytes + vs.nbytes + vz.nbytes + k_res.nbytes + v_res.nbytes
    return args, nbytes


def keepless(ctx: Ctx) -> Iterator[Point]:
    from ..cache import decode_attention, decode_attention_ref
    from ..evict import index_decode_attention, index_decode_attention_ref
    from ..kivi import kivi_decode_attention, kivi_decode_attention_ref

    def point(H, H_KV, D, B, S, dtype, timed):
        kernels = ctx.gpu or not timed

        def build():
            q, k, v, lens = _kv(ctx, B, H, H_KV, S, D, dtype)
            full = _kv_bytes(B, H_KV, S, D, k.element_size()) + 2 * q.nbytes
            gen = torch.Generator().manual_seed(0)
            everything = torch.arange(S, device=ctx.device).expand(B, H_KV, S).contiguous()  # identity index
            budget = max(1, S // 8)
            kept = torch.stack([torch.stack([torch.randperm(S, generator=gen)[:budget] for _ in range(H_KV)])
                                for _ in range(B)]).sort(-1).values.to(ctx.device)  # (B, H_KV, S / 8) random slots
            n_all = torch.full((B,), S, dtype=torch.int64, device=ctx.device)
            n_kept = torch.full((B,), budget, dtype=torch.int64, device=ctx.device)
            kivi_args, kivi_bytes = _kivi_inputs(ctx, B, H_KV, S, D, dtype)
            index_bytes = lambda n: _kv_bytes(B, H_KV, n, D, k.element_size()) + B * H_KV * n * 8 + 2 * q.nbytes  # noqa: E731
            dec, idx, kivi = ((decode_attention, index_decode_attention, kivi_decode_attention) if kernels else
                              (decode_attention_ref, index_decode_attention_ref, kivi_decode_attention_ref))
            suffix = "" if kernels else " (ref)"
            ks = {f"{_dt(dtype)} decode, all S{suffix}": Kernel(lambda: dec(q, k, v, lens), kernels, full),
                  f"index decode, all S{suffix}": Kernel(lambda: idx(q, k, v, everything, n_all), kernels,
                                                         index_bytes(S)),
                  f"index decode, S/8 held{suffix}": Kernel(lambda: idx(q, k, v, kept, n_kept), kernels,
                                                            index_bytes(budget), expected="expected: S/8 held"),
                  f"KIVI 2-bit decode{suffix}": Kernel(lambda: kivi(q, *kivi_args), kernels, kivi_bytes + 2 * q.nbytes,
                                                       expected="expected: KIVI 2-bit"),
                  # expected values only (no bytes: computed once, not timed), from the references
                  "expected: S/8 held": Kernel(lambda: index_decode_attention_ref(q, k, v, kept, n_kept), False, None),
                  "expected: KIVI 2-bit": Kernel(lambda: kivi_decode_attention_ref(q, *kivi_args), False, None)}
            return ks

        kvb = _kv_bytes(B, H_KV, S, D, torch.empty((), dtype=dtype).element_size())
        return Point("keepless", {"B": B, "H": H, "H_KV": H_KV, "S": S, "T": 1, "D": D, "dtype": _dt(dtype)}, build,
                     curve=("keepless", H, H_KV, D, B, timed), need_bytes=int(kvb * 1.6), timed=timed)

    for H, H_KV, D, B, S in _shapes(ctx, "keepless"):
        yield point(H, H_KV, D, B, S, ctx.dtype, True)
    if not ctx.gpu:
        yield point(8, 2, 64, 2, 320, ctx.check_dtype, False)


# --------------------------------------------------------------------------------------------
# sparse (chapter 11): Quest's decode reading only the selected blocks, vs the dense decode over all S
# --------------------------------------------------------------------------------------------


def sparse(ctx: Ctx) -> Iterator[Point]:
    """Quest's sparse decode at fixed token budgets (positions each query head reads, blocks of 16, the current
    block included), over a contiguous cache and through a block table (pools built as the paged sweep builds
    them), against chapter 03's dense decode over the whole cache (the baseline) and chapter 05's paged decode.
    The selection (the bound over every block's summaries, then the top blocks) is its own row per budget,
    compared with nothing: the sparse rows' times exclude it. Bytes: what each call must read at least; the
    sparse kernel's are the distinct rows the query heads of each K/V head selected (their union: the kernel's
    programs are per query head and re-read shared rows, from L2, as chapter 03's decode does), the selection
    and q, and the output written; the selection's are every block's (kmin, kmax), q, and the selection written.
    Every sparse output is checked against ``sparse_decode_attention_ref``."""
    from ..cache import decode_attention, decode_attention_ref
    from ..paged import paged_decode_attention, paged_decode_attention_ref
    from ..sparse import (block_summaries, block_upper_bound, select_blocks, sparse_decode_attention,
                          sparse_decode_attention_ref)

    bs = 16

    def point(H, H_KV, D, B, S, dtype, timed, budgets, lens_list=None):
        kernels = ctx.gpu or not timed
        nb = -(-S // bs)

        def build():
            q, k, v, lens = _kv(ctx, B, H, H_KV, S, D, dtype)
            if lens_list is not None:
                lens = torch.tensor(lens_list, dtype=torch.int32, device=ctx.device)
            kmin, kmax = block_summaries(k, lens, bs)  # (B, H_KV, nb, D)
            gen = torch.Generator(device=ctx.device).manual_seed(0)
            perm = torch.randperm(B * nb, device=ctx.device, generator=gen)
            kb, vb, tables = _to_blocks(k, bs, perm), _to_blocks(v, bs, perm), perm.view(B, nb).to(torch.int32)
            row = H_KV * D * k.element_size()  # one position's K (or V), all K/V heads
            full = 2 * int(lens.sum()) * row + 2 * q.nbytes
            fill = (lens.long()[:, None] - torch.arange(nb, device=ctx.device) * bs).clamp(0, bs)  # (B, nb) rows

            def rows_read(sel):  # distinct rows per K/V head: the union of its query heads' selected blocks
                chosen = torch.zeros(B, H, nb + 1, dtype=torch.bool, device=ctx.device)
                chosen.scatter_(-1, sel.masked_fill(sel < 0, nb), True)  # -1 padding: the spare column
                union = chosen[..., :nb].view(B, H_KV, H // H_KV, nb).any(2)  # (B, H_KV, nb)
                return int((union * fill[:, None]).sum())

            dec, pdec, sp = ((decode_attention, paged_decode_attention, sparse_decode_attention) if kernels else
                             (decode_attention_ref, paged_decode_attention_ref, sparse_decode_attention_ref))
            sfx = "" if kernels else " (ref)"
            ks = {"decode_attention_ref": Kernel(lambda: decode_attention_ref(q, k, v, lens), False, full)} \
                if not timed else {}  # the interpreter's point: the dense kernels checked against the reference too
            ks[f"{_dt(dtype)} decode, all S{sfx}"] = Kernel(lambda: dec(q, k, v, lens), kernels, full)
            ks[f"paged decode, all S{sfx}"] = Kernel(lambda: pdec(q, kb, vb, tables, lens), kernels,
                                                     full + tables.nbytes)
            for n in (budget // bs for budget in budgets):
                select = lambda n=n: select_blocks(block_upper_bound(q, kmin, kmax), lens, bs, n)  # noqa: E731
                sel = select()  # (B, H, n_sel) logical block ids, -1 padding
                read = 2 * rows_read(sel) * D * k.element_size() + sel.nbytes + 2 * q.nbytes
                ks[f"select {n} blocks (bound + top)"] = Kernel(select, False, kmin.nbytes + kmax.nbytes + q.nbytes
                                                                 + sel.nbytes, compare=False)
                ks[f"sparse decode, {n} blocks{sfx}"] = Kernel(
                    lambda sel=sel: sp(q, k, v, sel, lens, block_size=bs), kernels, read, expected=f"expected: {n}")
                ks[f"sparse decode paged, {n} blocks{sfx}"] = Kernel(
                    lambda sel=sel: sp(q, kb, vb, sel, lens, block_tables=tables), kernels, read + tables.nbytes,
                    expected=f"expected: {n}")
                ks[f"expected: {n}"] = Kernel(  # an expected value only (computed once, not timed)
                    lambda sel=sel: sparse_decode_attention_ref(q, k, v, sel, lens, block_size=bs), False, None)
            return ks

        kvb = _kv_bytes(B, H_KV, S, D, torch.empty((), dtype=dtype).element_size())
        return Point("sparse", {"B": B, "H": H, "H_KV": H_KV, "S": S, "T": 1, "D": D, "dtype": _dt(dtype),
                                "block_size": bs}, build, curve=("sparse", H, H_KV, D, B, timed),
                     headline=kvb >= HEADLINE_KV_BYTES, need_bytes=int(kvb * 3), timed=timed)

    for H, H_KV, D, B, S in _shapes(ctx, "sparse"):
        yield point(H, H_KV, D, B, S, ctx.dtype, True, ctx.sizes["sparse"]["budgets"])
    if not ctx.gpu:  # S not a multiple of 16, partly filled last blocks, a sequence shorter than the budget (-1
        # padding), 1, 2, 4 and 8 query heads per K/V head, a head dim not a power of two, fp16 and fp32
        yield point(4, 4, 32, 2, 100, torch.float32, False, [48], lens_list=[100, 20])
        yield point(4, 2, 40, 1, 77, torch.float32, False, [32])
        yield point(8, 2, 64, 2, 300, ctx.check_dtype, False, [80], lens_list=[300, 237])
        yield point(8, 1, 64, 1, 200, ctx.check_dtype, False, [64], lens_list=[181])


# --------------------------------------------------------------------------------------------
# ragged (chapter 08): one fused call per serving step vs the separate calls it replaces
# --------------------------------------------------------------------------------------------


def _ragged_step(ctx, H, H_KV, D, bs, dec_lens, chunk, past, dtype):
    """A serving step over one block pool: a decode token for each of len(dec_lens) sequences (sequence i
    holds dec_lens[i] positions, its new token included), then, when chunk > 0, one prefill chunk of ``chunk``
    tokens after ``past`` cached positions; every sequence's blocks at random places in the pool, its K/V
    (the new tokens' included) already stored. Returns q (N, H, D), the pools, block tables (-1 where
    unused), cu_seqlens_q and seq_lens, as ``ragged_paged_attention`` takes them."""
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    lens = list(dec_lens) + ([past + chunk] if chunk else [])
    counts = [1] * len(dec_lens) + ([chunk] if chunk else [])
    n_blocks = [-(-L // bs) for L in lens]
    perm = torch.randperm(sum(n_blocks), device=ctx.device, generator=gen).to(torch.int32)
    tables = torch.full((len(lens), max(n_blocks)), -1, dtype=torch.int32, device=ctx.device)
    for i, (start, nb) in enumerate(zip([0, *torch.tensor(n_blocks).cumsum(0).tolist()], n_blocks)):
        tables[i, :nb] = perm[start:start + nb]
    kb, vb = (_randn(sum(n_blocks), bs, H_KV, D, dtype=dtype, device=ctx.device, gen=gen) for _ in range(2))
    q = _randn(sum(counts), H, D, dtype=dtype, device=ctx.device, gen=gen)
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=ctx.device)
    return q, kb, vb, tables, cu, torch.tensor(lens, dtype=torch.int32, device=ctx.device)


def _gather_seq(k_blocks, v_blocks, table, L):
    """One sequence's first L positions out of the pools, (1, H_KV, L, D) views of gathered copies: what the
    engine's prefill branch did before the fused step (``paged._PagedBatch.attend``)."""
    bs = k_blocks.shape[1]
    pos = torch.arange(L, device=k_blocks.device)
    blocks = table.long()[pos // bs]
    return (k_blocks[blocks, pos % bs].permute(1, 0, 2)[None], v_blocks[blocks, pos % bs].permute(1, 0, 2)[None])


def ragged(ctx: Ctx) -> Iterator[Point]:
    """The fused step (``kvlib.ragged.ragged_paged_attention``: B decodes and a prefill chunk in one call) against
    the calls the engine made before it: ``paged_decode_attention`` for the decodes, then causal
    ``flash_attention`` for the chunk over its K/V. The baseline gets the chunk's K/V as a contiguous copy made
    before the timing (the separate kernels at their best); a second row times the engine's old path whole,
    gathering them out of the pool in every call. Decode-only steps (no chunk: the common case) compare the fused
    call with ``paged_decode_attention`` alone. Every output is checked against the baseline's.

    Shape columns: B decodes, each at context S (its new token included); the chunk (C tokens) follows
    P = S cached positions; T = the step's new tokens B + C (B without a chunk). Bytes: the unique K/V of the
    step (B * S + P + C positions) read once, q read, the output written, the block tables; the engine's old path
    adds the gathered copy of the chunk's K/V (written, then read). tflops: 4 * H * D * (B * S + C * P + C^2 / 2)
    (as ``prefill_flops``, causal counted as half the dense square). CPU: the timed PyTorch paths run with one
    torch thread (``_one_thread``), as the engine sweep's do."""
    from ..attention import attention_ref, flash_attention
    from ..paged import paged_decode_attention, paged_decode_attention_ref
    from ..ragged import ragged_paged_attention, ragged_paged_attention_ref

    def point(H, H_KV, D, dec_lens, chunk, past, dtype, timed, bs=16):
        B, S, past = len(dec_lens), max(dec_lens), past if chunk else 0  # no chunk: no cached prefix of one
        kernels = ctx.gpu or not timed  # the Triton kernels (CPU: once, in the interpreter, untimed)
        elt = torch.empty((), dtype=dtype).element_size()
        kv = 2 * (sum(dec_lens) + past + chunk) * H_KV * D * elt  # the step's unique K/V
        chunk_kv = 2 * (past + chunk) * H_KV * D * elt
        N = B + chunk

        def build():
            q, kb, vb, tables, cu, lens = _ragged_step(ctx, H, H_KV, D, bs, dec_lens, chunk, past, dtype)
            nbytes = kv + 2 * q.nbytes + tables.nbytes
            dec = paged_decode_attention if kernels else paged_decode_attention_ref
            att = flash_attention if kernels else attention_ref
            fused = ragged_paged_attention if kernels else ragged_paged_attention_ref
            sfx = "" if kernels else " (ref)"
            ks = {}
            if not timed:  # the interpreter's point: every timed name checked against the reference
                ks["ragged_paged_attention_ref"] = Kernel(
                    lambda: ragged_paged_attention_ref(q, kb, vb, tables, cu, lens), False, nbytes)
            q_dec, t_dec, lens_dec = q[:B], tables[:B, :-(-S // bs)].contiguous(), lens[:B]
            if not chunk:
                ks[f"paged decode (decodes only){sfx}"] = Kernel(lambda: dec(q_dec, kb, vb, t_dec, lens_dec), kernels,
                                                                 nbytes)
                ks[f"ragged, decodes only{sfx}"] = Kernel(lambda: fused(q, kb, vb, tables, cu, lens), kernels, nbytes)
                return ks
            q_chunk = q[B:].transpose(0, 1)[None]  # (1, H, C, D), a view of the chunk's rows
            k_c, v_c = (t.contiguous() for t in _gather_seq(kb, vb, tables[B], past + chunk))
            out = {}

            def separate(k_chunk, v_chunk):
                out["dec"] = dec(q_dec, kb, vb, t_dec, lens_dec)
                out["chunk"] = att(q_chunk, k_chunk, v_chunk, causal=True)

            def both():  # the two calls' outputs as the fused call lays them out: (N, H, D)
                return torch.cat([out["dec"], out["chunk"][0].transpose(0, 1)])

            ks[f"paged decode + flash (2 calls){sfx}"] = Kernel(lambda: separate(k_c, v_c), kernels, nbytes,
                                                                result=both)
            ks[f"paged decode + gather + flash (engine before){sfx}"] = Kernel(
                lambda: separate(*_gather_seq(kb, vb, tables[B], past + chunk)), kernels, nbytes + 2 * chunk_kv,
                result=both)
            ks[f"ragged, decodes + chunk{sfx}"] = Kernel(lambda: fused(q, kb, vb, tables, cu, lens), kernels, nbytes)
            return ks

        def built():
            ks = build()
            if timed and not ctx.gpu:
                for k in ks.values():
                    k.fn = _one_thread(k.fn)
            return ks

        flops = 4 * H * D * (sum(dec_lens) + chunk * past + chunk * chunk / 2)
        return Point("ragged", {"B": B, "H": H, "H_KV": H_KV, "S": S, "T": N, "D": D, "block_size": bs,
                                "dtype": _dt(dtype)}, built, curve=("ragged", H, H_KV, D, B, chunk, timed),
                     headline=timed and kv >= HEADLINE_KV_BYTES, flops=flops if timed else None,
                     need_bytes=int(1.1 * kv) + 4 * chunk_kv + 4 * N * H * D * elt, timed=timed)

    w = ctx.sizes["ragged"]
    for H, H_KV, D in w["heads"]:
        for B in w["decodes"]:
            for C in w["chunk"]:
                for S in w["ctx"]:
                    yield point(H, H_KV, D, [S] * B, C, S, ctx.dtype, True)
    if not ctx.gpu:  # ragged lengths, partly filled last blocks, a chunk after a cached prefix; then decodes alone
        yield point(4, 2, 40, [37, 100, 201], 45, 70, ctx.check_dtype, False)
        yield point(4, 2, 40, [37, 100, 201], 0, 0, ctx.check_dtype, False)


SWEEPS = {"copy": copy, "decode": decode, "paged": paged, "int8": int8, "grouped": grouped, "store": store,
          "prefill": prefill, "memory": memory, "engine": engine, "keepless": keepless, "ragged": ragged,
          "sparse": sparse}


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _free_bytes() -> int | None:
    if runtime.DEVICE != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info()
    return free


def _max_err(out, ref) -> float | None:
    if not isinstance(out, torch.Tensor) or not isinstance(ref, torch.Tensor) or out.shape != ref.shape:
        return None
    return float((out.float() - ref.float()).abs().max())


FAULT_ENV = "KVLIB_BENCH_FAULT"  # test hook: see _fault


def _fault(sweep: str, points_done: int):
    """The test hook ``KVLIB_BENCH_FAULT=NAME[:abort|hang]``: once the first point of sweep NAME has run
    (and its rows went to ``on_rows``), end this process the way a CUDA fault does (``abort``, the default:
    SIGABRT, exit status 134, nothing after it runs) or hang until killed (``hang``: a stuck kernel, for
    testing timeouts). scripts/gpu_check.sh is tested with it (tests/test_gpu_check.py)."""
    spec = os.environ.get(FAULT_ENV, "")
    name, _, how = spec.partition(":")
    if not spec or name != sweep or points_done != 1:
        return
    how = how or "abort"
    if how not in ("abort", "hang"):
        raise ValueError(f"{FAULT_ENV}={spec!r}: the fault is abort or hang, e.g. {FAULT_ENV}={sweep}:abort")
    what = "aborting" if how == "abort" else "hanging"
    like = "a CUDA fault" if how == "abort" else "a stuck kernel"
    print(f"\n{FAULT_ENV}={spec}: {what} after the first point of {sweep}, as {like} would (test hook)",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    if how == "abort":
        os.abort()
    while True:
        time.sleep(3600)


def plan(names=None, *, quick: bool = False, smoke: bool = False) -> list[tuple[str, int]]:
    """(sweep, number of points) for each named sweep (all by default), in run order, for this machine's
    mode: what ``run`` would measure, counted without allocating or timing anything. scripts/gpu_check.sh
    shares its time budget among the sweeps by these counts."""
    names = list(SWEEPS) if names is None else list(names)
    unknown = [n for n in names if n not in SWEEPS]
    if unknown:
        raise ValueError(f"unknown sweep(s) {unknown}; choose from {list(SWEEPS)}")
    ctx = Ctx(quick, smoke, measure=False)
    return [(n, sum(1 for _ in SWEEPS[n](ctx))) for n in names]


def _error_status(e: BaseException) -> str:
    """'error: RuntimeError: CUDA error: an illegal memory access was encountered' (first line, at most 300 chars)."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"error: {type(e).__name__}: {first}"[:300]


def run(names=None, *, quick: bool = False, smoke: bool = False, budget_s: float | None = None,
        progress: bool = True, ctx: Ctx | None = None, on_rows: Callable[[list[dict]], None] | None = None
        ) -> list[dict]:
    """Run the named sweeps (all by default) and return their result rows (see ``results.COLUMNS``).

    smoke: one point per sweep (the smallest), to check the whole harness in seconds.
    budget_s: stop starting new points after this many seconds (the rest get a "skipped" row).
    ctx: a prepared ``Ctx`` (tests use one to walk the GPU branches with tiny sizes on a CPU).
    on_rows: called with all the rows so far after every point (``python -m kvlib.bench`` rewrites its
    results.csv with them), so a process that dies later still leaves what it measured. An exception other
    than out-of-memory in a point (a bug, or a CUDA error) adds an "error: ..." row for that point, calls
    on_rows once more, and is raised again: after a CUDA fault the context is unusable for the next points.
    """
    from tqdm.auto import tqdm

    names = list(SWEEPS) if names is None else list(names)
    unknown = [n for n in names if n not in SWEEPS]
    if unknown:
        raise ValueError(f"unknown sweep(s) {unknown}; choose from {list(SWEEPS)}")
    torch.manual_seed(0)
    ctx = ctx or Ctx(quick, smoke)
    st = stamp()
    base = {k: st[k] for k in ("device", "mode", "driver", "cuda", "torch", "triton", "date")}
    points = [p for n in names for p in SWEEPS[n](ctx)]
    rows: list[dict] = []
    ended: set = set()
    done: dict = {}  # points run (or skipped) per sweep, for the fault hook

    def complete():
        return [{c: r.get(c) for c in COLUMNS} for r in rows]  # every row has every column

    t_start = time.perf_counter()
    bar = tqdm(points, desc="benchmark points", disable=not progress)
    for p in bar:
        bar.set_postfix_str(f"{p.sweep} {p.shape.get('S') or p.shape.get('T') or ''}")
        shape_row = {**base, "sweep": p.sweep, **p.shape, **p.extra, "headline": int(p.headline)}
        if p.curve in ended:
            continue
        n_rows = len(rows)
        if budget_s is not None and time.perf_counter() - t_start > budget_s:
            rows.append({**shape_row, "status": "skipped: time budget spent"})
        else:
            free = _free_bytes()
            if free is not None and p.need_bytes > 0.9 * free:
                rows.append({**shape_row, "status": f"skipped: needs ~{p.need_bytes / 2**30:.1f} GiB, "
                                                    f"{free / 2**30:.1f} GiB free (curve ends)"})
                ended.add(p.curve)
            else:
                try:
                    rows.extend(_run_point(ctx, p, shape_row))
                except Exception as e:  # noqa: BLE001 - out of memory ends the curve; anything else is a bug
                    if not _is_oom(e):
                        rows.append({**shape_row, "status": _error_status(e)})
                        if on_rows is not None:
                            on_rows(complete())
                        raise
                    rows.append({**shape_row, "status": "out of memory (curve ends)"})
                    ended.add(p.curve)
                finally:
                    if runtime.DEVICE == "cuda":
                        torch.cuda.empty_cache()
        if on_rows is not None and len(rows) > n_rows:
            on_rows(complete())
        done[p.sweep] = done.get(p.sweep, 0) + 1
        _fault(p.sweep, done[p.sweep])
    bar.close()
    return complete()


def _run_point(ctx: Ctx, p: Point, shape_row: dict) -> list[dict]:
    built = p.build()
    if isinstance(built, list):  # memory points: rows measured at build time
        return [{**shape_row, **r} for r in built]
    names = [n for n, k in built.items() if k.bytes_moved is not None]  # timed entries; names[0] is the baseline
    baseline = names[0]
    # entries without bytes are expected values only: compute them first
    outputs = {n: k.fn() for n, k in built.items() if k.bytes_moved is None}
    times, rows = {}, []
    dtype = getattr(torch, str(p.shape.get("dtype", "float32")))
    for name in names:
        k = built[name]
        row = {**shape_row, **k.columns, "kernel": name, "baseline": baseline if name != baseline else None,
               "bytes_moved": k.bytes_moved}
        try:
            out = k.fn()
            if ctx.gpu:
                torch.cuda.synchronize()
            out = k.result() if k.result else out
            outputs[name] = out.clone() if isinstance(out, torch.Tensor) else out
            ref_name = (k.expected or (baseline if name != baseline else None)) if k.compare else None
            err = _max_err(outputs[name], outputs.get(ref_name)) if ref_name else None
            row["max_abs_err"] = err
            tol = k.tol if k.tol is not None else TOL.get(dtype, 2e-2)
            status = "ok" if err is None or err <= tol else f"MISMATCH: max |difference| {err:.3g} > {tol:.3g}"
            if p.timed and (ctx.gpu or not k.triton):
                ms = time_ms(k.fn, **ctx.time_kw)
                times[name] = ms
                row.update(time_ms=ms, gbps=gbps(k.bytes_moved, ms),
                           pct_copy_bw=100 * gbps(k.bytes_moved, ms) / ctx.copy_bw)
                if p.flops:
                    row["tflops"] = p.flops / (ms * 1e-3) / 1e12
                if name != baseline and baseline in times:
                    row["vs_baseline"] = times[baseline] / ms
            elif status == "ok":
                status = "correctness only (interpreter)" if k.triton else "correctness only"
            row["status"] = status
        except Exception as e:  # noqa: BLE001 - out of memory in one kernel (e.g. SDPA repeating K/V)
            if not _is_oom(e):
                raise
            row["status"] = "out of memory"
            if runtime.DEVICE == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    return rows
