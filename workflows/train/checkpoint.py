"""Training checkpoints: resume (weights, optimizer, data position, RNG) vs warm start (weights).

A checkpoint folder holds:

    draft/                  the draft's weights, config and provenance (workflows.core.draft_files):
                            what a warm start (`train.init_from`) reads, and nothing else
    deepspeed/ | optimizer.pt   the optimizer: DeepSpeed's per-rank files, or the plain loop's state
    loop_rank<r>.json       rank r's loop state: step, stream position (epoch, batches taken),
                            noise generator, best walk acceptance so far, and the fields a
                            resume must not change

With `train.ema_decay` > 0 the evaluated model is the weights' moving average
(eagle3.weight_average): `draft/` then holds that average, as every draft folder holds the
model its walk scored, and two more files what training goes on from:

    weight_average.safetensors  the average in fp32 and its update count (rank 0)
    training_weights.safetensors  the plain loop's raw weights (DeepSpeed's are in its files)

With Ray Train every rank writes its part into a temporary folder and hands it to
`ray.train.report`, which gathers the parts into one `checkpoint_*` folder under
`train/ray/` and records it in its snapshot only once complete; it keeps the
`train.keep_checkpoints` best by walk acceptance and always the latest. The plain loop
writes `train/checkpoint/` whole into a temporary folder and renames it into place. Either
way a crash never leaves a half-written checkpoint, nor removes the only complete one.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.schema import ConfigError
from eagle3.weight_average import WeightAverage
from workflows.core.log import log
from workflows.core.markers import read_json, write_json_atomic

DRAFT = "draft"
RAY_RUN_NAME = "draft"
AVERAGE = "weight_average.safetensors"
TRAINING_WEIGHTS = "training_weights.safetensors"


def save_average(folder: Path, average: WeightAverage) -> None:
    state = average.state_dict()
    tensors = {n: t.contiguous().cpu() for n, t in state["average"].items()}
    save_file(tensors, str(folder / AVERAGE), metadata={"updates": str(state["updates"])})


def load_average(folder: Path, average: WeightAverage) -> None:
    file = folder / AVERAGE
    if not file.exists():
        raise ConfigError(
            f"{folder}: no {AVERAGE} to resume train.ema_decay from; move the checkpoint away, "
            "or start afresh with train.resume=false"
        )
    with safe_open(str(file), "pt") as f:  # one read: the tensors and their update count
        state = {"updates": int(f.metadata()["updates"]), "average": {k: f.get_tensor(k) for k in f.keys()}}
    average.load_state_dict(state)


def encode_state(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode()


def decode_state(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def write_loop_state(folder: Path, rank: int, state: dict) -> None:
    write_json_atomic(folder / f"loop_rank{rank}.json", state)


def resume_mismatch(saved: dict, current: dict) -> list[str]:
    """The resume-relevant fields that differ, as 'field: saved -> now' lines."""
    return [
        f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
        for k in sorted(set(saved) | set(current))
        if saved.get(k) != current.get(k)
    ]


def check_resumable(folder: Path, current: dict) -> dict:
    """Rank 0's loop state of the checkpoint in `folder`, refusing a changed config."""
    file = folder / "loop_rank0.json"
    if not file.exists():
        raise ConfigError(f"{folder}: a checkpoint without its loop state (loop_rank0.json); move it away")
    state = read_json(file)
    diff = resume_mismatch(state.get("resume_fields", {}), current)
    if diff:
        raise ConfigError(
            f"{folder} holds a checkpoint that cannot be resumed with this config, which changed "
            + "; ".join(diff)
            + ". Resume with the old settings, or start afresh: train.resume=false (or another run_dir); "
            "train.init_from=<a draft folder> warm-starts from weights only"
        )
    return state


def read_loop_state(folder: Path, rank: int, current: dict) -> dict:
    check_resumable(folder, current)
    file = folder / f"loop_rank{rank}.json"
    if not file.exists():
        raise ConfigError(f"{folder}: no loop state of rank {rank} (saved by another world size?)")
    state = read_json(file)
    return {**state, "generator": decode_state(state["generator"])}


def ray_run_dir(train_dir: Path) -> Path:
    return train_dir / "ray" / RAY_RUN_NAME


def latest_ray_checkpoint(train_dir: Path) -> Path | None:
    """The checkpoint Ray Train will restore: the latest in its snapshot (complete by
    construction: Ray records a checkpoint only after every rank's files are in)."""
    snapshot = ray_run_dir(train_dir) / "checkpoint_manager_snapshot.json"
    if not snapshot.exists():
        return None
    latest = json.loads(snapshot.read_text()).get("latest_checkpoint_result")
    if not latest:
        return None
    folder = ray_run_dir(train_dir) / latest["checkpoint_dir_name"]
    return folder if folder.exists() else None


def latest_checkpoint(train_dir: Path, backend: str) -> Path | None:
    if backend == "deepspeed":
        return latest_ray_checkpoint(train_dir)
    folder = train_dir / "checkpoint"
    return folder if (folder / "loop_rank0.json").exists() else None


def resumable_checkpoint(resume: bool, layout, backend: str, fields: dict) -> Path | None:
    """The latest checkpoint to resume from (None: start afresh, the old ones removed when
    `resume` is off); one whose data, maths or schedule differ is refused here, naming them,
    before any worker starts."""
    out = layout.stage_dir("train")
    if not resume:
        for folder in (ray_run_dir(out), layout.checkpoint_dir):
            shutil.rmtree(folder, ignore_errors=True)
    latest = latest_checkpoint(out, backend)
    if latest is not None:
        state = check_resumable(latest, fields)
        log(f"train: resuming from step {state['step']} ({latest})")
    return latest
