"""A draft folder on disk: what train writes and export, evaluate and the doctor read.

    draft.safetensors   the draft's trainable weights and d2t/t2d, SGLang key names
                        (the frozen target embeddings are not copied: they come from the target)
    draft_config.json   the draft's architecture (its family's config, eagle3.families)
    provenance.json     target identity, capture ids and convention, code version, config

Training checkpoints (workflows.train.checkpoint) add the optimizer and loop state to the
same three files; a warm start reads only these. An export folder (workflows.export) is
what the serving engines read, in the Hugging Face layout:

    config.json         the engine's draft config (SGLang's LlamaForCausalLMEagle3, or vLLM's)
    model.safetensors   the same weights, under the engine's key names
    mask_embedding.pt   a block draft's mask-slot embedding (vLLM's override of the mask id's row)
    provenance.json     as above

Every reader and writer names these files through the constants below.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3.families import config_from_dict
from eagle3.schema import ConfigError
from workflows.core.markers import read_json, write_json_atomic

WEIGHTS = "draft.safetensors"
CONFIG = "draft_config.json"
PROVENANCE = "provenance.json"
EXPORT_CONFIG = "config.json"
EXPORT_WEIGHTS = "model.safetensors"
MASK_EMBEDDING = "mask_embedding.pt"  # a block draft's mask-slot embedding, beside its export (vLLM's name)
FROZEN = ("embed_tokens.weight",)


def draft_state(draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items() if k not in FROZEN}


def save_draft(folder: Path, draft: torch.nn.Module, provenance: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(draft_state(draft), str(folder / WEIGHTS), metadata={"format": "pt"})
    write_json_atomic(folder / CONFIG, asdict(draft.cfg))
    write_json_atomic(folder / PROVENANCE, provenance)


def load_draft_config(folder: Path):
    """The draft's architecture, of its family's config class (eagle3.families)."""
    return config_from_dict(read_json(folder / CONFIG), str(folder / CONFIG))


def load_provenance(folder: Path) -> dict:
    return read_json(folder / PROVENANCE)


def load_served_weights(export: Path, draft: torch.nn.Module) -> Path:
    """Overlay an export's tensors (in the served dtype) on a draft holding its trained
    weights: the weights file's tensors under the draft's names, and a block draft's mask
    embedding from its own file. Keys the draft lacks, or shapes it does not have, are
    refused; what the export leaves out (embeddings, t2d) stays as loaded. -> the file."""
    file = export / EXPORT_WEIGHTS
    own = draft.state_dict()
    tensors = dict(load_file(str(file)))
    mask = export / MASK_EMBEDDING
    if mask.is_file():
        tensors["mask_embedding"] = torch.load(mask, weights_only=True, map_location="cpu")["embedding"]
    for name, tensor in tensors.items():
        if name not in own or own[name].shape != tensor.shape:
            raise ConfigError(
                f"{file}: tensor {name!r} {tuple(tensor.shape)} is not one of the draft's "
                f"({tuple(own[name].shape) if name in own else 'no such tensor'}): the export is not this draft's"
            )
    draft.load_state_dict({k: v.to(own[k].dtype) for k, v in tensors.items()}, strict=False)
    return file


def load_draft_weights(folder: Path, draft: torch.nn.Module, file: Path | None = None) -> None:
    """Weights and vocab mapping only (a warm start), from `folder`'s draft.safetensors or
    another file with the same keys (an export). Keys and shapes must match exactly."""
    file = file or folder / WEIGHTS
    own = draft.state_dict()
    weights = {
        k: v.to(own[k].dtype) if v.is_floating_point() and k in own else v for k, v in load_file(str(file)).items()
    }
    for name, tensor in weights.items():
        if name not in own:
            raise ConfigError(f"{file}: unexpected tensor {name!r}")
        if own[name].shape != tensor.shape:
            raise ConfigError(
                f"{file}: {name} has shape {tuple(tensor.shape)}, the draft expects {tuple(own[name].shape)}"
            )
    missing = sorted(set(own) - set(weights) - set(FROZEN))
    if missing:
        raise ConfigError(f"{file} lacks {missing}")
    draft.load_state_dict(weights, strict=False)
