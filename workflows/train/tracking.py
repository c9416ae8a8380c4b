"""Training metrics: stdout, `metrics.jsonl` (each step once, resumes included) and W&B.

W&B runs when `tracking.wandb` is on, offline by default (no account, no network: `wandb
sync` later); the config it records is redacted (workflows.core.provenance.redacted).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from workflows.core.log import log
from workflows.core.markers import write_bytes_atomic
from workflows.core.provenance import redacted
from workflows.core.stage_metrics import StageMetrics


def keep_steps_before(file: Path, step: int) -> None:
    """Drop the records of steps `step` and later (a record's `step` is 0-based; a resume
    from a checkpoint after `step` steps logs them again), so each step stays in the file once."""
    if not file.exists():
        return
    kept = [line for line in file.read_text().splitlines() if line.strip() and json.loads(line)["step"] < step]
    write_bytes_atomic(file, "".join(line + "\n" for line in kept).encode())


def wandb_run_id(folder: Path, resume_step: int) -> str:
    """The W&B run id of this training: the one saved in `folder` when resuming (so the
    resumed run continues the same W&B run), else a new one, saved."""
    file = folder / "wandb_run_id"
    if os.environ.get("WANDB_RUN_ID"):  # a sweep agent's trial: the agent names the run
        run_id = os.environ["WANDB_RUN_ID"]
    elif resume_step > 0 and file.exists():
        return file.read_text().strip()
    else:
        run_id = uuid.uuid4().hex[:12]  # W&B run ids: lowercase letters and digits
    write_bytes_atomic(file, run_id.encode())
    return run_id


class Tracker:
    def __init__(self, cfg, folder: Path, resume_step: int = 0):
        file = folder / "metrics.jsonl"
        keep_steps_before(file, resume_step)
        self.file = open(file, "a")
        self.run = None
        self.steps = StageMetrics("train", "steps", "rank0", total=cfg.train.steps)
        self.tokens = StageMetrics("train", "tokens", "rank0")
        if cfg.tracking.wandb and cfg.tracking.mode != "disabled":
            import wandb

            # x_disable_meta: W&B would otherwise record the command line, secrets and all.
            self.run = wandb.init(
                project=cfg.tracking.project,
                dir=str(cfg.run_path),
                mode=cfg.tracking.mode,
                config=redacted(cfg),
                reinit="finish_previous",
                id=wandb_run_id(folder, resume_step),
                resume="allow",
                settings=wandb.Settings(x_disable_meta=True),
            )

    def __call__(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        ev = record.get("eval", {})
        msg = f"step {record['step'] + 1}: loss {record['loss']:.4f} acc0 {record['step_acc'][0]:.3f}"
        if ev:
            alpha0 = ev.get("step_alpha", [float("nan")])[0]
            msg += (
                f" | eval acc0 {ev['step_acc'][0]:.3f} alpha0 {alpha0:.3f} "
                f"acceptance(walk, k={ev['k']}) {ev['acceptance_walk']:.3f}"
            )
        if "tokens_per_s" in record:
            msg += f" | {record['tokens_per_s']:.0f} tok/s"
            self.tokens.throughput(record["tokens_per_s"])
        self.steps.progress(record["step"] + 1)
        log(msg)
        if self.run is not None:
            flat = {"train/loss": record["loss"], "train/lr": record["lr"], "train/grad_norm": record["grad_norm"]}
            if "tokens_per_s" in record:
                flat["train/tokens_per_s"] = record["tokens_per_s"]
            flat.update({f"train/acc_{j}": a for j, a in enumerate(record["step_acc"])})
            flat.update({f"train/alpha_{j}": a for j, a in enumerate(record.get("step_alpha", []))})
            if ev:
                flat["eval/acceptance_walk"] = ev["acceptance_walk"]
                flat["eval/acceptance_per_position_average"] = ev["acceptance_per_position_average"]
                flat.update({f"eval/acc_{j}": a for j, a in enumerate(ev["step_acc"])})
                flat.update({f"eval/alpha_{j}": a for j, a in enumerate(ev.get("step_alpha", []))})
            self.run.log(flat, step=record["step"] + 1)

    def close(self, summary: dict) -> None:
        self.file.close()
        if self.run is not None:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
            self.run.finish()
