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
processes; workflows.core.import_hooks). Standard library only here: most processes never
import SGLang.
"""

from __future__ import annotations

import importlib

# module -> "submodule:function" of this package that patches it, right after it loads
PATCHES = {
    "sglang.srt.speculative.draft_utils": "draft:patch_draft_utils",
    "sglang.srt.layers.attention.torch_native_backend": "verify:patch_torch_native_backend",
}


def _applying(patch: str):
    """The patch function named "submodule:function" of this package, imported when applied."""

    def apply(module) -> None:
        submodule, function = patch.split(":")
        getattr(importlib.import_module(f"sglang_cpu_eagle.{submodule}"), function)(module)

    return apply


def install() -> None:
    from workflows.core.import_hooks import patch_on_import  # the project is on these processes' path

    patch_on_import({name: _applying(patch) for name, patch in PATCHES.items()})
