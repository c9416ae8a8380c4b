"""Training checkpoints: resume (weights, optimizer, data position, RNG) vs warm start (weights).

A checkpoint folder is a draft folder (workflows.core.draft_files) plus:

    optimizer.pt        optimizer state (resume only; read with weights_only=True)
    loop.json           step, config key, generator state (resume only)

It is written whole into a temp folder and renamed into place, so a crash never leaves a
half-written checkpoint, nor removes the previous one before the new one is complete.
"""
from __future__ import annotations

import base64
from pathlib import Path

import torch

from eagle3.schema import ConfigError
from workflows.core.draft_files import save_draft
from workflows.core.markers import atomic_dir, read_json, write_json_atomic


def save_checkpoint(folder: Path, draft, provenance, step: int, optimizer, generator, key: str) -> None:
    with atomic_dir(folder) as tmp:
        save_draft(tmp, draft, provenance)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        state = base64.b64encode(generator.get_state().cpu().numpy().tobytes()).decode()
        write_json_atomic(tmp / "loop.json", {"step": step, "key": key, "generator_state": state})


def load_resume_state(folder: Path, key: str) -> dict | None:
    """Optimizer, step and generator state if `folder` holds a checkpoint of this config."""
    loop_file = folder / "loop.json"
    if not loop_file.exists():
        return None
    loop = read_json(loop_file)
    if loop.get("key") != key:
        raise ConfigError(
            f"{folder} holds a checkpoint of a different training config (key {loop.get('key')} != {key}); "
            "move it away or choose another run_dir to start afresh"
        )
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True, map_location="cpu")
    gen = torch.frombuffer(bytearray(base64.b64decode(loop["generator_state"])), dtype=torch.uint8)
    return {"step": int(loop["step"]), "optimizer": optimizer, "generator": gen}
