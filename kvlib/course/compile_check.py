"""Build every Triton kernel in kvlib for real GPUs, exactly as the JIT would, on a machine without one.

Passing in the interpreter does not prove a kernel compiles: the interpreter runs the kernel body as
NumPy, accepts code the compiler rejects and computes every offset without overflow. So each kernel
module lists ``COMPILE_SPECS``: calls of its public wrapper at a realistic shape. For each spec and
each architecture (sm_75 = T4, sm_80 = A100, sm_90 = H100/H200) this module

1. calls the wrapper on CPU tensors with Triton's launch patched to *record* instead of run, and with
   ``runtime.capability()`` returning the target, so the wrapper picks the tiles it picks on that GPU;
2. builds each recorded launch with Triton's own binder, the way ``kernel[grid](...)`` does at its
   first call: integers below 2³¹ become i32 (larger ones i64), an integer equal to 1 becomes a
   constant, pointers and integers divisible by 16 are marked so (which is what lets the compiler use
   16-byte vector loads and ``cp.async``);
3. reads the machine code: registers, stack and local bytes per thread (spills; we want 0) with
   ``cuobjdump -res-usage`` (shipped inside the triton wheel), the shared memory a launch needs against
   what one block may have there, the TTIR's products of a stride in 32 bits (which overflow once an
   offset passes 2³¹), and the SASS of each innermost loop (``cuobjdump -sass``).

From the loop's instruction count it predicts a ceiling: a streaming multiprocessor issues at most one
warp instruction per clock on each of its 4 schedulers, so a loop whose program (all its warps) reads
``bytes`` per iteration cannot read faster than ``issue rate × bytes / (warps × instructions)``. That
is a prediction from a model, not a timing: memory, latency and occupancy can make a kernel slower,
never faster. ``--predicted FILE`` writes these ceilings next to the course's GPU targets
(``docs/results/predicted.md``), for the first GPU run to compare against.

Run it in a process where Triton is *not* in interpreter mode::

    TRITON_INTERPRET=0 KVLIB_DEVICE=cpu python -m kvlib.course.compile_check [--arch 75 80 90] [--module cache gqa]

``tests/test_compile.py`` does exactly that in a subprocess and fails on any error, spill or 32-bit
stride product. It uses the JIT's own internals (``create_function_from_signature``,
``JITFunction._pack_args``: Triton 3.6 and 3.9 have them, 3.2 does not); on a version without them it says
so instead of guessing.

A spec is a dict: ``name``; ``launch``, a zero-argument callable that calls the wrapper; optional
``archs`` (default all three); optional ``loops``, {kernel name: f(args) -> dict(bytes=..., reread=...,
flops=..., loop=...)} where ``args`` are the recorded launch's arguments by parameter name (plus
``num_warps``): ``bytes`` of K/V one program loads per iteration of its main loop, ``reread`` how many
programs load each K/V element (the query heads per K/V head for a per-head kernel, else 1), ``flops``
per iteration (prefill) and ``loop``, which innermost loop in program order is the steady state
(default: the longest).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# Shared memory one block may use (the opt-in maximum, bytes) per compute capability; CUDA C
# Programming Guide, "Technical Specifications per Compute Capability".
MAX_SHARED = {75: 65536, 80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448}
DEFAULT_ARCHS = (75, 80, 90)  # T4 (free Colab), A100, H100/H200

# The GPU each architecture stands for in the predictions: multiprocessors, boost clock (GHz), memory
# bandwidth (TB/s), dense fp16 tensor-core peak and FP32 peak (TFLOP/s), from NVIDIA's datasheets (T4; A100 80GB SXM;
# H200 SXM). Each multiprocessor has 4 schedulers, each issuing one warp instruction per clock.
GPUS = {
    75: dict(name="T4", sms=40, ghz=1.59, tbps=0.32, fp16_tflops=65, fp32_tflops=8.1),
    80: dict(name="A100-SXM4-80GB", sms=108, ghz=1.41, tbps=2.039, fp16_tflops=312, fp32_tflops=19.5),
    90: dict(name="H200-SXM", sms=132, ghz=1.98, tbps=4.8, fp16_tflops=989, fp32_tflops=67),
}
SCHEDULERS_PER_SM = 4


def issue_rate(arch: int) -> float:
    """Warp instructions per second the whole GPU can issue."""
    g = GPUS[arch]
    return g["sms"] * SCHEDULERS_PER_SM * g["ghz"] * 1e9


def kernel_modules(only=None):
    """Import the kvlib modules that define kernels; yield (module, {name: JITFunction})."""
    import triton

    import kvlib

    for info in sorted(pkgutil.iter_modules(kvlib.__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.name in ("compile_check",) or (only and info.name not in only):
            continue
        source = Path(kvlib.__path__[0], f"{info.name}.py")
        if source.is_file() and "@triton.jit" not in source.read_text(encoding="utf-8"):
            continue  # no kernels: don't import it (kvlib.course.labs needs nbformat, absent on bare GPU images)
        mod = importlib.import_module(f"kvlib.{info.name}")
        kernels = {n: obj for n, obj in vars(mod).items()
                   if isinstance(obj, triton.runtime.jit.JITFunction) and obj.__module__ == mod.__name__}
        if kernels:
            yield mod, kernels


# --------------------------------------------------------------------------------------------
# 1. record the wrapper's launches
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def recording(arch: int):
    """Inside: kernel launches are recorded (kernel, args, kwargs), nothing runs, and the wrappers see
    a GPU of compute capability ``arch`` (tensors stay on the CPU)."""
    from triton.runtime.jit import JITFunction

    from .. import runtime

    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    saved = JITFunction.run, runtime.require_triton, runtime.COMPILE_TARGET
    JITFunction.run = record
    runtime.require_triton = lambda what, **tensors: True
    runtime.COMPILE_TARGET = (arch // 10, arch % 10)
    try:
        yield launches
    finally:
        JITFunction.run, runtime.require_triton, runtime.COMPILE_TARGET = saved


# --------------------------------------------------------------------------------------------
# 2. build as the JIT builds
# --------------------------------------------------------------------------------------------


_BUILT = {}  # one build per (kernel, arch, specialization): specs often launch the same build at other sizes


def jit_compile(kernel, args, kwargs, arch: int):
    """Compile one recorded launch with Triton's binder for ``arch``: what ``kernel[grid](*args, **kwargs)``
    compiles at its first call on that GPU. Returns (compiled kernel, bound arguments by name).

    Launches that the JIT would serve from one build (same signature, constexprs, specialization
    attributes and options) are compiled once per process."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime import jit as triton_jit

    if not (hasattr(triton_jit, "create_function_from_signature") and hasattr(kernel, "_pack_args")):
        raise RuntimeError(f"compile_check builds kernels with the JIT internals of Triton 3.6+; this is Triton "
                           f"{triton.__version__}")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = triton_jit.create_function_from_signature(kernel.signature, kernel.params, backend)
    from triton import knobs

    kwargs = dict(kwargs)  # as JITFunction.run sets them before binding
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, name):
            kwargs[name] = getattr(knobs.compilation, name)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    key = (kernel.fn.__module__, kernel.fn.__qualname__, arch, repr(signature), repr(constexprs), repr(attrs),
           repr(sorted(options.__dict__.items())))
    if key not in _BUILT:
        _BUILT[key] = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                     options=options.__dict__)
    return _BUILT[key], dict(bound)


# --------------------------------------------------------------------------------------------
# 3. read the machine code
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout


@functools.lru_cache(maxsize=None)
def _cubin_loops(cubin: bytes) -> list[dict]:
    """``sass_loops`` of one build, disassembled once (about 0.4 s each; specs often launch the same build)."""
    return sass_loops(_cuobjdump(cubin, "-sass"))


def resource_usage(cubin: bytes) -> dict:
    """Registers, stack-frame and local-memory bytes per thread, read from a cubin with cuobjdump.

    ptxas puts spilled registers in the stack frame (STACK), not in LOCAL, so both must be 0."""
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?LOCAL:(\d+)", _cuobjdump(cubin, "-res-usage"), re.S)
    return {"registers": int(m.group(1)), "stack_bytes": int(m.group(2)),
            "local_bytes": int(m.group(3))} if m else {}


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.+?)\s*;")
_TARGET = re.compile(r"\bBRA(?:\.\w+)*\s+(?:`?\(?(\.L_x_\d+)\)?|(0x[0-9a-f]+))")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def sass_loops(sass: str) -> list[dict]:
    """The innermost loops of a kernel's SASS, in program order: each backward branch closes a loop that
    runs from its target to the branch. Returns [{"start", "end", "instructions", "opcodes"}] where
    instructions counts the loop body once and opcodes tallies it by mnemonic (e.g. HMMA, LDG, FFMA)."""
    instrs, labels = [], {}
    pending = []
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.search(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        for lab in pending:
            labels[lab] = addr
        pending = []
        instrs.append((addr, m.group(2)))
    loops = []
    for addr, text in instrs:
        m = _TARGET.search(text)
        if not m:
            continue
        target = labels.get(m.group(1)) if m.group(1) else int(m.group(2), 16)
        if target is not None and target < addr:
            loops.append((target, addr))
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    out = []
    for start, end in sorted(set(inner)):
        body = [t for a, t in instrs if start <= a <= end]
        ops = {}
        for t in body:
            op = t.split()[1] if t.startswith("@") else t.split()[0]
            op = op.split(".")[0]
            ops[op] = ops.get(op, 0) + 1
        out.append(dict(start=start, end=end, instructions=len(body), opcodes=ops))
    return out


# 32-bit products the rule below flags that are bounded by what they compute (TTIR names follow the source's
# variable names): (pattern, why it cannot pass 2**31).
BOUNDED_I32 = [
    (r"^%start\w* = arith\.muli %split\w*, %split_len\w* : i32$",
     "the first position of a split-K slice: below the sequence's length"),
    (r"^%\w+ = arith\.muli %H_KV\w*, %n_rep\w* : i32$", "query heads: H_KV x n_rep = H"),
]


def i32_stride_products(ttir: str) -> list[str]:
    """TTIR lines that compute an offset in 32 bits that can pass 2³¹: an ``arith.muli`` or ``arith.shli`` of
    i32 (scalar or tensor) with

    - a stride (a ``%stride_*`` argument, or a value computed from strides) as an operand, or
    - two operands that are both unbounded at compile time: integer arguments (sizes standing in for
      strides, as in ``kv_row * S_q``), program ids, loaded values (block tables, lengths), loop
      variables and values computed from these (``pid * n``, ``loaded_slot * D``, ``pos0 * D``).

    Values are followed through every i32 operation, splat, broadcast, expand_dims, loop variables and
    loop-carried values. Not flagged: a product with a compile-time constant (``pid_m * TILE_M``, bounded
    by the length of one dimension, which would itself have to pass 2³¹), and the products ``BOUNDED_I32``
    names with the reason they are bounded."""
    args = set(re.findall(r"(%\w+): i32", ttir))  # integer arguments of every function in the module
    strides = {a for a in args if a.startswith("%stride")}
    unbounded = set(args)
    bad = []
    for line in ttir.splitlines():
        text = line.strip().split(" loc(")[0]
        m = re.match(r"(%[\w#]+)(?::\d+)?\s*=\s*([\w.]+)\s*(.*)", text)
        if not m:
            continue
        result, op, rest = m.groups()
        if op == "scf.for":  # the induction variable and iter_args come from bounds and initial values
            iv = re.match(r"(%[\w#]+)\s*=\s*(%[\w#]+) to (%[\w#]+)", rest)
            inits = re.findall(r"(%[\w#]+) = (%[\w#]+)", rest.split("iter_args", 1)[1]) if "iter_args" in rest else []
            if iv and {iv.group(2), iv.group(3)} & unbounded:
                unbounded.add(iv.group(1))
            for name, init in inits:
                if init in unbounded:
                    unbounded.add(name)
            unbounded.add(result) if {i for _, i in inits} & unbounded else None
            continue
        body, _, types = rest.rpartition(" : ") if " : " in rest else (rest, "", "")
        operands = re.findall(r"%[\w#]+", body)
        out_type = types.split("->")[-1].split(" to ")[-1]
        is_i32 = re.search(r"\bi32\b|xi32>", out_type) is not None
        if op in ("arith.muli", "arith.shli") and is_i32 and len(operands) == 2:
            a, b = operands
            if (a in strides or b in strides or (a in unbounded and b in unbounded)) and not any(
                    re.match(pattern, text) for pattern, _ in BOUNDED_I32):
                bad.append(text)
        if not is_i32:
            continue
        if op in ("tt.get_program_id", "tt.get_num_programs", "tt.load", "arith.trunci"):
            unbounded.add(result)
        elif set(operands) & unbounded:
            unbounded.add(result)
            if set(operands) & strides:
                strides.add(result)
    return bad


# Cycles one warp instruction holds its pipe on one scheduler: an FP32 instruction on sm_75/sm_80 (16 FP32
# lanes per scheduler; 32 on sm_90), an SFU instruction (exp2, reciprocal: 4 lanes per scheduler) anywhere.
FP32_OPS = ("FFMA", "FADD", "FMUL")
FP32_CYCLES = {75: 2, 80: 2, 90: 1}
SFU_CYCLES = 8


def ceiling(row: dict, per_iter: dict, arch: int) -> dict:
    """Ceilings of the chosen loop from its instruction mix: unique K/V bytes per second and FLOP/s.

    One iteration of the program holds each scheduler for the largest of: its instruction count (one
    issue per clock), its FP32 instructions times FP32_CYCLES, its SFU (MUFU) instructions times SFU_CYCLES.
    ``limit`` names which."""
    loops = row["loops"]
    if not loops:
        return {}
    pick = per_iter.get("loop")
    loop = loops[pick] if pick is not None and pick < len(loops) else max(loops, key=lambda lp: lp["instructions"])
    ops = loop["opcodes"]
    cycles = {"instruction issue": loop["instructions"],
              "FP32 pipe": sum(ops.get(o, 0) for o in FP32_OPS) * FP32_CYCLES.get(arch, 1),
              "SFU (exp2)": ops.get("MUFU", 0) * SFU_CYCLES}
    limit = max(cycles, key=cycles.get)
    warp_cycles = row["num_warps"] * cycles[limit]  # scheduler cycles of one iteration of the whole program
    iterations_per_s = issue_rate(arch) / warp_cycles
    out = dict(loop_instructions=loop["instructions"], warps=row["num_warps"], limit=limit,
               tensor_cores=bool(ops.get("HMMA") or ops.get("HGMMA")))
    if per_iter.get("bytes"):
        out.update(bytes_per_iter=per_iter["bytes"], reread=per_iter.get("reread", 1),
                   instructions_per_kb=round(row["num_warps"] * loop["instructions"] / (per_iter["bytes"] / 1024), 1),
                   issue_tbps=round(iterations_per_s * per_iter["bytes"] / per_iter.get("reread", 1) / 1e12, 2))
    if per_iter.get("flops"):
        out.update(flops_per_iter=per_iter["flops"],
                   issue_tflops=round(iterations_per_s * per_iter["flops"] / 1e12, 1))
    return out


# --------------------------------------------------------------------------------------------
# all together
# --------------------------------------------------------------------------------------------


def _dtype(bound: dict) -> str | None:
    import torch

    for name, v in bound.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and name.startswith("q"):
            return str(v.dtype).replace("torch.", "")
    return next((str(v.dtype).replace("torch.", "") for v in bound.values()
                 if isinstance(v, torch.Tensor) and v.is_floating_point()), None)


def check_row(kernel, spec: dict, mod_name: str, arch: int, compiled, bound: dict) -> dict:
    """One result row: resources, 32-bit stride products, SASS loops, the ceiling, and what is wrong."""
    kernel_name = kernel.fn.__name__
    constexprs = {p.name: bound[p.name] for p in kernel.params if p.is_constexpr}
    row = dict(module=mod_name, spec=spec["name"], kernel=kernel_name, arch=f"sm_{arch}", dtype=_dtype(bound),
               constexprs={k: v for k, v in constexprs.items() if isinstance(v, (int, bool, float, str))},
               num_warps=compiled.metadata.num_warps, num_stages=compiled.metadata.num_stages,
               shared_bytes=compiled.metadata.shared)
    row.update(resource_usage(compiled.asm["cubin"]))
    row["i32_stride_products"] = i32_stride_products(compiled.asm["ttir"])
    row["loops"] = _cubin_loops(compiled.asm["cubin"])
    loops_of = spec.get("loops", {}).get(kernel_name)
    if loops_of is not None:
        row["ceiling"] = ceiling(row, loops_of(dict(bound, num_warps=row["num_warps"])), arch)
    errors = []
    spill = row.get("stack_bytes", 0) + row.get("local_bytes", 0)
    if "registers" not in row:
        errors.append("cuobjdump reported no resource usage")
    elif spill:
        errors.append(f"spills: {spill} bytes of stack/local memory per thread")
    limit = MAX_SHARED.get(arch)
    if limit is not None and row["shared_bytes"] > limit:
        errors.append(f"needs {row['shared_bytes']} bytes of shared memory; sm_{arch} allows {limit} per block, "
                      "so the launch would fail")
    if row["i32_stride_products"]:
        errors.append(f"{len(row['i32_stride_products'])} stride product(s) in 32 bits, e.g. "
                      f"{row['i32_stride_products'][0]}")
    if errors:
        row["error"] = "; ".join(errors)
    row["ok"] = not errors
    return row


def compile_all(archs=DEFAULT_ARCHS, only=None) -> list[dict]:
    """Build every module's COMPILE_SPECS for each arch; one row per (spec, recorded launch, arch).

    A kernel that no spec launches is an error row, so a new kernel cannot go unchecked."""
    rows = []
    for mod, kernels in kernel_modules(only):
        built = set()
        for spec in getattr(mod, "COMPILE_SPECS", []):
            if not callable(spec.get("launch")) or "name" not in spec:
                rows.append(dict(module=mod.__name__, spec=spec.get("name"), kernel=None, arch=None, ok=False,
                                 error="a COMPILE_SPECS entry needs a name and a launch (see kvlib.course.compile_check)"))
                continue
            for arch in archs:
                if arch not in spec.get("archs", DEFAULT_ARCHS):
                    continue
                base = dict(module=mod.__name__, spec=spec["name"], arch=f"sm_{arch}")
                try:
                    with recording(arch) as launches:
                        spec["launch"]()
                except Exception as e:
                    rows.append(dict(base, kernel=None, ok=False,
                                     error=f"launch failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"))
                    continue
                if not launches:
                    rows.append(dict(base, kernel=None, ok=False, error="the launch ran no kernel"))
                for kernel, args, kwargs in launches:
                    name = kernel.fn.__name__
                    built.add(name)
                    try:
                        compiled, bound = jit_compile(kernel, args, kwargs, arch)
                        rows.append(check_row(kernel, spec, mod.__name__, arch, compiled, bound))
                    except Exception as e:  # report every failure, not just the first
                        rows.append(dict(base, kernel=name, ok=False,
                                         error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
        for name in sorted(set(kernels) - _called_from(built, kernels)):
            rows.append(dict(module=mod.__name__, spec=None, kernel=name, arch=None, ok=False,
                             error="no COMPILE_SPECS entry of the module launches this kernel (or a kernel "
                                   "that calls it)"))
    return rows


def _called_from(built: set, kernels: dict) -> set:
    """The names in ``kernels`` that were built or are @triton.jit helpers called (directly or through
    another helper) by one that was: a helper is compiled into the kernel that calls it."""
    covered, todo = set(built), [name for name in built if name in kernels]
    while todo:
        src = kernels[todo.pop()].src
        for name in kernels:
            if name not in covered and re.search(rf"\b{re.escape(name)}\s*\(", src):
                covered.add(name)
                todo.append(name)
    return covered


def _config(row) -> str:
    c = {k: v for k, v in row.get("constexprs", {}).items()
         if k.startswith(("TILE", "SPLITS", "GROUP", "BLOCK")) or (k in ("PAGED", "INT8", "CAUSAL") and v)}
    return " ".join(f"{k}={v}" for k, v in c.items()) + f" w={row.get('num_warps', '-')} s={row.get('num_stages', '-')}"


def _loop_text(row) -> str:
    c = row.get("ceiling") or {}
    if not c:
        loops = row.get("loops") or []
        return f"loops={[lp['instructions'] for lp in loops]}" if loops else ""
    parts = [f"loop={c['loop_instructions']}"]
    if "issue_tbps" in c:
        parts.append(f"{c['instructions_per_kb']}/KB -> {c['issue_tbps']} TB/s")
    if "issue_tflops" in c:
        parts.append(f"-> {c['issue_tflops']} TFLOP/s")
    return " ".join(parts)


# --------------------------------------------------------------------------------------------
# docs/results/predicted.md
# --------------------------------------------------------------------------------------------

PREDICTED_COMMAND = ("TRITON_INTERPRET=0 KVLIB_DEVICE=cpu python -m kvlib.course.compile_check "
                     "--predicted docs/results/predicted.md")


def predicted(row: dict, arch: int) -> dict | None:
    """A row's ceiling: the lower of what its loop's instruction mix allows and the datasheet's memory
    bandwidth (for prefill: its dense fp16 tensor-core peak when the loop runs on tensor cores, else its FP32
    peak), and which of them binds."""
    c = row.get("ceiling") or {}
    g = GPUS[arch]
    if "issue_tflops" in c:
        peak, unit = ((g["fp16_tflops"], "tensor cores") if c.get("tensor_cores") else (g["fp32_tflops"], "FP32 peak"))
        if c["issue_tflops"] < peak:
            return dict(value=c["issue_tflops"], unit="TFLOP/s", bound=c["limit"])
        return dict(value=peak, unit="TFLOP/s", bound=unit)
    if "issue_tbps" in c:
        if c["issue_tbps"] < g["tbps"]:
            return dict(value=c["issue_tbps"], unit="TB/s", bound=c["limit"])
        return dict(value=g["tbps"], unit="TB/s", bound="memory")
    return None


def _by_spec(rows, arch: int) -> dict:
    return {r["spec"]: r for r in rows if r.get("arch") == f"sm_{arch}" and r.get("ceiling")}


# Each GPU target of the course, judged on paper for sm_90 from the specs that stand for the sweep's shapes:
# judge(rows by spec) -> (figure text, met: bool | None).
def _missing(by: dict, *specs) -> str | None:
    return next((f"no spec {s!r}" for s in specs if s not in by), None)


def _fraction(spec):
    def judge(by):
        if _missing(by, spec):
            return _missing(by, spec), None
        p = predicted(by[spec], 90)
        frac = p["value"] / GPUS[90]["tbps"]
        text = f"{p['value']} TB/s = {frac:.0%} of the {GPUS[90]['tbps']} TB/s datasheet bandwidth ({p['bound']})"
        if frac < 0.75:  # the target is 75% of the *measured* copy bandwidth, which lies below the datasheet's
            text += f"; out of reach if the measured copy bandwidth is at least {p['value'] / 0.75:.2f} TB/s"
        return text, frac >= 0.75
    return judge


def _ratio(spec, base, bytes_ratio=1.0, at_least=1.0):
    """Predicted speed of ``spec`` over ``base`` for the same tokens: bytes_ratio = base's bytes / spec's."""
    def judge(by):
        if _missing(by, spec, base):
            return _missing(by, spec, base), None
        a, b = predicted(by[spec], 90), predicted(by[base], 90)
        ratio = a["value"] / b["value"] * bytes_ratio
        bytes_text = f", {bytes_ratio:.2f}× fewer bytes" if bytes_ratio != 1 else ""
        issue = f"; instruction ceilings {by[spec]['ceiling']['issue_tbps']} and {by[base]['ceiling']['issue_tbps']} TB/s"
        return f"{ratio:.2f}× ({a['value']} vs {b['value']} TB/s{bytes_text}{issue})", ratio >= at_least
    return judge


def _repeat(grouped, per_head_mha, n_rep, at_least):
    """Grouped decode against repeat K/V + the per-head kernel over the copies: repeating reads the K/V once
    and writes n_rep copies (a memory-bound copy), then the per-head kernel reads the copies."""
    def judge(by):
        if _missing(by, grouped, per_head_mha):
            return _missing(by, grouped, per_head_mha), None
        bw = GPUS[90]["tbps"]
        g, m = predicted(by[grouped], 90)["value"], predicted(by[per_head_mha], 90)["value"]
        t_grouped = 1 / g  # per byte of K/V
        t_repeat = (1 + n_rep) / bw + n_rep / m
        ratio = t_repeat / t_grouped
        return f"{ratio:.1f}× ({g} TB/s grouped; the copy and the MHA kernel at {bw} and {m} TB/s)", ratio >= at_least
    return judge


def _prefill(spec):
    def judge(by):
        if _missing(by, spec):
            return _missing(by, spec), None
        p = predicted(by[spec], 90)
        return (f"{p['value']} TFLOP/s ({p['bound']}, {p['value'] / GPUS[90]['fp16_tflops']:.0%} of the fp16 peak); "
                "SDPA's own speed is not predicted here"), None
    return judge


# (what the course's target says, how it is judged on paper from the sm_90 builds): the specs named here stand
# for the benchmark sweeps' shapes (D = 128; heads as named). int8 reads 130 bytes per row (128 codes and a
# 2-byte scale) where fp16 reads 256.
TARGETS_ON_PAPER = [
    ("decode ≥ 75% of copy bandwidth, 32/32 heads (per-head kernel, chapter 03)", _fraction("decode fp16 32/32 splits=1")),
    ("decode ≥ 75% of copy bandwidth, 32/8 heads", _fraction("decode fp16 32/8 splits=1")),
    ("decode ≥ 75% of copy bandwidth, 64/8 heads", _fraction("decode fp16 64/8 splits=1")),
    ("paged ≥ 0.90× contiguous, block 16 (both grouped, 32/8)",
     _ratio("paged fp16 32/8 bs=16 splits=1", "grouped fp16 32/8 splits=1", at_least=0.9)),
    ("paged ≥ 0.90× contiguous, block 128",
     _ratio("paged fp16 32/8 bs=128 splits=1", "grouped fp16 32/8 splits=1", at_least=0.9)),
    ("int8 ≥ 1.6× fp16 (both grouped, 32/8)",
     _ratio("int8 fp16 query 32/8 splits=1", "grouped fp16 32/8 splits=1", bytes_ratio=256 / 130, at_least=1.6)),
    ("grouped ≥ 3.5× repeat K/V, 32/8", _repeat("grouped fp16 32/8 splits=1", "decode fp16 32/32 splits=1", 4, 3.5)),
    ("flash prefill ≥ 1.0× SDPA at S ≥ 4K (D = 128, causal)", _prefill("prefill fp16 D=128 causal")),
]


def predicted_markdown(rows) -> str:
    """The generated docs/results/predicted.md for these compile_check rows."""
    import triton

    lines = [
        "# Predicted ceilings of the course's kernels",
        "",
        f"Generated by `{PREDICTED_COMMAND}` with Triton {triton.__version__}: every kernel built for sm_75, "
        "sm_80 and sm_90 as the JIT builds it at launch, from the wrappers' own launches at the shapes in "
        "each module's `COMPILE_SPECS`. **Nothing here was timed**: these are ceilings from the machine code, "
        "which the first GPU run (`scripts/gpu_check.sh`) is to be compared against.",
        "",
        "The model: a multiprocessor has 4 schedulers, each issuing at most one warp instruction per clock. A "
        "kernel's main loop runs `instructions` per warp per iteration (counted in the SASS, `cuobjdump -sass`) "
        "and its program of `warps` warps reads `bytes` of K/V per iteration, so it cannot read faster than "
        "SMs × 4 × clock × bytes / (warps × cycles), divided by how many programs read each K/V element "
        "(the query heads per K/V head for a per-head kernel), where `cycles` is the largest of the loop's "
        "instruction count, its FP32 instructions × 2 on sm_75/sm_80 (16 FP32 lanes per scheduler; 32 on "
        "sm_90) and its SFU instructions (exp2) × 8 (4 lanes per scheduler): the `bound` column names which. The ceiling is the lower of that and the "
        "datasheet's memory bandwidth (or, for prefill, its dense fp16 tensor-core peak): an upper bound, which "
        "latency, occupancy and DRAM efficiency can only lower. GPUs: "
        + "; ".join(f"sm_{a} = {g['name']}, {g['sms']} SMs at {g['ghz']} GHz, {g['tbps']} TB/s, "
                    f"{g['fp16_tflops']} TFLOP/s fp16" for a, g in GPUS.items()) + " (NVIDIA datasheets).",
        "",
    ]
    by = _by_spec(rows, 90)
    if TARGETS_ON_PAPER:
        lines += ["## The course's GPU targets on paper (sm_90)", "",
                  "| target | ceiling | on paper |", "|---|---|---|"]
        for target, judge in TARGETS_ON_PAPER:
            text, met = judge(by)
            verdict = "not ruled out" if met else "out of reach" if met is False else "not judged"
            lines.append(f"| {target} | {text} | {verdict} |")
        lines += ["", "\"Not ruled out\" is all a ceiling can say: the GPU can still miss the target (the model has "
                  "no latency, occupancy or DRAM efficiency, and a ratio of two ceilings bounds the real ratio in "
                  "neither direction; where both kernels are capped by memory the verdict says only that neither "
                  "kernel's instructions stand in the way). \"Out of reach\" means that kernel as built cannot "
                  "meet it: its main loop needs more scheduler cycles per byte than the GPU has while the memory "
                  "streams. The ceilings assume a grid that fills every multiprocessor (split-K provides that at "
                  "small batches) and, for a per-head kernel, that the query heads of a group re-read their K/V "
                  "from L2 at no cost.", ""]
    for arch in sorted(GPUS, reverse=True):
        arch_rows = [r for r in rows if r.get("arch") == f"sm_{arch}" and r.get("ceiling")]
        if not arch_rows:
            continue
        g = GPUS[arch]
        lines += [f"## sm_{arch} ({g['name']})", "",
                  "| spec | kernel | tiles | registers | shared KB | loop instructions / warp | "
                  "warp instructions per KB | issue ceiling | ceiling | bound |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in arch_rows:
            c, p = r["ceiling"], predicted(r, arch)
            per_kb = c.get("instructions_per_kb", "")
            issue = (f"{c['issue_tflops']} TFLOP/s" if "issue_tflops" in c else f"{c['issue_tbps']} TB/s")
            lines.append(f"| {r['spec']} | `{r['kernel']}` | {_config(r)} | {r.get('registers')} | "
                         f"{r.get('shared_bytes', 0) / 1024:.1f} | {c['loop_instructions']} | {per_kb} | {issue} | "
                         f"{p['value']} {p['unit']} | {p['bound']} |")
        lines.append("")
    return "\n".join(lines)


def compile_in_processes(archs, modules=None, jobs: int = 2) -> list[dict]:
    """``compile_all``'s rows, each architecture built by ``python -m kvlib.course.compile_check --json --arch A`` in
    a process of its own, ``jobs`` at a time: the same rows, grouped by architecture. A kernel is reported as
    launched by no spec only when no process built it (a spec may name its ``archs``), and then once."""
    from concurrent.futures import ThreadPoolExecutor

    def one(arch):
        cmd = [sys.executable, "-m", "kvlib.course.compile_check", "--json", "--arch", str(arch)]
        out = subprocess.run(cmd + (["--module", *modules] if modules else []), capture_output=True, text=True)
        lines = out.stdout.strip().splitlines()
        if not lines:
            return [dict(module=None, spec=None, kernel=None, arch=f"sm_{arch}", ok=False,
                         error=f"the sm_{arch} process printed nothing (exit {out.returncode}): {out.stderr[-2000:]}")]
        return json.loads(lines[-1])

    with ThreadPoolExecutor(max(1, int(jobs))) as pool:
        parts = list(pool.map(one, archs))

    def unlaunched(r):
        return r.get("arch") is None and r.get("kernel") is not None

    everywhere = set.intersection(*({(r["module"], r["kernel"]) for r in part if unlaunched(r)} for part in parts))
    rows = [r for part in parts for r in part if r.get("arch") is not None]
    return rows + [r for r in parts[0] if r.get("arch") is None  # a spec without a name or launch: every process
                   and (not unlaunched(r) or (r["module"], r["kernel"]) in everywhere)]


def write_predicted(rows, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(predicted_markdown(rows), encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=list(DEFAULT_ARCHS),
                    help="compute capabilities, e.g. 75 80 90")
    ap.add_argument("--module", nargs="+", metavar="NAME", help="only these kvlib modules, e.g. cache gqa")
    ap.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    ap.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="build each architecture in a process of its own, N at a time (the same rows)")
    ap.add_argument("--predicted", metavar="FILE", help="also write the predicted ceilings as markdown to FILE")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("compile_check: run with TRITON_INTERPRET=0 (the interpreter cannot compile kernels)")
    if args.jobs > 1 and len(args.arch) > 1:
        rows = compile_in_processes(args.arch, args.module, args.jobs)
    else:
        rows = compile_all(tuple(args.arch), args.module)
    if args.json:
        print(json.dumps(rows, default=str))
    else:
        for r in rows:
            status = "ok " if r["ok"] else "FAIL"
            print(f"{status} {str(r.get('kernel')):<24} {str(r['arch']):<6} {str(r.get('dtype')):<8} "
                  f"regs={r.get('registers', '-'):<4} spill={r.get('stack_bytes', 0) + r.get('local_bytes', 0):<4} "
                  f"shared={r.get('shared_bytes', '-'):<6} {_config(r):<44} {_loop_text(r)}  "
                  f"[{r.get('spec')}] {r.get('error', '')}")
    if args.predicted:
        write_predicted(rows, Path(args.predicted))
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
