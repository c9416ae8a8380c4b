"""Draft checkpoints: resume (weights, optimizer, data position, RNG) vs warm start (weights).

Layout of a checkpoint folder (written whole, then renamed into place):

    draft.safetensors   the draft's trainable weights and d2t/t2d, SGLang key names
                        (the frozen target embeddings are not copied: they come from the target)
    draft_config.json   the DraftConfig
    provenance.json     target, capture ids and convention, code version, config
    optimizer.pt        optimizer state (resume only; read with weights_only=True)
    loop.json           step, config key, generator state (resume only)
"""
from __future__ import annotations

import base64
import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3.draft_config import DraftConfig
from eagle3.modeling import Eagle3Draft
from eagle3.schema import ConfigError, from_dict
from workflows.common import atomic_dir, read_json, write_json_atomic

FROZEN = ("embed_tokens.weight",)


def draft_state(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items() if k not in FROZEN}


def save_draft(folder: Path, draft: Eagle3Draft, provenance: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(draft_state(draft), str(folder / "draft.safetensors"), metadata={"format": "pt"})
    write_json_atomic(folder / "draft_config.json", asdict(draft.cfg))
    write_json_atomic(folder / "provenance.json", provenance)


def save_checkpoint(folder: Path, draft, provenance, step: int, optimizer, generator, key: str) -> None:
    with atomic_dir(folder) as tmp:
        save_draft(tmp, draft, provenance)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        state = base64.b64encode(generator.get_state().numpy().tobytes()).decode()
        write_json_atomic(tmp / "loop.json", {"step": step, "key": key, "generator_state": state})


def load_draft_config(folder: Path) -> DraftConfig:
    return from_dict(DraftConfig, read_json(folder / "draft_config.json"), "draft_config")


def load_draft_weights(folder: Path, draft: Eagle3Draft) -> None:
    """Warm start: weights and vocab mapping only. Shapes must match the draft exactly."""
    weights = load_file(str(folder / "draft.safetensors"))
    own = draft.state_dict()
    for name, tensor in weights.items():
        if name not in own:
            raise ConfigError(f"{folder}/draft.safetensors: unexpected tensor {name!r}")
        if own[name].shape != tensor.shape:
            raise ConfigError(
                f"{folder}/draft.safetensors: {name} has shape {tuple(tensor.shape)}, the draft expects "
                f"{tuple(own[name].shape)}"
            )
    missing = sorted(set(own) - set(weights) - set(FROZEN))
    if missing:
        raise ConfigError(f"{folder}/draft.safetensors lacks {missing}")
    draft.load_state_dict(weights, strict=False)


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


def provenance_record(cfg, target_prov: dict, vocab_summary: dict, code_version: str) -> dict:
    """Stdlib-only metadata that every draft artefact carries."""
    from eagle3.layer_ids import CONVENTION
    from eagle3.target_features import FINAL_IS_NORMED
    from eagle3.schema import to_dict

    return {
        "target": target_prov,
        "target_name": cfg.target.name,
        "capture_layer_ids": cfg.target.capture_ids,
        "layer_id_convention": CONVENTION,
        "final_hidden_is_normed": FINAL_IS_NORMED,
        "hidden_size": cfg.target.hidden_size,
        "vocab": vocab_summary,
        "code_version": code_version,
        "config": json.loads(json.dumps(to_dict(cfg), default=str)),
    }
