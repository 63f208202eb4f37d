"""Known wrong answers to the labs' exercises, so that a checker can say which one you made.

Course machinery, not a chapter: each function takes the inputs of one exercise's check and returns
``{description: wrong result}`` for the mistakes learners typically make there, ready for
``kvlib.course.check.check(..., mistakes=...)``. A wrong result is a function of no arguments (the checker
calls it only when your answer fails), computed the way the mistaken code would compute it.
``tests/test_check.py`` feeds each mistake, written as a learner would write it, through the
checker and asserts that the report names it.

The diagnoses of each lab live in their own module (``lab00.py`` ... ``lab12b.py``); this package gathers
them, so a lab says ``from kvlib.course import mistakes`` and calls ``mistakes.kv_bytes(...)``.
"""

from __future__ import annotations

from . import (lab00, lab01, lab02, lab03, lab04, lab05, lab06, lab07, lab08, lab09, lab09b, lab10,  # noqa: F401
               lab11a, lab11b, lab12a, lab12b)
from ._common import BY_D, GQA_MODULO, NO_SQRT_D  # noqa: F401

# Every public name of every lab's module, here too (helpers such as ``admission_flags`` that the tests use).
for _lab in (lab00, lab01, lab02, lab03, lab04, lab05, lab06, lab07, lab08, lab09, lab09b, lab10, lab11a, lab11b, lab12a,
             lab12b):
    globals().update({k: v for k, v in vars(_lab).items()
                      if not k.startswith("_") and getattr(v, "__module__", None) == _lab.__name__})
del _lab

__all__ = [
    *lab00.__all__,
    *lab01.__all__,
    *lab02.__all__,
    *lab03.__all__,
    *lab04.__all__,
    *lab05.__all__,
    *lab06.__all__,
    *lab07.__all__,
    *lab08.__all__,
    *lab09.__all__,
    *[name for name in lab09b.__all__ if name not in lab09.__all__],  # lab09b re-exports three of lab09's
    *lab10.__all__,
    *lab11a.__all__,
    *lab11b.__all__,
    *lab12a.__all__,
    *lab12b.__all__,
]
