"""workflows/vllm_cpu_shim: what vLLM 0.32's CPU build computes wrongly, stood in for in
CPU vLLM processes only, checked in vLLM's own interpreter (.venv-vllm)."""

import json
import subprocess

import pytest

from workflows.core.serving import ServeJob, engine_env, vllm_python

# In vLLM's interpreter: the DFlash draft's context-key norm as vLLM-CPU computes it, as the
# stand-in computes it, and the per-layer norm written out; and whether the shim, put on the
# path as the served check puts it, has replaced vLLM's method by the time the module loads.
PROBE = """
import json, torch
from types import SimpleNamespace
import vllm_cpu_standins
from vllm.model_executor.models import qwen3_dflash as m
torch.manual_seed(0)
keys = torch.randn(3, 40, 2, 32)  # [layers, context rows, kv heads, head size]
fake = SimpleNamespace(_k_norm_weights=torch.randn(3, 32), _rms_norm_eps=1e-6)
x = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + 1e-6)
want = x * fake._k_norm_weights[:, None, None, :]
patched = m.DFlashQwen3Model._normalize_context_k is vllm_cpu_standins._grouped_context_k_norm
vllm_own = vllm_cpu_standins.VLLM_OWN["_normalize_context_k"](fake, keys)
ours = vllm_cpu_standins._grouped_context_k_norm(fake, keys)
print(json.dumps({
    "patched": patched,
    "vllm_layer0": float((vllm_own[0] - want[0]).abs().max()),
    "vllm_layer1": float((vllm_own[1] - want[1]).abs().max()),
    "vllm_is_layer0_weight": float((vllm_own - x * fake._k_norm_weights[0]).abs().max()),
    "standin": float((ours - want).abs().max()),
}))
"""


def test_vllm_cpu_normalises_every_dflash_layer_by_its_own_k_norm_with_the_standin():
    env = engine_env(ServeJob(engine="vllm", target_path="", draft_path="", num_steps=1, topk=1, num_draft_tokens=2))
    assert env["EAGLE3_VLLM_CPU_STANDINS"] == "1" and "vllm_cpu_shim" in env["PYTHONPATH"]
    done = subprocess.run([vllm_python(None, "cpu"), "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["patched"], got  # the served check's vLLM processes run the stand-in
    # vLLM-CPU's own op: right for layer 0, layer 0's weight for every other layer.
    assert got["vllm_layer0"] < 1e-5 and got["vllm_is_layer0_weight"] < 1e-5 and got["vllm_layer1"] > 0.1, got
    assert got["standin"] < 1e-5, got
    gpu = engine_env(
        ServeJob(engine="vllm", target_path="", draft_path="", num_steps=1, topk=1, num_draft_tokens=2, device="cuda")
    )
    assert "EAGLE3_VLLM_CPU_STANDINS" not in gpu and "vllm_cpu_shim" not in gpu["PYTHONPATH"]  # GPUs as vLLM ships


# In vLLM's interpreter with a DSpark job's CPU environment: vLLM's own verdict on Triton
# (none: no CPU backend), the stand-in's, and a @triton.jit kernel on CPU tensors, run by
# Triton's interpreter as vLLM's V2 model runner runs its kernels.
TRITON_PROBE = """
import json, torch
import vllm_cpu_standins
from vllm.triton_utils import HAS_TRITON, tl, triton

@triton.jit
def scatter_plus_one(src, index, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out + tl.load(index + i, mask=m), tl.load(src + i, mask=m) + 1, mask=m)

src, index = torch.arange(10), torch.randperm(10, generator=torch.Generator().manual_seed(0))
out = torch.zeros(10, dtype=torch.long)
scatter_plus_one[(3,)](src, index, out, 10, BLOCK=4)
want = torch.zeros(10, dtype=torch.long).index_copy_(0, index, src + 1)
print(json.dumps({"vllm_own": vllm_cpu_standins.VLLM_OWN.get("HAS_TRITON"), "has_triton": HAS_TRITON,
                  "kernel": type(scatter_plus_one).__name__, "right": bool(torch.equal(out, want))}))
"""


def test_a_dspark_job_runs_vllms_v2_runner_with_triton_interpreted_on_a_cpu_and_no_other():
    from workflows.core.errors import InputError
    from workflows.core.serving import serve_prompts

    def job(method, **over):
        return ServeJob(
            engine="vllm", target_path="", draft_path="", num_steps=1, topk=1, num_draft_tokens=2, method=method, **over
        )

    env = engine_env(job("dspark"))
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1" and env["TRITON_INTERPRET"] == "1"
    for method in ("eagle3", "dflash"):  # the V1 runner, as before
        assert "VLLM_USE_V2_MODEL_RUNNER" not in engine_env(job(method)) and "TRITON_INTERPRET" not in engine_env(
            job(method)
        )
    assert "TRITON_INTERPRET" not in engine_env(job("dspark", device="cuda"))  # GPUs as vLLM ships
    done = subprocess.run(
        [vllm_python(None, "cpu"), "-c", TRITON_PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"vllm_own": False, "has_triton": True, "kernel": "InterpretedFunction", "right": True}, got
    with pytest.raises(InputError, match="adaptive verification cannot run on a CPU"):
        serve_prompts(job("dspark", adaptive_verification=True, prompts=[[1]], max_new_tokens=[1]))


# In vLLM's interpreter, as the served check starts it on a CPU: the two stand-ins that let
# vLLM-CPU serve a Kimi-shaped target (the kimi_k25 wrapper, MLA) with an EAGLE-3 draft.
KIMI_PROBE = """
import json, torch
import numba  # the wrapper's fused image processor imports it, and with it llvmlite's library object
import vllm_cpu_standins
from vllm.triton_utils import dispatcher
from vllm.v1.attention.backends import cpu_attn
out = {"dispatcher_patched": dispatcher.vars is vllm_cpu_standins._namespace_of}
dispatcher._rebind_kernels([])  # the scan the CPU platform runs at start, with the stand-in
dispatcher.vars = vllm_cpu_standins.VLLM_OWN["vars"]
try:
    dispatcher._rebind_kernels([])
    out["vllm_own_scan"] = "ok"
except AttributeError as e:
    out["vllm_own_scan"] = str(e)
backend = cpu_attn.CPUAttentionBackend
out["block_sizes"] = [str(s) for s in backend.get_supported_kernel_block_sizes()]
out["vllm_own_block_sizes"] = [str(s) for s in vllm_cpu_standins.VLLM_OWN["get_supported_kernel_block_sizes"]()]
# vLLM's own kernel choice for a float32 draft layer (head size 64) on blocks of 16
out["isa_16"] = cpu_attn._get_attn_isa(torch.float32, 16, 64)
print(json.dumps(out))
"""


def test_vllm_cpu_starts_with_the_kimi_wrappers_numba_and_an_attention_draft_on_mlas_blocks_of_16():
    """Two stand-ins, each measured failing without it: (1) vLLM-CPU's start-up scan of every
    module's attributes reads `vars()` of llvmlite's library object, whose `__dict__` is a
    function wrapper: "'_lib_fn_wrapper' object has no attribute 'get'", and the engine never
    starts once the kimi_k25 processor has loaded numba; (2) vLLM-CPU's MLA backend pins
    the KV cache to blocks of 16, its CPU attention (the draft's layer) declares multiples of
    32 only ("No common block size for 16"), though vLLM's own kernel choice for blocks of
    16 is its vec16 kernel. tests/test_tiny_kimi.py serves the draft on blocks of 16 at its
    prediction, identical to greedy."""
    env = engine_env(ServeJob(engine="vllm", target_path="", draft_path="", num_steps=1, topk=1, num_draft_tokens=2))
    done = subprocess.run(
        [vllm_python(None, "cpu"), "-c", KIMI_PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["dispatcher_patched"] and "has no attribute 'get'" in got["vllm_own_scan"], got
    assert got["vllm_own_block_sizes"] == ["MultipleOf(32)"], got
    assert got["block_sizes"] == ["16", "MultipleOf(32)"] and got["isa_16"] == "vec16", got
