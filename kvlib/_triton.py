"""``triton`` and ``triton.language`` when installed, stand-ins when not (macOS).

Kernel modules import ``triton, tl`` from here so that their ``@triton.jit`` definitions still
load without Triton; their wrappers then call the PyTorch reference (see runtime.require_triton).
"""

from .runtime import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl
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

__all__ = ["triton", "tl", "HAS_TRITON"]
