"""Training metrics: stdout, `metrics.jsonl` (each step once, resumes included) and W&B.

W&B runs when `tracking.wandb` is on, offline by default (no account, no network: `wandb
sync` later); the config it records is redacted (workflows.core.provenance.redacted).
"""
from __future__ import annotations

import json
from pathlib import Path

from workflows.core.cli import log
from workflows.core.markers import write_bytes_atomic
from workflows.core.provenance import redacted


def keep_steps_before(file: Path, step: int) -> None:
    """Drop the records of steps `step` and later (a record's `step` is 0-based; a resume
    from a checkpoint after `step` steps logs them again), so each step stays in the file once."""
    if not file.exists():
        return
    kept = [line for line in file.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] < step]
    write_bytes_atomic(file, "".join(line + "\n" for line in kept).encode())


class Tracker:
    def __init__(self, cfg, folder: Path, resume_step: int = 0):
        file = folder / "metrics.jsonl"
        keep_steps_before(file, resume_step)
        self.file = open(file, "a")
        self.run = None
        if cfg.tracking.wandb and cfg.tracking.mode != "disabled":
            import wandb

            # x_disable_meta: W&B would otherwise record the command line, secrets and all.
            self.run = wandb.init(project=cfg.tracking.project, dir=str(cfg.run_path), mode=cfg.tracking.mode,
                                  config=redacted(cfg), reinit="finish_previous",
                                  settings=wandb.Settings(x_disable_meta=True))

    def __call__(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        ev = record.get("eval", {})
        msg = f"step {record['step'] + 1}: loss {record['loss']:.4f} acc0 {record['step_acc'][0]:.3f}"
        if ev:
            msg += f" | eval acc0 {ev['step_acc'][0]:.3f} acceptance(walk, k={ev['k']}) {ev['acceptance_walk']:.3f}"
        log(msg)
        if self.run is not None:
            flat = {"train/loss": record["loss"], "train/lr": record["lr"], "train/grad_norm": record["grad_norm"]}
            flat.update({f"train/acc_{j}": a for j, a in enumerate(record["step_acc"])})
            if ev:
                flat["eval/acceptance_walk"] = ev["acceptance_walk"]
                flat["eval/acceptance_per_position_average"] = ev["acceptance_per_position_average"]
                flat.update({f"eval/acc_{j}": a for j, a in enumerate(ev["step_acc"])})
            self.run.log(flat, step=record["step"] + 1)

    def close(self, summary: dict) -> None:
        self.file.close()
        if self.run is not None:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
            self.run.finish()
