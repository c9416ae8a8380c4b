"""The whole pipeline: `python -m workflows.full [hydra overrides]`.

Runs the stages listed in `stages` in order; each one skips itself when its committed
output matches its key (config, inputs and upstream stages), so a rerun resumes where the
last one stopped. The only module that knows every stage.

    python -m workflows.full                                   # embedded default (SmolLM2, CPU)
    python -m workflows.full target=tiny train.steps=50        # fast smoke run
    python -m workflows.full stages=[train] train.steps=400    # retrain only
    python -m workflows.full -m train.ttt.length=3,7           # two jobs, one corpus and store

With `shared_dir` (on under multirun and W&B sweeps) the corpus, store and vocabulary are
shared between runs (see workflows.core.layout): each shared stage runs under its lock,
so a job that needs one another job is building waits, then reuses it.
"""

from __future__ import annotations

import json
import time

from workflows import evaluate, export, vocab
from workflows.capture.stage import capture_main
from workflows.capture.stage import run as capture
from workflows.core.cli import hydra_entry
from workflows.core.cluster import STREAM_SYSTEM_CONFIG, ensure_ray, stream_cpus
from workflows.core.config import FullConfig
from workflows.core.layout import RunLayout
from workflows.core.log import log
from workflows.core.records import ReportHeadline
from workflows.core.serving import verdict
from workflows.core.targets import prepare_for
from workflows.generate.stage import run as generate
from workflows.train.stage import run as train

STAGE_RUNS = {
    "generate": generate,
    "capture": capture,
    "vocab": vocab.run,
    "train": train,
    "export": export.run,
    "evaluate": evaluate.run,
}


def run(cfg: FullConfig) -> dict:
    """Every stage of `cfg.stages`, in pipeline order (the caller holds the run-folder lock)."""
    log(f"run_dir={cfg.run_path} target={cfg.target.name} stages={cfg.stages}")
    layout = RunLayout.of(cfg)
    for stage, folder in layout.shared.items():
        log(f"shared {stage}: {folder}")
    if cfg.capture.estimate_only:  # a size projection needs no target and runs nothing
        capture_main(cfg)
        return {}
    if cfg.train.data_source == "stream" and "train" in cfg.stages:
        # The first stage to use Ray starts it: with the streaming train stage's CPUs and settings.
        ensure_ray(cfg.cluster, system_config=STREAM_SYSTEM_CONFIG, min_cpus=stream_cpus(cfg))
    started = time.perf_counter()
    target_path = prepare_for(cfg, log=log)
    outputs, seconds = {"target": target_path}, {"target": round(time.perf_counter() - started, 1)}
    for stage, stage_run in STAGE_RUNS.items():
        if stage == "capture" and stage in cfg.stages and cfg.train.data_source == "stream":
            # The train stage streams the states from its own engine actors: no store to build.
            log("capture: skipped, train.data_source=stream computes the states while training")
            continue
        if stage in cfg.stages:
            started = time.perf_counter()
            with layout.shared_stage_lock(stage):
                outputs[stage] = stage_run(cfg, target_path)
            seconds[stage] = round(time.perf_counter() - started, 1)
    log("stage wall times (s): " + json.dumps(seconds))
    log("done: " + ", ".join(f"{k} -> {v}" for k, v in outputs.items()))
    for line in headline(cfg):
        log(line)
    return outputs


def why_not_lossless(found: list[dict]) -> str:
    """Why a report is not lossless, from its divergences: numerical ties or defects."""
    if not found:
        return ""
    ties = sum(d["kind"] == "numerical tie" for d in found)
    return (
        f" ({ties} of {len(found)} divergent prompts numerical ties in {found[0]['dtype']}, "
        f"{len(found) - ties} defects: see the report)"
    )


def headline(cfg: FullConfig) -> list[str]:
    """The report's headline, the exported draft and how to serve exactly what was evaluated:
    with the engine the report names (SGLang for EAGLE-3, vLLM for DFlash), on this machine
    as the report ran (`serve.cpu=true` after an evaluation on the CPU)."""
    layout = RunLayout.of(cfg)
    if layout.done_key("evaluate") is None or not layout.report_file.is_file():
        return []
    r = ReportHeadline.read(layout.report_file)
    served = [verdict({"engine_name": engine, **c}) for engine, c in r.served.items() if "skipped" not in c]
    engine_figure = (
        f"vLLM's definition {r.acceptance_decoded_vllm_definition:.3f}"
        if r.serve_engine == "vllm" and r.acceptance_decoded_vllm_definition is not None
        else f"SGLang's definition {r.acceptance_decoded_sglang_definition:.3f}"
    )
    overrides = [f"target={cfg.target.name}", f"run_dir={layout.root}"]
    if r.draft_family != "eagle3":  # the config group of the family (conf/draft/), as the run had it
        overrides.append(f"draft={r.draft_family}")
    if r.device == "cpu":  # the engine's CPU settings: without them SGLang finds no accelerator
        overrides.append("serve.cpu=true")
    return [
        f"acceptance: offline {r.acceptance_offline:.3f}, decoded {r.acceptance_decoded:.3f} "
        f"({engine_figure}), parity "
        f"{r.parity_ratio:.3f}, lossless {r.lossless}{why_not_lossless(r.divergences)}, "
        f"speed-up {r.speedup_decoded:.2f} "
        f"(reference decoder, {r.dtype}); {layout.report_markdown}" + "".join(f"; served by {v}" for v in served),
        f"draft: {layout.export_dir(r.serve_engine) if layout.done_key('export') else layout.draft_dir}",
        f"serve it with {r.serve_engine} as evaluated ({' '.join(r.serve_args)}): python -m workflows.tools.serve "
        f"{' '.join(overrides)} serve.launch=true",
    ]


if __name__ == "__main__":  # built only when run: importing this module registers nothing with Hydra
    hydra_entry(run, lock=lambda cfg: not cfg.capture.estimate_only)()
