"""Regeneration throughput: the generate stage (Ray Data actor pool, chat template, masks,
committed shards) vs the same engine's plain batched generate, same prompts, one run.

    python -m bench.bench_generate [target=smollm2_135m] [data.limit=16] [data.max_new_tokens=64] ...

Takes Hydra overrides of the `full` config (mixture=bundled by default). Prints answer
tokens/s of both and the ratio stage/plain, end to end (Ray start and engine load included)
and for the Ray Data execution alone. Single-turn prompts, so both do the same generation.
"""

from __future__ import annotations

import sys
import tempfile
import time

from workflows.core.config import compose
from workflows.core.layout import RunLayout
from workflows.core.log import log
from workflows.core.precision import resolve
from workflows.core.targets import prepare_for
from workflows.generate import stage as generate


def main(overrides: list[str]) -> dict:
    from eagle3.chat_template import generation_prompt_ids
    from workflows.core.engine_spec import EngineSpec
    from workflows.core.engines import HFEngine
    from workflows.generate.regenerate import Settings

    defaults = [
        "mixture=bundled",
        "data.limit=16",
        "data.max_new_tokens=64",
        "data.batch_size=8",
        "data.shard_size=8",
        "data.temperature=0",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose([*defaults, f"run_dir={tmp}", *overrides])
        target_path = prepare_for(cfg, log=log)
        prompts = generate.ingest_mixture(cfg.mixture, cfg.data, cfg.cache_path)[0]
        if any(sum(m["role"] == "user" for m in p["messages"]) != 1 for p in prompts):
            raise SystemExit("bench_generate compares single-turn prompts only (use mixture=bundled)")

        # Plain: one in-process engine, batched generate over the same generation prompts.
        s = Settings(
            max_new_tokens=cfg.data.max_new_tokens, max_length=cfg.data.max_length, dtype=resolve(cfg.data.dtype)
        )
        t0 = time.perf_counter()
        engine = HFEngine(EngineSpec(str(target_path), dtype=s.dtype))
        load_s = time.perf_counter() - t0
        ids = [
            generation_prompt_ids(
                engine.tokenizer, [m for m in p["messages"] if m["role"] != "assistant"], **s.template_kwargs
            )
            for p in prompts
        ]
        t0 = time.perf_counter()
        plain_tokens = 0
        for i in range(0, len(ids), cfg.data.batch_size):
            for answer, finish in engine.generate(ids[i : i + cfg.data.batch_size], s.max_new_tokens):
                plain_tokens += len(answer) + (finish == "eos")  # the stage masks the end-of-turn token too
        plain_s = time.perf_counter() - t0
        del engine

        # The stage: Ray Data, actor pool of one engine, shards committed.
        t0 = time.perf_counter()
        phases = {}
        out = generate.run(cfg, target_path, on_commit=lambda k: phases.setdefault("first_commit", time.perf_counter()))
        stage_s = time.perf_counter() - t0
        samples = RunLayout.of(cfg).read_corpus()
        stage_tokens = sum(sum(r["loss_mask"]) for r in samples)
        del out
    result = {
        "target": cfg.target.name,
        "prompts": len(prompts),
        "max_new_tokens": cfg.data.max_new_tokens,
        "batch_size": cfg.data.batch_size,
        "plain_tokens": plain_tokens,
        "plain_s": round(plain_s, 2),
        "plain_load_s": round(load_s, 2),
        "plain_tok_s": round(plain_tokens / plain_s, 1),
        "plain_tok_s_with_load": round(plain_tokens / (plain_s + load_s), 1),
        "stage_tokens": stage_tokens,
        "stage_s": round(stage_s, 2),
        "stage_tok_s": round(stage_tokens / stage_s, 1),
    }
    result["ratio_stage_vs_plain"] = round(result["stage_tok_s"] / result["plain_tok_s"], 3)
    result["ratio_stage_vs_plain_with_load"] = round(result["stage_tok_s"] / result["plain_tok_s_with_load"], 3)
    for k, v in result.items():
        print(f"{k:>32}: {v}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
