"""workflows/vllm_cpu_shim: what vLLM 0.32's CPU build computes wrongly, stood in for in
CPU vLLM processes only, checked in vLLM's own interpreter (.venv-vllm)."""

import json
import subprocess

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
