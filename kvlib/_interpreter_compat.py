"""Let Triton <= 3.6's interpreter run kernel loops with runtime bounds under NumPy >= 2.4.

Triton's interpreter keeps every scalar (a program id, an int argument, ``tl.minimum`` of two of
them) as a NumPy array of shape (1,), and a loop ``for i in range(lo, hi, TILE)`` turns ``hi`` into
a Python int with ``int(array)``. NumPy deprecated that conversion for arrays with ndim > 0 in 1.25
and refuses it from 2.4 on (``TypeError: only 0-dimensional arrays can be converted to Python
scalars``), so on Triton 3.6 (and older) with NumPy >= 2.4 every kernel with a runtime loop bound
failed in the interpreter. Triton 3.9 converts with ``int(array.squeeze())``; ``patch()`` installs
that same conversion on older versions. It touches nothing but the interpreter (compiled kernels never use
it), is a no-op where the interpreter already squeezes, and keeps the kernels themselves idiomatic.
"""

from __future__ import annotations


def _index(self) -> int:
    return int(self.handle.data.squeeze())  # shape (1,) or () -> Python int, on every NumPy


def patch() -> bool:
    """Wrap the interpreter's tensor patching so ``__index__`` squeezes first. True if installed."""
    try:
        from triton.runtime import interpreter
    except Exception:  # no Triton, or a build without the interpreter
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_kvlib_squeezes", False):
        return False

    def _patch_lang_tensor(tensor, *scope):
        original(tensor, *scope)
        if scope:  # newer Triton: a scope that undoes every change after the launch
            scope[0].set_attr(tensor, "__index__", _index)
        else:  # older Triton (3.2, ...): plain attributes
            tensor.__index__ = _index

    _patch_lang_tensor._kvlib_squeezes = True
    interpreter._patch_lang_tensor = _patch_lang_tensor
    return True
