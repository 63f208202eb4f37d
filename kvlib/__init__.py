"""kvlib: the small library behind the "KV Cache from Scratch" course.

Importing kvlib first decides the mode (see :mod:`kvlib.runtime`): on a machine without a CUDA
GPU it sets TRITON_INTERPRET=1 before anything imports Triton.
"""

from . import runtime  # noqa: F401  (must run before any module imports triton)
from .runtime import DEVICE, INTERPRETER, describe  # noqa: F401

__version__ = "0.1.0"
