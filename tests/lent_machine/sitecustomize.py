"""The lent GPU machine's imports, on this one: put this folder first on PYTHONPATH and a
Python started there can import only what that machine has (torch, transformers, triton,
numpy, safetensors, and what they require) and what `make gpu-wheels` carries to it (the
Makefile's GPU_BINARY and GPU_PURE, and deepspeed), besides the project itself. Everything
else installed in this venv (Ray, Hydra, SGLang, Zarr if the Makefile forgot it...) looks
absent, to `import` and to `importlib.util.find_spec` alike, in child processes too.

tests/test_gpu_suite.py runs the suite's dry run so: the first H200 run found the capture
section importing zarr, which no wheel carried."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata as md
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LENT = ("torch", "transformers", "triton", "numpy", "safetensors")
PROJECT = "eagle3-pipeline"
MAKEFILE = Path(__file__).resolve().parents[2] / "Makefile"


def carried() -> list[str]:
    """The distributions `make gpu-wheels` downloads or builds, read off the Makefile."""
    text = MAKEFILE.read_text().replace("\\\n", " ")
    names = ["deepspeed"]
    for var in ("GPU_BINARY", "GPU_PURE"):
        line = re.search(rf"^{var} :=(.*)$", text, re.M).group(1)
        names += [re.split(r"[=<>]", word)[0] for word in line.split()]
    return names


def closure(names) -> set[str]:
    """These distributions and, transitively, what they require (no extras)."""
    seen, todo = set(), list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen.add(name)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


class LentMachinePaths:
    """sys.meta_path's PathFinder, blind to the top-level modules of other distributions."""

    def __init__(self, blocked: set[str], allowed: set[str]):
        self.blocked, self.allowed = blocked, allowed

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.blocked:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):
        """importlib.metadata's view (versions, entry points such as pytest plugins) alike."""
        for dist in importlib.machinery.PathFinder.find_distributions(*args, **kwargs):
            if canonicalize_name(dist.metadata["Name"] or "") in self.allowed:
                yield dist

    def invalidate_caches(self):
        importlib.machinery.PathFinder.invalidate_caches()


def install() -> None:
    # The carried wheels go over with --no-deps: what they require is not there unless listed.
    allowed = closure(LENT) | {canonicalize_name(n) for n in [*carried(), PROJECT]}
    blocked = {
        module
        for module, dists in md.packages_distributions().items()
        if not {canonicalize_name(d) for d in dists} & allowed
    }
    sys.meta_path[:] = [
        LentMachinePaths(blocked, allowed) if f is importlib.machinery.PathFinder else f for f in sys.meta_path
    ]


install()
