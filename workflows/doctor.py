"""The wiring doctor: do target, store, draft, export and serving agree?

    python -m workflows.doctor target=tiny run_dir=runs/tiny     # exit 1 on any disagreement

Every artefact is read into a `Side`: a name saying where the facts come from and the
facts themselves (capture ids in the pipeline's convention, hidden and vocab sizes, a
hash of the draft vocab map, tokenizer and chat-template hashes, target path). `check`
compares each fact across the sides that state it; every disagreement is one error that
names both sides and both values. Capture ids stated in SGLang's "input of layer"
convention are converted first, and shown as stated, so `[2, 30, 58]` inputs next to
`[-1, 2, 30]` outputs reads as the failure it is.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import hydra

from eagle3.layer_ids import CONVENTION, from_sglang_layer_inputs
from eagle3.schema import ConfigError
from workflows.common import log, read_json

INPUT_CONVENTION = "input_of_layer"  # SGLang's layers_to_capture
FIELDS = ("capture_layer_ids", "target_num_layers", "target_hidden_size", "target_vocab_size", "draft_vocab_size",
          "vocab_map_sha256", "tokenizer_sha256", "chat_template_sha256", "target_path")


@dataclass
class Side:
    name: str
    facts: dict = field(default_factory=dict)
    stated: dict = field(default_factory=dict)  # how a fact was written, when converted
    errors: list[str] = field(default_factory=list)  # problems inside this one artefact


def set_capture_ids(side: Side, ids, convention: str | None) -> None:
    if ids is None:
        return
    ids = [int(i) for i in ids]
    if convention == CONVENTION:
        side.facts["capture_layer_ids"] = ids
    elif convention == INPUT_CONVENTION:
        side.facts["capture_layer_ids"] = from_sglang_layer_inputs(ids)
        side.stated["capture_layer_ids"] = f"inputs of layers {ids}"
    else:
        side.errors.append(f"{side.name}: capture ids {ids} have no known layer-id convention "
                           f"({convention!r}; expected {CONVENTION!r} or {INPUT_CONVENTION!r})")


def vocab_map_sha256(d2t, t2d) -> str:
    import numpy as np

    h = hashlib.sha256(np.asarray(d2t, dtype=np.int64).tobytes())
    h.update(np.asarray(t2d, dtype=np.bool_).tobytes())
    return h.hexdigest()[:16]


def check_vocab_map(side: Side, d2t, t2d) -> None:
    """d2t and t2d must describe the same draft->target map (target = i + d2t[i])."""
    import torch

    d2t, t2d = torch.as_tensor(d2t).long(), torch.as_tensor(t2d).bool()
    side.facts["draft_vocab_size"] = int(d2t.numel())
    side.facts["vocab_map_sha256"] = vocab_map_sha256(d2t.numpy(), t2d.numpy())
    target_ids = torch.arange(d2t.numel()) + d2t
    if not torch.equal(target_ids, t2d.nonzero().flatten()):
        side.errors.append(f"{side.name}: d2t and t2d disagree (arange + d2t lists other target ids than t2d marks)")


def side_from_target(path: Path) -> Side:
    from workflows.target import target_provenance

    p = target_provenance(path)
    return Side(f"target ({p['path']})", {
        "target_num_layers": p["num_layers"], "target_hidden_size": p["hidden_size"], "target_vocab_size": p["vocab_size"],
        "tokenizer_sha256": p["tokenizer_sha256"], "chat_template_sha256": p["chat_template_sha256"],
        "target_path": p["path"]})


def side_from_provenance(name: str, prov: dict) -> Side:
    """Any artefact's provenance record (draft, store): capture ids + target identity."""
    side = Side(name)
    target = prov.get("target", {})
    set_capture_ids(side, prov.get("capture_layer_ids"), prov.get("layer_id_convention"))
    side.facts.update({k: v for k, v in {
        "target_hidden_size": prov.get("hidden_size", target.get("hidden_size")),
        "target_num_layers": target.get("num_layers"), "target_vocab_size": target.get("vocab_size"),
        "tokenizer_sha256": target.get("tokenizer_sha256"), "chat_template_sha256": target.get("chat_template_sha256"),
        "target_path": target.get("path")}.items() if v is not None})
    return side


def side_from_draft(folder: Path) -> Side:
    from safetensors.torch import load_file

    side = side_from_provenance(f"draft checkpoint ({folder})", read_json(folder / "provenance.json"))
    cfg = read_json(folder / "draft_config.json")
    if side.facts.get("capture_layer_ids") not in (None, cfg["capture_layer_ids"]):
        side.errors.append(f"{side.name}: provenance.json capture_layer_ids={side.facts['capture_layer_ids']} but "
                           f"draft_config.json capture_layer_ids={cfg['capture_layer_ids']}")
    side.facts.update({"target_hidden_size": cfg["target_hidden_size"], "target_vocab_size": cfg["vocab_size"],
                       "target_num_layers": cfg["target_num_layers"]})
    w = load_file(str(folder / "draft.safetensors"))
    check_vocab_map(side, w["d2t"], w["t2d"])
    if cfg["draft_vocab_size"] != side.facts["draft_vocab_size"]:
        side.errors.append(f"{side.name}: draft_config.json draft_vocab_size={cfg['draft_vocab_size']} but d2t has "
                           f"{side.facts['draft_vocab_size']} rows")
    return side


def sglang_default_layer_inputs(num_layers: int) -> list[int]:
    """What SGLang captures when the draft's config names no layers (models/llama.py)."""
    return [2, num_layers // 2, num_layers - 3]


def side_from_sglang_export(folder: Path, target_num_layers: int | None = None) -> Side:
    """What SGLang will read from an export: its eagle_config ids, or its default layers."""
    from safetensors.torch import load_file

    cfg = read_json(folder / "config.json")
    side = Side(f"SGLang export ({folder})")
    ours = cfg.get("eagle3_pipeline", {})
    n = target_num_layers or ours.get("target_num_layers")
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        set_capture_ids(side, ids, CONVENTION)  # SGLang adds 1 itself: ids are layer outputs
    elif n:
        set_capture_ids(side, sglang_default_layer_inputs(n), INPUT_CONVENTION)
        side.stated["capture_layer_ids"] += "; SGLang's default: config.json names no eagle_aux_hidden_state_layer_ids"
    else:
        side.errors.append(f"{side.name}: config.json has no eagle_config.eagle_aux_hidden_state_layer_ids")
    if cfg.get("architectures") != ["LlamaForCausalLMEagle3"]:
        side.errors.append(f"{side.name}: architectures={cfg.get('architectures')}, SGLang needs "
                           "['LlamaForCausalLMEagle3'] for an EAGLE-3 draft")
    side.facts.update({k: v for k, v in {
        "target_hidden_size": cfg.get("target_hidden_size", cfg.get("hidden_size")),
        "target_vocab_size": cfg.get("vocab_size"), "tokenizer_sha256": ours.get("tokenizer_sha256"),
        "chat_template_sha256": ours.get("chat_template_sha256"), "target_path": ours.get("target_path")}.items()
        if v is not None})
    w = load_file(str(folder / "model.safetensors"))
    check_vocab_map(side, w["d2t"], w["t2d"])
    if cfg.get("draft_vocab_size") != side.facts["draft_vocab_size"]:
        side.errors.append(f"{side.name}: config.json draft_vocab_size={cfg.get('draft_vocab_size')} but d2t has "
                           f"{side.facts['draft_vocab_size']} rows")
    return side


def side_from_vllm_export(folder: Path) -> Side:
    cfg = read_json(folder / "config.json")
    side = Side(f"vLLM/speculators export ({folder})")
    set_capture_ids(side, cfg.get("eagle_aux_hidden_state_layer_ids"), CONVENTION)
    layer = cfg.get("transformer_layer_config", {})
    side.facts.update({"target_hidden_size": cfg.get("target_hidden_size") or layer.get("hidden_size"),
                       "target_vocab_size": layer.get("vocab_size"), "draft_vocab_size": cfg.get("draft_vocab_size"),
                       "target_path": str(Path(cfg["speculators_config"]["verifier"]["name_or_path"]).resolve())})
    return side


def side_from_engine_capture(name: str, layer_inputs: list[int]) -> Side:
    """A serving engine that captures the inputs of these layers (SGLang's own naming)."""
    side = Side(name)
    set_capture_ids(side, layer_inputs, INPUT_CONVENTION)
    return side


def check(sides: list[Side]) -> list[str]:
    errors = [e for s in sides for e in s.errors]
    for f in FIELDS:
        stating = [s for s in sides if s.facts.get(f) is not None]
        for other in stating[1:]:
            first = stating[0]
            if other.facts[f] != first.facts[f]:
                errors.append(f"{f}: {first.name} says {_show(first, f)} but {other.name} says {_show(other, f)}")
    return errors


def _show(side: Side, f: str) -> str:
    v = side.facts[f]
    return f"{v} ({side.stated[f]})" if f in side.stated else json.dumps(v) if not isinstance(v, str) else v


def raise_on_errors(errors: list[str]) -> None:
    if errors:
        raise ConfigError("wiring doctor found disagreements:\n  - " + "\n  - ".join(errors))


def sides_for_run(cfg, target_path: Path, with_export: bool = True) -> list[Side]:
    """The config, the target and every artefact of the run that exists."""
    config = Side(f"config (target={cfg.target.name})", {
        "capture_layer_ids": cfg.target.capture_ids, "target_hidden_size": cfg.target.hidden_size,
        "target_num_layers": cfg.target.num_layers, "target_vocab_size": cfg.target.vocab_size})
    sides = [config, side_from_target(target_path)]
    run = cfg.run_path
    # TODO(store): add the hidden-state store's provenance (side_from_provenance) once it lands.
    if (run / "train" / "draft" / "draft.safetensors").exists():
        sides.append(side_from_draft(run / "train" / "draft"))
    if with_export and (run / "export" / "sglang" / "config.json").exists():
        sides.append(side_from_sglang_export(run / "export" / "sglang", cfg.target.num_layers))
    if with_export and (run / "export" / "vllm" / "config.json").exists():
        sides.append(side_from_vllm_export(run / "export" / "vllm"))
    return sides


@hydra.main(config_path="../conf", config_name="full", version_base="1.3")
def main(hydra_cfg) -> None:
    from workflows.config import load_config
    from workflows.target import prepare_for

    cfg = load_config(hydra_cfg)
    sides = sides_for_run(cfg, prepare_for(cfg, log=log))
    errors = check(sides)
    for s in sides:
        log(f"doctor: read {s.name}")
    if errors:
        for e in errors:
            log(f"doctor: ERROR {e}")
        raise SystemExit(1)
    log(f"doctor: {len(sides)} sides agree on {', '.join(FIELDS)}")


if __name__ == "__main__":
    main()
