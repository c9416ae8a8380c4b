"""SGLang capture engine (`capture.backend=sglang`) and its CPU parity entry point.

SGLang returns the aux states (`enable_return_aux_hidden_states` with
`return_aux_hidden_state_layer_ids` = our ids: id i is the output of layer i, the same
tensor SGLang calls the input of layer i+1) *instead of* the final hidden state: one
engine run cannot return both. `final` (after the final norm) therefore comes from a
second engine in full mode (`enable_return_hidden_states`), run after the first has been
shut down, so only one engine holds memory at a time. Radix cache is off (with it on only
the uncached suffix comes back). On CPU: torch_native attention, pytorch sampling, no CUDA
graphs, no overlap schedule, and the vllm shim in workflows/sglang_cpu_shim on PYTHONPATH.

    python -m workflows.sglang_capture <target> <ids-json> <seqs-json> <out.npz> [--device cpu]
        [--dtype float32] [--max-tokens 4096] [--tp-size 1]

runs both passes and saves aux_<k>/final_<k> float32 arrays: the scheduler can SIGKILL its
caller on an error, so tests and the stage run it in a subprocess.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

SHIM = Path(__file__).resolve().parent / "sglang_cpu_shim"


def engine_kwargs(target: str, device: str, dtype: str, max_tokens: int, tp_size: int = 1) -> dict:
    kw = {"model_path": target, "tp_size": tp_size, "disable_radix_cache": True, "dtype": dtype, "log_level": "warning",
          "skip_server_warmup": True, "max_total_tokens": max_tokens}
    if device == "cpu":
        kw.update(device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
                  disable_cuda_graph=True, disable_overlap_schedule=True, mem_fraction_static=0.05)
    return kw


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


def capture(target: str, layer_ids: list[int], seqs: list[list[int]], device: str = "cpu",
            dtype: str = "float32", max_tokens: int = 4096, tp_size: int = 1) -> tuple[list, list]:
    """(aux [T, n*H], final [T, H]) float32 per sequence, by two engine runs."""
    import sglang as sgl

    kw = engine_kwargs(target, device, dtype, max_tokens, tp_size)
    engine = sgl.Engine(**kw, enable_return_hidden_states=True, enable_return_aux_hidden_states=True,
                        speculative_algorithm="EAGLE3", return_aux_hidden_state_layer_ids=list(layer_ids))
    try:
        aux = _prefill_states(engine, seqs)
    finally:
        engine.shutdown()
    engine = sgl.Engine(**kw, enable_return_hidden_states=True)
    try:
        final = _prefill_states(engine, seqs)
    finally:
        engine.shutdown()
    return aux, final


class SGLangEngine:
    """The capture-engine interface over `capture` in a subprocess (one per call: an
    engine error cannot kill the Ray actor, and no engine outlives the call)."""

    backend = "sglang"
    final_is_normed = True  # SGLang's returned hidden state is after the final norm

    def __init__(self, target_path: str, layer_ids: list[int], dtype: str = "float32", device: str = "cpu",
                 max_tokens: int = 4096, tp_size: int = 1, timeout_s: float = 1800, **_ignored):
        self.target, self.layer_ids, self.dtype, self.device = str(target_path), list(layer_ids), dtype, device
        self.tp_size = tp_size
        self.max_tokens, self.timeout_s = max_tokens, timeout_s

    @staticmethod
    def version() -> str:
        from importlib.metadata import version

        return f"sglang {version('sglang')}"

    def states(self, seqs):
        import subprocess
        import tempfile

        import numpy as np
        import torch

        with tempfile.TemporaryDirectory(prefix="sglang_capture_") as tmp:
            (Path(tmp) / "seqs.json").write_text(json.dumps([list(map(int, s)) for s in seqs]))
            cmd = [sys.executable, "-m", "workflows.sglang_capture", self.target, json.dumps(self.layer_ids),
                   str(Path(tmp) / "seqs.json"), str(Path(tmp) / "out.npz"), "--device", self.device,
                   "--dtype", self.dtype, "--max-tokens", str(self.max_tokens), "--tp-size", str(self.tp_size)]
            proc = subprocess.run(cmd, env=subprocess_env(self.device), capture_output=True, text=True,
                                  timeout=self.timeout_s, cwd=Path(__file__).resolve().parents[1])
            if proc.returncode != 0 or not (Path(tmp) / "out.npz").exists():
                raise RuntimeError(f"SGLang capture failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
            data = np.load(Path(tmp) / "out.npz")
            return [(torch.from_numpy(data[f"aux_{k}"]), torch.from_numpy(data[f"final_{k}"]))
                    for k in range(len(seqs))]


def subprocess_env(device: str = "cpu") -> dict:
    env = dict(os.environ)
    if device == "cpu":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SHIM), env.get("PYTHONPATH")]))
    return env


def main(argv=None) -> None:
    import numpy as np

    argv = sys.argv[1:] if argv is None else argv
    target, ids, seqs, out = argv[0], json.loads(argv[1]), json.loads(Path(argv[2]).read_text()), argv[3]
    opt = lambda name, default: argv[argv.index(name) + 1] if name in argv else default
    aux, final = capture(target, ids, seqs, device=opt("--device", "cpu"), dtype=opt("--dtype", "float32"),
                         max_tokens=int(opt("--max-tokens", 4096)), tp_size=int(opt("--tp-size", 1)))
    np.savez(out, **{f"aux_{k}": a for k, a in enumerate(aux)}, **{f"final_{k}": f for k, f in enumerate(final)})


if __name__ == "__main__":
    main()
