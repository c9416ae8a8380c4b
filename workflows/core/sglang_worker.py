"""The capture worker: the child process that holds the SGLang engine of a `SGLangEngine`'s
`states()` (workflows.core.sglang starts it, `python -m workflows.core.sglang_worker ...`).

Its own module, beside the engine: it drives SGLang's runner (workflows.core.sglang_runner),
which takes the engine's settings from workflows.core.sglang, so the engine never imports the
runner back. Each request is answered with the states of its sequences in a file: with the
runner, the aux and the final states of one forward; with the tail, the Engine's aux states.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from workflows.core import sglang_runner
from workflows.core.engine_spec import EngineSpec
from workflows.core.sglang import engine_kwargs, exit_with_parent


def _prefill_states(engine, seqs: list[list[int]]) -> list:
    import numpy as np

    outs = engine.generate(
        input_ids=seqs, sampling_params={"max_new_tokens": 1, "temperature": 0}, return_hidden_states=True
    )
    states = []
    for seq, out in zip(seqs, outs):
        prefill = np.asarray(out["meta_info"]["hidden_states"][0], dtype=np.float32)
        if prefill.shape[0] != len(seq):
            raise RuntimeError(
                f"SGLang returned {prefill.shape[0]} prefill states for {len(seq)} tokens (radix cache on?)"
            )
        states.append(prefill)
    return states


def _aux_engine(spec: EngineSpec, request: list[int]):
    import sglang as sgl

    return sgl.Engine(
        **engine_kwargs(
            spec,
            disable_radix_cache=True,
            enable_return_hidden_states=True,
            enable_return_aux_hidden_states=True,
            speculative_algorithm="EAGLE3",
            return_aux_hidden_state_layer_ids=request,
        )
    )


def main(argv=None) -> None:
    """python -m workflows.core.sglang_worker <job.json> <request fd> <reply fd>: the capture worker.
    It answers one JSON line per request ({"seqs": file, "out": file, "n": k}) with {"ok": true,
    "n": k} once `out` holds the states (runner: `aux`, `final` for the whole call and their
    `dtype`; tail: aux_<k> per sequence, float32), or {"error": ...};
    at EOF on its request pipe (its parent closed it or died) it shuts the engine down."""
    import traceback

    import numpy as np

    job_file, req_fd, reply_fd = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(job_file).read_text())
    spec, method, request = EngineSpec(**job["spec"]), job["method"], job["request"]
    requests, replies = os.fdopen(int(req_fd), "r"), os.fdopen(int(reply_fd), "w")

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    exit_with_parent()  # SGLang's own processes and the runner's TP ranks die with this one
    engine = runner = None
    followers = []
    try:
        if method == "runner":  # one runner (and its TP ranks) for the stage
            runner, followers = sglang_runner.start(spec, request)
        else:  # tail: one engine for the stage
            engine = _aux_engine(spec, request)
        # What SGLang set up, read back from its model: the layers (by input) it captures. The
        # tail's Engine runs the model in its scheduler process, out of reach: not reported.
        reply({"ready": True, "layers_to_capture": runner and layers_to_capture(runner.runner.model)})
        for line in requests:
            job = json.loads(line)
            try:
                seqs = json.loads(Path(job["seqs"]).read_text())
                if runner is not None:
                    states = runner.states(seqs, spec.micro_batch_tokens, capture=not job.get("bare"))
                    if states is not None:
                        np.savez(job["out"], **_as_arrays(*states))
                elif job.get("bare"):  # the benchmark's baseline: the same prefill, no state returned
                    engine.generate(input_ids=seqs, sampling_params={"max_new_tokens": 1, "temperature": 0})
                else:
                    np.savez(job["out"], **{f"aux_{k}": a for k, a in enumerate(_prefill_states(engine, seqs))})
                reply({"ok": True, "n": job["n"]})
            except Exception:
                reply({"error": traceback.format_exc()[-3000:], "n": job.get("n")})
    except Exception:
        reply({"error": traceback.format_exc()[-3000:]})  # e.g. the engine failed to start
    finally:
        if engine is not None:
            engine.shutdown()
        if runner is not None:
            runner.close()
        for process in followers:
            process.join(timeout=60)


def layers_to_capture(model) -> list[int] | None:
    """The `layers_to_capture` of the decoder inside an SGLang model (set by its
    set_eagle3_layers_to_capture; a multimodal wrapper holds the language model deeper)."""
    for module in model.modules():
        layers = getattr(module, "layers_to_capture", None)
        if isinstance(layers, (list, tuple)) and layers:
            return [int(layer) for layer in layers]
    return None


def _as_arrays(aux, final) -> dict:
    """The runner's tensors as numpy arrays for the reply file; bf16 (which numpy lacks) as
    its bit patterns, so a bf16 engine's states cross at half the bytes of float32."""
    import torch

    from storage.zarr_io import to_bf16_bits

    if aux.dtype == torch.bfloat16:
        return {"aux": to_bf16_bits(aux), "final": to_bf16_bits(final), "dtype": "bfloat16"}
    return {"aux": aux.float().cpu().numpy(), "final": final.float().cpu().numpy(), "dtype": "float32"}


if __name__ == "__main__":
    main()
