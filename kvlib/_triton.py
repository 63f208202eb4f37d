"""``triton`` and ``triton.language`` when installed, stand-ins when not (macOS).

Kernel modules import ``triton, tl`` from here so that their ``@triton.jit`` definitions still
load without Triton; their wrappers then call the PyTorch reference (see runtime.require_triton).

``check_kernel_dtype`` is the one place that says which dtypes a kernel wrapper accepts on this
machine (every wrapper calls it before launching).
"""

import torch

from . import runtime
from .runtime import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    if runtime.INTERPRETER:  # Triton <= 3.6 + NumPy >= 2.4: loops with runtime bounds (see the module)
        from ._interpreter_compat import patch as _patch_interpreter

        _patch_interpreter()
else:  # pragma: no cover - exercised only where triton is missing

    class _TritonStandIn:
        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a, b):
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n):
            return 1 << max(0, (int(n) - 1).bit_length())

    class _LanguageStandIn:
        class constexpr:  # used only as an annotation
            pass

    triton = _TritonStandIn()
    tl = _LanguageStandIn()

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_kernel_dtype(what: str, name: str, t: torch.Tensor, dot: bool = False) -> None:
    """Raise a TypeError unless the Triton kernel behind ``what`` computes tensor ``t`` correctly here.

    - The kernels take float32, float16 or bfloat16 (an int64 q would come back truncated to int64).
    - bfloat16 is refused in Triton's interpreter (CPU mode) by kernels that use ``tl.dot`` or do
      arithmetic in bfloat16 (``dot=True``): the interpreter returns values off by ~1e8 there.
    - bfloat16 is refused on GPUs of compute capability below 8.0 (a T4 is 7.5), which lack it.

    >>> check_kernel_dtype("demo", "x", torch.zeros(2))  # float32: fine everywhere
    >>> check_kernel_dtype("demo", "x", torch.zeros(2, dtype=torch.int64))
    Traceback (most recent call last):
    ...
    TypeError: demo: x is torch.int64, but the kernel takes float32, float16 or bfloat16
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{what}: {name} is {t.dtype}, but the kernel takes float32, float16 or bfloat16")
    if t.dtype != torch.bfloat16:
        return
    mode = runtime.mode()
    if mode == "interpreter" and dot:
        raise TypeError(f"{what}: {name} is torch.bfloat16, which Triton's interpreter (CPU mode) computes "
                        "wrongly in this kernel; use float16 or float32 (or the _ref version)")
    if mode == "gpu":
        major, minor = runtime.capability(t.device if t.device.type == "cuda" else "cuda")
        if major < 8:
            raise TypeError(f"{what}: {name} is torch.bfloat16, which needs a GPU of compute capability 8.0 "
                            f"or newer; this one is {major}.{minor}: use float16")


__all__ = ["triton", "tl", "HAS_TRITON", "KERNEL_DTYPES", "check_kernel_dtype"]
