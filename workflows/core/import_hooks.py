"""Patch a module right after it is first imported, in whichever process imports it: how
the CPU stand-ins (workflows/sglang_cpu_shim, workflows/vllm_cpu_shim) reach into the
engines' modules, including in the child processes an engine starts. Standard library
only: it is imported at the start of every process that has a shim on its path."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Callable


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then its patch."""

    def __init__(self, loader, patch: Callable[[ModuleType], None]):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):  # get_code, get_source, is_package, ...
        return getattr(self._loader, name)


class _PatchFinder(importlib.abc.MetaPathFinder):
    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]):
        self.patches = patches

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, self.patches[name])
        return spec


def patch_on_import(patches: dict[str, Callable[[ModuleType], None]]) -> None:
    """Apply `patches[name](module)` when module `name` is imported (once per process, for
    each module: a second call with the same modules adds nothing)."""
    known = {n for f in sys.meta_path if isinstance(f, _PatchFinder) for n in f.patches}
    todo = {n: p for n, p in patches.items() if n not in known}
    if todo:
        sys.meta_path.insert(0, _PatchFinder(todo))
