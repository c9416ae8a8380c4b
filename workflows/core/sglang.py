"""SGLang: the target engine (`backend=sglang`) and the one place for its CPU settings.

* `CPU_SETTINGS` are what SGLang 0.5.23 needs to run on a CPU (torch_native attention,
  pytorch sampling, no CUDA graphs, no overlap schedule, no radix cache, a small static
  memory fraction); `engine_kwargs` gives them to an in-process `sgl.Engine`,
  `server_cpu_args` to `sglang.launch_server`. On CPU, SGLang's RoPE fallback imports
  `vllm._custom_ops`; `workflows/sglang_cpu_shim` provides that one function and goes on
  the path of CPU SGLang processes only (`with_shim`).
* `SGLangEngine` implements the engine interface of workflows.core.engines. Generation runs
  an in-process Engine, created on first use and kept for the engine's life. Hidden
  states: SGLang returns the aux states (`enable_return_aux_hidden_states`, layer ids in our
  convention: id i is the output of layer i, the input of layer i+1) *instead of* the final
  hidden state, so `final` (after the final norm) comes from a second engine in full mode
  (`enable_return_hidden_states`), started after the first has shut down. Both run in a
  child process (`python -m workflows.core.sglang ...`): the scheduler can SIGKILL its
  caller on an error. Radix cache is off (with it on, only the uncached suffix comes back).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from workflows.core.engines import EngineSpec

ROOT = Path(__file__).resolve().parents[2]
SHIM_DIR = ROOT / "workflows" / "sglang_cpu_shim"
CPU_SETTINGS = {"device": "cpu", "attention_backend": "torch_native", "sampling_backend": "pytorch",
                "disable_cuda_graph": True, "disable_overlap_schedule": True, "disable_radix_cache": True,
                "mem_fraction_static": 0.05}


def engine_kwargs(spec: EngineSpec, **extra) -> dict:
    """Keyword arguments of `sgl.Engine` for this spec (CPU settings when spec.device is cpu)."""
    kw = {"model_path": spec.target_path, "tp_size": spec.tp_size, "dtype": spec.dtype, "log_level": "warning",
          "skip_server_warmup": True, "random_seed": spec.seed, "trust_remote_code": spec.trust_remote_code, **extra}
    if spec.max_total_tokens is not None:
        kw["max_total_tokens"] = spec.max_total_tokens
    if spec.device == "cpu":
        kw.update(CPU_SETTINGS)
    return kw


def server_cpu_args(dtype: str = "float32", max_total_tokens: int = 4096) -> list[str]:
    """`sglang.launch_server` flags for the same CPU settings."""
    args = []
    for key, value in {**CPU_SETTINGS, "max_total_tokens": max_total_tokens, "dtype": dtype}.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


def speculative_args(num_steps: int, topk: int, num_draft_tokens: int) -> list[str]:
    """SGLang's drafting flags for these settings (the report states them; serve passes them)."""
    return ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", str(num_steps),
            "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens", str(num_draft_tokens)]


def with_shim(env: dict) -> dict:
    """`env` with the CPU shim (and the project) first on PYTHONPATH."""
    paths = [str(SHIM_DIR), str(ROOT), env.get("PYTHONPATH", "")]
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


class SGLangEngine:
    backend = "sglang"
    final_is_normed = True  # SGLang's returned hidden state is after the final norm

    def __init__(self, spec: EngineSpec, timeout_s: float = 1800):
        from transformers import AutoTokenizer

        self.spec, self.timeout_s = spec, timeout_s
        self.tokenizer = AutoTokenizer.from_pretrained(spec.target_path, trust_remote_code=spec.trust_remote_code)
        self._engine = None

    @staticmethod
    def version() -> str:
        from importlib.metadata import version

        return f"sglang {version('sglang')}"

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0) -> list[tuple[list[int], str]]:
        if self._engine is None:
            if self.spec.device == "cpu":  # this process and the scheduler processes it forks
                sys.path.insert(0, str(SHIM_DIR))
                os.environ.update(with_shim(dict(os.environ)))
            import sglang as sgl

            self._engine = sgl.Engine(**engine_kwargs(self.spec))
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
        results = []
        for out in self._engine.generate(input_ids=prompts, sampling_params=params):
            finish = (out["meta_info"].get("finish_reason") or {}).get("type")
            ids = [t for t in out["output_ids"] if t not in self.tokenizer.all_special_ids]
            results.append((ids, "length" if finish == "length" else "eos"))
        return results

    def states(self, seqs):
        import numpy as np
        import torch

        with tempfile.TemporaryDirectory(prefix="sglang_capture_") as tmp:
            spec_file, seqs_file, out = Path(tmp) / "spec.json", Path(tmp) / "seqs.json", Path(tmp) / "out.npz"
            spec_file.write_text(json.dumps(vars(self.spec)))
            seqs_file.write_text(json.dumps([list(map(int, s)) for s in seqs]))
            cmd = [sys.executable, "-m", "workflows.core.sglang", str(spec_file), str(seqs_file), str(out)]
            env = with_shim(dict(os.environ)) if self.spec.device == "cpu" else dict(os.environ)
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=self.timeout_s, cwd=ROOT)
            if proc.returncode != 0 or not out.exists():
                raise RuntimeError(f"SGLang capture failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
            data = np.load(out)
            return [(torch.from_numpy(data[f"aux_{k}"]), torch.from_numpy(data[f"final_{k}"]))
                    for k in range(len(seqs))]

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


def _prefill_states(engine, seqs: list[list[int]]) -> list:
    import numpy as np

    outs = engine.generate(input_ids=seqs, sampling_params={"max_new_tokens": 1, "temperature": 0},
                           return_hidden_states=True)
    states = []
    for seq, out in zip(seqs, outs):
        prefill = np.asarray(out["meta_info"]["hidden_states"][0], dtype=np.float32)
        if prefill.shape[0] != len(seq):
            raise RuntimeError(f"SGLang returned {prefill.shape[0]} prefill states for {len(seq)} tokens "
                               "(radix cache on?)")
        states.append(prefill)
    return states


def capture(spec: EngineSpec, seqs: list[list[int]]) -> tuple[list, list]:
    """(aux [T, n*H], final [T, H]) float32 per sequence, by two engine runs (module doc)."""
    import sglang as sgl

    engine = sgl.Engine(**engine_kwargs(spec, disable_radix_cache=True, enable_return_hidden_states=True,
                                        enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3",
                                        return_aux_hidden_state_layer_ids=list(spec.layer_ids)))
    try:
        aux = _prefill_states(engine, seqs)
    finally:
        engine.shutdown()
    engine = sgl.Engine(**engine_kwargs(spec, disable_radix_cache=True, enable_return_hidden_states=True))
    try:
        final = _prefill_states(engine, seqs)
    finally:
        engine.shutdown()
    return aux, final


def main(argv=None) -> None:
    """python -m workflows.core.sglang <spec.json> <seqs.json> <out.npz>: both passes, saved
    as aux_<k>/final_<k> float32 arrays (SGLangEngine.states runs this in a child)."""
    import numpy as np

    spec_file, seqs_file, out = sys.argv[1:] if argv is None else argv
    spec = EngineSpec(**json.loads(Path(spec_file).read_text()))
    aux, final = capture(spec, json.loads(Path(seqs_file).read_text()))
    np.savez(out, **{f"aux_{k}": a for k, a in enumerate(aux)}, **{f"final_{k}": f for k, f in enumerate(final)})


if __name__ == "__main__":
    main()
