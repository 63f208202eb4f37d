"""Prove every Triton kernel in kvlib builds for real GPUs, on a machine without one.

Passing in the interpreter does not prove a kernel compiles: the interpreter runs the kernel
body as NumPy and accepts code the compiler rejects. Here each kernel module lists its default
launch configuration in ``COMPILE_SPECS``; we hand each to ``triton.compile`` with an
``ASTSource`` and a ``GPUTarget`` (sm_80 = A100, sm_90 = H100/H200) and read the cubin's
resource usage with ``cuobjdump`` (shipped inside the triton wheel): registers per thread and the
STACK and LOCAL bytes per thread (a stack frame in local memory = register spills; we want 0), and
check the shared memory a launch needs against what one block may have on that architecture
(sm_75 = T4: 64 KiB), since a kernel that builds but asks for more fails at its first launch.

Run it in a process where Triton is *not* in interpreter mode::

    TRITON_INTERPRET=0 KVLIB_DEVICE=cpu python -m kvlib.compile_check [--arch 75 80 90]

A spec may name the architectures it is for (``archs=(75,)``) when a wrapper picks different tiles
for them (see ``kvlib.attention._tiles``).

``tests/test_compile.py`` does exactly that in a subprocess and fails on any error or spill.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def kernel_modules():
    """Import every kvlib module and yield (module, {name: JITFunction}) for those with kernels."""
    import triton

    import kvlib

    for info in sorted(pkgutil.iter_modules(kvlib.__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.name in ("compile_check",):
            continue
        source = Path(kvlib.__path__[0], f"{info.name}.py")
        if source.is_file() and "@triton.jit" not in source.read_text(encoding="utf-8"):
            continue  # no kernels: don't import it (kvlib.labs needs nbformat, absent on bare GPU images)
        mod = importlib.import_module(f"kvlib.{info.name}")
        kernels = {n: obj for n, obj in vars(mod).items()
                   if isinstance(obj, triton.runtime.jit.JITFunction) and obj.__module__ == mod.__name__}
        if kernels:
            yield mod, kernels


# Shared memory one block may use (the opt-in maximum, bytes) per compute capability; CUDA C
# Programming Guide, "Technical Specifications per Compute Capability".
MAX_SHARED = {75: 65536, 80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448}
DEFAULT_ARCHS = (75, 80, 90)  # T4 (free Colab), A100, H100/H200


def resource_usage(cubin: bytes) -> dict:
    """Registers, stack-frame and local-memory bytes per thread, read from a cubin with cuobjdump.

    ptxas puts spilled registers in the stack frame (STACK), not in LOCAL, so both must be 0."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?LOCAL:(\d+)", text, re.S)
    return {"registers": int(m.group(1)), "stack_bytes": int(m.group(2)),
            "local_bytes": int(m.group(3))} if m else {}


def compile_all(archs=DEFAULT_ARCHS) -> list[dict]:
    """Compile every kernel's COMPILE_SPECS for each arch; one result row per (kernel, spec, arch)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows = []
    for mod, kernels in kernel_modules():
        specs = getattr(mod, "COMPILE_SPECS", [])
        covered = {s["kernel"].__name__ for s in specs}
        for name in sorted(set(kernels) - covered):
            rows.append(dict(module=mod.__name__, kernel=name, arch=None, ok=False,
                             error="no entry in the module's COMPILE_SPECS"))
        for spec in specs:
            for arch in archs:
                if arch not in spec.get("archs", (arch,)):
                    continue
                row = dict(module=mod.__name__, kernel=spec["kernel"].__name__, arch=f"sm_{arch}",
                           dtype=next((t[1:] for t in spec["signature"].values() if t.startswith("*")), None),
                           constexprs=spec.get("constexprs", {}), num_warps=spec.get("num_warps", 4))
                try:
                    try:
                        src = ASTSource(fn=spec["kernel"], signature=spec["signature"],
                                        constexprs=spec.get("constexprs"))
                    except TypeError:  # Triton 3.2 calls them `constants`
                        src = ASTSource(fn=spec["kernel"], signature=spec["signature"],
                                        constants=spec.get("constexprs"))
                    options = {k: spec[k] for k in ("num_warps", "num_stages") if k in spec}
                    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
                    row.update(resource_usage(compiled.asm["cubin"]), shared_bytes=compiled.metadata.shared)
                    spill = row.get("stack_bytes", 0) + row.get("local_bytes", 0)
                    limit = MAX_SHARED.get(arch)
                    if "registers" not in row:
                        row["error"] = "cuobjdump reported no resource usage"
                    elif spill:
                        row["error"] = f"spills: {spill} bytes of stack/local memory per thread"
                    elif limit is not None and row["shared_bytes"] > limit:
                        row["error"] = (f"needs {row['shared_bytes']} bytes of shared memory; sm_{arch} allows "
                                        f"{limit} per block, so the launch would fail")
                    row["ok"] = "error" not in row
                except Exception as e:  # report every failure, not just the first
                    row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                rows.append(row)
    return rows


def _config(row) -> str:
    c = {k: v for k, v in row.get("constexprs", {}).items()
         if k.startswith(("TILE", "SPLITS", "GROUP")) or (k in ("PAGED", "INT8") and v)}
    return " ".join(f"{k}={v}" for k, v in c.items()) + f" w={row.get('num_warps', '-')}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=list(DEFAULT_ARCHS),
                    help="compute capabilities, e.g. 75 80 90")
    ap.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("compile_check: run with TRITON_INTERPRET=0 (the interpreter cannot compile kernels)")
    rows = compile_all(tuple(args.arch))
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            status = "ok " if r["ok"] else "FAIL"
            print(f"{status} {r['kernel']:<24} {str(r['arch']):<6} {str(r.get('dtype')):<5} regs={r.get('registers', '-'):<4} "
                  f"stack={r.get('stack_bytes', '-'):<5} local={r.get('local_bytes', '-'):<4} "
                  f"shared={r.get('shared_bytes', '-'):<6} {_config(r):<34} "
                  f"{r.get('error', '')}")
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
