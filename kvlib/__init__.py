"""kvlib: the small library behind the "KV Cache from Scratch" course.

Importing kvlib first decides the mode (see :mod:`kvlib.runtime`): on a machine without a CUDA
GPU it sets TRITON_INTERPRET=1 before anything imports Triton.
"""

from . import runtime  # noqa: F401  (must run before any module imports triton)
from .runtime import DEVICE, INTERPRETER, describe  # noqa: F401

__version__ = "0.1.0"

import os as _os

if _os.environ.get("KVLIB_CHECK_FIGURES") == "1":  # the course's test command: every figure shown is checked
    from .course import figures  # noqa: F401,E402  (wraps matplotlib.pyplot.show)

from .course import _aliases  # noqa: E402  (kvlib.check, kvlib.mistakes, ... for labs edited before the move)

_aliases.install()
