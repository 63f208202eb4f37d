"""Old import paths (``kvlib.check``, ``kvlib.mistakes``, ...) for labs a learner edited before the course
machinery moved into ``kvlib.course``: ``import kvlib.check`` still works and gives ``kvlib.course.check``.

Nothing in the course uses these names; they exist so that an edited lab keeps running after an update.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = ("check", "mistakes", "labs", "readme", "figures", "compile_check")


class _Loader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        head, _, name = fullname.rpartition(".")
        if head != "kvlib" or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _Loader(f"kvlib.course.{name}"))


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
