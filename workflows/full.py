"""The whole pipeline: `python -m workflows.full [hydra overrides]`.

Runs the stages listed in `stages` in order; each one skips itself when its committed
output matches its key (config, inputs and upstream stages), so a rerun resumes where the
last one stopped. The only module that knows every stage.

    python -m workflows.full                                   # embedded default (SmolLM2, CPU)
    python -m workflows.full target=tiny train.steps=50        # fast smoke run
    python -m workflows.full stages=[train] train.steps=400    # retrain only
"""
from __future__ import annotations

import json
import time

from workflows import evaluate, export, vocab
from workflows.capture.stage import capture_main
from workflows.capture.stage import run as capture
from workflows.core.cli import hydra_entry, log
from workflows.core.config import FullConfig
from workflows.core.targets import prepare_for
from workflows.generate.stage import run as generate
from workflows.train.stage import run as train

STAGE_RUNS = {"generate": generate, "capture": capture, "vocab": vocab.run, "train": train,
              "export": export.run, "evaluate": evaluate.run}


def run(cfg: FullConfig) -> dict:
    """Every stage of `cfg.stages`, in pipeline order (the caller holds the run-folder lock)."""
    log(f"run_dir={cfg.run_path} target={cfg.target.name} stages={cfg.stages}")
    if cfg.capture.estimate_only:  # a size projection needs no target and runs nothing
        capture_main(cfg)
        return {}
    started = time.perf_counter()
    target_path = prepare_for(cfg, log=log)
    outputs, seconds = {"target": target_path}, {"target": round(time.perf_counter() - started, 1)}
    for stage, stage_run in STAGE_RUNS.items():
        if stage in cfg.stages:
            started = time.perf_counter()
            outputs[stage] = stage_run(cfg, target_path)
            seconds[stage] = round(time.perf_counter() - started, 1)
    log("stage wall times (s): " + json.dumps(seconds))
    log("done: " + ", ".join(f"{k} -> {v}" for k, v in outputs.items()))
    return outputs


main = hydra_entry(run, lock=lambda cfg: not cfg.capture.estimate_only)


if __name__ == "__main__":
    main()
