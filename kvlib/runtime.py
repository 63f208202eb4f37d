"""Which mode this machine runs the course in, decided once, before Triton is imported.

- GPU mode: a CUDA GPU is visible to PyTorch. Triton compiles kernels for it.
- CPU mode: no CUDA GPU. We set ``TRITON_INTERPRET=1`` *before* Triton is imported, so every
  ``@triton.jit`` kernel runs in Triton's interpreter on CPU tensors (one Python call per
  program instance: correct, slow, fp32/fp16 only).
- Fallback mode: Triton is not installed (macOS has no Triton wheels). kvlib still imports;
  the kernel wrappers fall back to the PyTorch references and say so once.

Public names: ``DEVICE`` ("cuda" or "cpu"), ``INTERPRETER`` (bool), ``HAS_TRITON`` (bool),
``describe()``, ``by_mode(cpu=..., gpu=...)``, ``cpu_threads()``.

Override the detection with ``KVLIB_DEVICE=cpu`` (interpreter even on a GPU machine). An
explicit ``TRITON_INTERPRET`` in the environment is respected as given.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import torch

__all__ = ["DEVICE", "INTERPRETER", "HAS_TRITON", "describe", "by_mode", "require_triton", "mode", "cpu_threads",
           "capability"]


def _cuda_available() -> bool:
    """True when PyTorch sees a usable CUDA GPU. Never raises (no driver, broken driver...)."""
    if os.environ.get("KVLIB_DEVICE", "").lower() == "cpu":
        return False
    try:
        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except Exception:  # a half-installed driver can raise from inside torch
        return False


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as missing
        return False


_GPU = _cuda_available()
DEVICE: str = "cuda" if _GPU else "cpu"
HAS_TRITON: bool = _triton_installed()

if HAS_TRITON and not _GPU and "TRITON_INTERPRET" not in os.environ:
    if "triton" in sys.modules:
        # Triton reads TRITON_INTERPRET when its modules are imported; too late to switch now.
        warnings.warn(
            "kvlib: triton was imported before kvlib on a machine without a CUDA GPU, so the "
            "Triton interpreter could not be switched on. Import kvlib first (or set "
            "TRITON_INTERPRET=1 before starting Python).",
            stacklevel=2,
        )
    else:
        os.environ["TRITON_INTERPRET"] = "1"
        print("kvlib: no CUDA GPU found -> CPU mode: Triton kernels run in the interpreter "
              "(TRITON_INTERPRET=1); sizes are kept small.", file=sys.stderr)

# Triton 3.9 warns on every compile unless this is set; keep its current default (fusion on).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
# fp32 tl.dot in full precision: GPUs otherwise default to TF32 (a 10-bit mantissa, errors ~1e-3),
# which would fail the course's fp32 checks against the references (1e-5) on a GPU while passing in the
# interpreter. The fast paths are fp16/bf16, where this setting changes nothing. Set it yourself to
# "tf32" to see the difference.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

INTERPRETER: bool = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

if not HAS_TRITON:
    print("kvlib: Triton is not installed (it ships for Linux only) -> the course uses the "
          "PyTorch reference of every kernel instead.", file=sys.stderr)


def mode() -> str:
    """One word for this machine's mode: "gpu", "interpreter" or "reference"."""
    if not HAS_TRITON:
        return "reference"
    return "interpreter" if INTERPRETER else "gpu"


# The compute capability kvlib.course.compile_check is building for (it calls the wrappers on CPU tensors, so that
# they pick the tiles they would pick on that GPU); None everywhere else.
COMPILE_TARGET: tuple[int, int] | None = None


def capability(device=None) -> tuple[int, int] | None:
    """The (major, minor) compute capability the kernels are built for: ``kvlib.course.compile_check``'s target
    while it builds, else the CUDA device's; None for a CPU device (the interpreter)."""
    if COMPILE_TARGET is not None:
        return COMPILE_TARGET
    device = torch.device(device) if device is not None else torch.device(DEVICE)
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


def require_triton(what: str, **tensors) -> bool:
    """True when Triton kernels can run here; otherwise print once why ``what`` uses PyTorch.

    ``tensors`` (name=tensor): in GPU mode the compiled kernels need CUDA tensors, so a CPU tensor is
    a ValueError naming it (rather than a crash inside Triton).
    """
    if HAS_TRITON:
        if mode() == "gpu":
            for name, t in tensors.items():
                if isinstance(t, torch.Tensor) and t.device.type != "cuda":
                    raise ValueError(f"{what}: {name} is on {t.device}, but in GPU mode the Triton kernel needs "
                                     f"CUDA tensors: move the inputs with .to('cuda') (or call the _ref version)")
        return True
    if what not in _warned:
        _warned.add(what)
        print(f"kvlib: {what}: Triton is not installed, using the PyTorch reference.", file=sys.stderr)
    return False


_warned: set[str] = set()


def by_mode(cpu, gpu):
    """Pick a workload size for this machine: ``cpu`` in CPU/interpreter mode, ``gpu`` on a GPU.

    Example: ``seq_lens = by_mode(cpu=[64, 128, 256], gpu=[1024, 4096, 16384, 65536])``.
    """
    return gpu if DEVICE == "cuda" and not INTERPRETER else cpu


def cpu_threads() -> int:
    """How many CPU threads the chapters and tests give PyTorch: 1 unless ``KVLIB_THREADS`` says otherwise.

    One thread, because on a busy 2-core laptop a second OpenMP thread mostly waits for a core (a
    SmolLM2 forward of 6 tokens took 0.15 s on one thread and 3.2 s on two while other work ran).
    ``make test THREADS=2 JOBS=1`` (which sets ``KVLIB_THREADS``) runs everything on two: other
    reduction orders, the same results wherever a notebook's outputs are compared.
    """
    raw = os.environ.get("KVLIB_THREADS", "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"KVLIB_THREADS must be a whole number >= 1, got {raw!r}")
    return n


def device_name() -> str:
    """A short human name for where tensors live, used in plot titles and result files."""
    if DEVICE == "cuda":
        return torch.cuda.get_device_name(0)
    import platform

    cpu = platform.processor() or platform.machine()
    return f"CPU ({cpu}, {os.cpu_count()} cores)"


def describe() -> dict:
    """Facts about this machine that the course's numbers depend on (also printed)."""
    import platform

    info = {
        "mode": mode(),
        "device": DEVICE,
        "device_name": device_name(),
        "triton_interpreter": INTERPRETER,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _triton_version(),
    }
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            compute_capability=f"{props.major}.{props.minor}",
            gpu_memory_GiB=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
    else:
        info.update(cpu_cores=os.cpu_count(), ram_GiB=_ram_gib())
    width = max(len(k) for k in info)
    for k, v in info.items():
        print(f"{k:<{width}} : {v}")
    return info


def _triton_version() -> str | None:
    if not HAS_TRITON:
        return None
    import triton

    return triton.__version__


def _ram_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return round(pages * size / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None
