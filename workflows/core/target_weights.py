"""Single tensors read from a target's HF checkpoint, without building the model.

The trainer needs three pieces of a (possibly 1T-parameter) target: its input embeddings
(the draft's frozen `embed_tokens`), its output head and, when the stored final state is
pre-norm, its final norm. Loading the model for them would read every shard; the
safetensors index says which file holds each tensor, and safetensors reads just that one.

Names are matched by suffix so that wrapped checkpoints (multimodal targets keep the text
model under `language_model.`) resolve the same way; a tie (`tie_word_embeddings`) reads
the embeddings for the head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3.modeling import RMSNorm
from eagle3.target_head import TargetHead

EMBEDDINGS = "embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"


class TargetWeightsError(ValueError):
    """The checkpoint lacks a tensor the trainer needs (names the folder and the tensor)."""


def tensor_files(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name, from the index or the single-file checkpoint."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = folder / "model.safetensors"
    if not single.exists():
        raise TargetWeightsError(f"{folder}: no model.safetensors(.index.json); the trainer reads safetensors only")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single.name for name in f.keys()}


def _find(names: dict[str, str], suffix: str) -> str | None:
    hits = sorted(n for n in names if n == suffix or n.endswith("." + suffix))
    # Prefer the text model's tensor (shortest name) over e.g. a vision tower's.
    return min(hits, key=len) if hits else None


def read_tensor(folder: Path, suffix: str) -> torch.Tensor:
    from safetensors import safe_open

    names = tensor_files(folder)
    name = _find(names, suffix)
    if name is None:
        raise TargetWeightsError(f"{folder}: the checkpoint has no tensor named '*{suffix}'")
    with safe_open(str(Path(folder) / names[name]), framework="pt") as f:
        return f.get_tensor(name)


def read_embeddings(folder: Path) -> torch.Tensor:
    return read_tensor(folder, EMBEDDINGS)


def _lm_head(folder: Path) -> tuple[torch.Tensor, dict]:
    """(the target's output embedding [vocab, hidden], its text config)."""
    config = json.loads((folder / "config.json").read_text())
    text_config = config.get("text_config", config)  # multimodal targets nest the LM's config
    names = tensor_files(folder)
    tied = text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return read_tensor(folder, EMBEDDINGS if tied or _find(names, LM_HEAD) is None else LM_HEAD), text_config


def read_head_and_norm(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(lm_head [vocab, hidden] in the checkpoint's dtype, final norm weight [hidden]): the
    draft's `draft.init_head=target` start. The head stays as stored (bf16 for Kimi-K2.5:
    2.3 GB, twice that in float32); the draft converts only its own rows."""
    head, _ = _lm_head(Path(folder))
    return head, read_tensor(Path(folder), FINAL_NORM).float()


def read_target_head(folder: Path, final_is_normed: bool) -> TargetHead:
    """The target's frozen head; with the final norm in front when `final` is pre-norm."""
    folder = Path(folder)
    head, text_config = _lm_head(folder)
    norm = None
    if not final_is_normed:
        norm = RMSNorm(head.shape[1], float(text_config.get("rms_norm_eps", 1e-6)))
        with torch.no_grad():
            norm.weight.copy_(read_tensor(folder, FINAL_NORM).float())
    return TargetHead(head, norm)
