"""EAGLE-3 speculative decoding for SGLang 0.5.23 on a CPU, with torch_native attention.

SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`) serves EAGLE only with the Intel AMX
backend. Two pieces are missing for `attention_backend=torch_native`; `draft` and `verify`
supply them:

* the draft's attention backends: DraftBackendFactory knows no torch_native entry. Draft
  extend runs the plain torch_native backend; draft decode gets a multi-step backend (one
  per draft step) that attends to the committed prefix plus the KV slots SGLang gives the
  query's frontier rank at steps 0..i (SGLang's own layout, the one the GPU kernel
  `generate_draft_decode_kv_indices` builds; page size 1);
* the target's verify pass: torch_native's extend needs extend_prefix_lens, which verify
  does not set, and knows no tree mask. A verify branch lets each request's draft tokens
  attend to its committed prefix and to the draft tokens the tree mask allows.

`install()` (called by ../sitecustomize.py) patches each SGLang module right after it is
first imported, in whichever process imports it (SGLang's scheduler runs in child
processes). Standard library only here: most processes never import SGLang.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

# module -> "submodule:function" of this package that patches it, right after it loads
PATCHES = {
    "sglang.srt.speculative.draft_utils": "draft:patch_draft_utils",
    "sglang.srt.layers.attention.torch_native_backend": "verify:patch_torch_native_backend",
}


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then its patch."""

    def __init__(self, loader, patch: str):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        submodule, function = self._patch.split(":")
        getattr(importlib.import_module(f"sglang_cpu_eagle.{submodule}"), function)(module)

    def __getattr__(self, name):  # get_code, get_source, is_package, ...
        return getattr(self._loader, name)


class _PatchFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, PATCHES[name])
        return spec


def install() -> None:
    if not any(isinstance(f, _PatchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchFinder())
