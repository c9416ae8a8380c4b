"""python -m workflows.core.served_sglang <job.json> <out.json>: SGLang's offline Engine
serves the job's prompts with EAGLE-3 speculative decoding and writes what it produced
(workflows.core.serving runs this in a child process, with the environment it needs).
With the job's `baseline`, a second Engine without the draft then serves the same prompts:
the engine's own tokens/s with and without its draft, each after a one-prompt warm-up."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from workflows.core.sglang import CPU_SETTINGS, SPECULATIVE_CPU_SETTINGS


def engine_kwargs(job: dict, draft: bool = True) -> dict:
    """The Engine's arguments: with the job's draft, or (`draft=False`) the target alone."""
    longest = max(len(p) + n for p, n in zip(job["prompts"], job["max_new_tokens"]))
    kw = {
        "model_path": job["target_path"],
        "dtype": job["dtype"],
        "tp_size": job["tp_size"],
        "random_seed": job["seed"],
        "trust_remote_code": job["trust_remote_code"],
        "log_level": "warning",
        "skip_server_warmup": True,
        "disable_radix_cache": True,  # every prompt verified from its first token
        # Token ids in, token ids out: a multimodal wrapper (kimi_k25) would otherwise load an
        # image processor the checkpoint need not have; no effect on a text model.
        "enable_multimodal": False,
        "context_length": longest + job["num_draft_tokens"] + 8,
    }
    if draft:
        kw.update(
            {
                "speculative_algorithm": "EAGLE3",
                "speculative_draft_model_path": job["draft_path"],
                "speculative_num_steps": job["num_steps"],
                "speculative_eagle_topk": job["topk"],
                "speculative_num_draft_tokens": job["num_draft_tokens"],
            }
        )
    if job["device"] == "cpu":
        kw.update(SPECULATIVE_CPU_SETTINGS if draft else CPU_SETTINGS)
        kw["max_total_tokens"] = max(4096, 2 * len(job["prompts"]) * kw["context_length"])
    return kw


def main(argv=None) -> None:
    job_file, out_file = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(job_file).read_text())
    from importlib.metadata import version

    import sglang as sgl

    engine = sgl.Engine(**engine_kwargs(job))
    try:
        warm_up(engine, job)
        t0 = time.perf_counter()
        result = {"engine": f"sglang {version('sglang')}", **round_of(engine, job, 0.0, None)}
        result["seconds"] = time.perf_counter() - t0
        if job["sampled_temperature"] > 0:
            rounds = [round_of(engine, job, job["sampled_temperature"], seed) for seed in job["sampled_seeds"]]
            result["sampled"] = {key: [v for r in rounds for v in r[key]] for key in rounds[0]}
            result["sampled_verify"] = verify_rule(job["device"])
    finally:
        engine.shutdown()
    if job.get("baseline"):  # the same prompts, the target alone: the engine's speed without its draft
        engine = sgl.Engine(**engine_kwargs(job, draft=False))
        try:
            warm_up(engine, job)
            t0 = time.perf_counter()
            plain = round_of(engine, job, 0.0, None)
            result["baseline"] = {"seconds": time.perf_counter() - t0, "outputs": plain["outputs"]}
        finally:
            engine.shutdown()
    Path(out_file).write_text(json.dumps(result))


def warm_up(engine, job: dict) -> None:
    """One short request first, so that neither timed round pays for the engine's first one."""
    engine.generate(input_ids=[job["prompts"][0]], sampling_params=[{"max_new_tokens": 4, "temperature": 0.0}])


def verify_rule(device: str) -> str:
    """How this SGLang verifies drafts when the request samples, asked of SGLang itself:
    "sampling" (speculative sampling's accept/resample rule), "argmax" (it commits the
    target's argmax at any temperature: 0.5.23 does so on a CPU, having no sampling kernel
    there), or "unknown" where the installed version has no such switch."""
    try:
        from sglang.srt.speculative.eagle_utils import _verify_uses_greedy

        greedy = _verify_uses_greedy(
            is_all_greedy=False, is_cpu=device == "cpu", is_hip=False, is_xpu=False, use_rejection_sampling=False
        )
    except (ImportError, TypeError):
        return "unknown"
    return "argmax" if greedy else "sampling"


def round_of(engine, job: dict, temperature: float, seed: int | None) -> dict:
    """The job's prompts once, greedy or sampled (each request seeded from `seed`)."""
    # The reference decoder's stop tokens; SGLang also stops at the target's own EOS ids.
    params = [
        {"max_new_tokens": n, "temperature": temperature, "stop_token_ids": job["eos"]} for n in job["max_new_tokens"]
    ]
    if seed is not None:
        for k, p in enumerate(params):
            p["sampling_seed"] = seed * 100003 + k
    outs = engine.generate(input_ids=job["prompts"], sampling_params=params)
    metas = [o["meta_info"] for o in outs]
    return {
        "outputs": [list(map(int, o["output_ids"])) for o in outs],
        "completion_tokens": [int(m["completion_tokens"]) for m in metas],
        "verify_passes": [int(m.get("spec_verify_ct") or 0) for m in metas],
        "accept_length_reported": [m.get("spec_accept_length") for m in metas],
    }


if __name__ == "__main__":
    main()
