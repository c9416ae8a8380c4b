"""The whole pipeline: `python -m workflows.full [hydra overrides]`.

Runs the stages listed in `stages` in order; each one skips itself when its committed
output matches the config, so a rerun resumes where the last one stopped.

    python -m workflows.full                                   # embedded default (SmolLM2, CPU)
    python -m workflows.full target=tiny train.steps=50        # fast smoke run
    python -m workflows.full stages=[train] train.steps=400    # retrain only
"""
from __future__ import annotations

import hydra

from workflows.common import log
from workflows.config import FullConfig, load_config


def run(cfg: FullConfig) -> dict:
    from workflows import capture, evaluate, export, generate, target, train, vocab

    log(f"run_dir={cfg.run_path} target={cfg.target.name} stages={cfg.stages}")
    target_path = target.prepare_for(cfg, log=log)
    outputs = {"target": target_path}
    if "generate" in cfg.stages:
        outputs["generate"] = generate.run(cfg, target_path)
    if "capture" in cfg.stages:
        outputs["capture"] = capture.run(cfg, target_path)
    if "vocab" in cfg.stages:
        outputs["vocab"] = vocab.run(cfg)
    if "train" in cfg.stages:
        outputs["train"] = train.run(cfg, target_path)
    if "export" in cfg.stages:
        outputs["export"] = export.run(cfg, target_path)
    if "evaluate" in cfg.stages:
        outputs["evaluate"] = evaluate.run(cfg, target_path)
    log("done: " + ", ".join(f"{k} -> {v}" for k, v in outputs.items()))
    return outputs


@hydra.main(config_path="../conf", config_name="full", version_base="1.3")
def main(hydra_cfg) -> None:
    run(load_config(hydra_cfg))


if __name__ == "__main__":
    main()
