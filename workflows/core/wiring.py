"""Wiring checks: do target, store, draft, export and serving agree?

Used by the export stage (before and after writing), by `python -m workflows.tools.doctor`
and by `python -m workflows.tools.serve`.

Every artefact is read into a `Side`: a name saying where the facts come from and the
facts themselves (capture ids in the pipeline's convention, hidden and vocab sizes, a
hash of the draft vocab map, tokenizer and chat-template hashes, target path). `check`
compares each fact across the sides that state it; every disagreement is one error that
names both sides and both values. Capture ids stated in SGLang's "input of layer"
convention are converted first, and shown as stated, so `[2, 30, 58]` inputs next to
`[-1, 2, 30]` outputs reads as the failure it is.

The record and the comparison live in workflows.core.wiring_facts; the block drafts'
export sides in workflows.core.wiring_block.
"""

from __future__ import annotations

from pathlib import Path

from eagle3.layer_ids import sglang_default_layer_inputs, sglang_layer_inputs
from storage.store import HiddenStateStore
from workflows.core import draft_files
from workflows.core.layout import RunLayout
from workflows.core.markers import read_json
from workflows.core.provenance import engine_captured_mismatch, target_identity
from workflows.core.wiring_block import side_from_sglang_dspark_export, side_from_vllm_dflash_export
from workflows.core.wiring_facts import (
    FIELDS,
    INPUT_CONVENTION,
    Side,
    check,
    check_feature_norm_weights,
    check_vocab_map,
    feature_norms,
    raise_on_errors,
    set_capture_ids,
)

# The doctor's whole interface, for its callers (the export stage, the doctor and serve
# tools): the sides of each artefact, and the record and checks of workflows.core.wiring_facts.
__all__ = [
    "FIELDS",
    "Side",
    "check",
    "check_vocab_map",
    "raise_on_errors",
    "side_from_draft",
    "side_from_engine_capture",
    "side_from_provenance",
    "side_from_sglang_dspark_export",
    "side_from_sglang_export",
    "side_from_store",
    "side_from_target",
    "side_from_vllm_dflash_export",
    "side_from_vllm_export",
    "sides_for_run",
]


def side_from_target(p: dict) -> Side:
    """The target's own facts, from its identity (workflows.core.provenance)."""
    return Side(
        f"target ({p['path']})",
        {
            "target_num_layers": p["num_layers"],
            "target_hidden_size": p["hidden_size"],
            "target_vocab_size": p["vocab_size"],
            "tokenizer_sha256": p["tokenizer_sha256"],
            "chat_template_sha256": p["chat_template_sha256"],
            "target_path": p["path"],
        },
    )


def side_from_provenance(name: str, prov: dict) -> Side:
    """Any artefact's provenance record (draft, store): capture ids + target identity."""
    side = Side(name)
    target = prov.get("target", {})
    set_capture_ids(side, prov.get("capture_layer_ids"), prov.get("layer_id_convention"))
    side.facts.update(
        {
            k: v
            for k, v in {
                "target_hidden_size": prov.get("hidden_size", target.get("hidden_size")),
                "target_num_layers": target.get("num_layers"),
                "target_vocab_size": target.get("vocab_size"),
                "tokenizer_sha256": target.get("tokenizer_sha256"),
                "chat_template_sha256": target.get("chat_template_sha256"),
                "target_path": target.get("path"),
            }.items()
            if v is not None
        }
    )
    return side


def side_from_draft(folder: Path) -> Side:
    from safetensors.torch import load_file

    side = side_from_provenance(f"draft checkpoint ({folder})", read_json(folder / draft_files.PROVENANCE))
    cfg = read_json(folder / draft_files.CONFIG)
    side.facts["draft_family"] = cfg.get("family", "eagle3")
    if "mask_token_id" in cfg:
        side.facts["mask_token_id"] = cfg["mask_token_id"]
    if side.facts.get("capture_layer_ids") not in (None, cfg["capture_layer_ids"]):
        side.errors.append(
            f"{side.name}: provenance.json capture_layer_ids={side.facts['capture_layer_ids']} but "
            f"draft_config.json capture_layer_ids={cfg['capture_layer_ids']}"
        )
    side.facts.update(
        {
            "target_hidden_size": cfg["target_hidden_size"],
            "target_vocab_size": cfg["vocab_size"],
            "target_num_layers": cfg["target_num_layers"],
        }
    )
    w = load_file(str(folder / draft_files.WEIGHTS))
    check_vocab_map(side, w["d2t"], w["t2d"])
    flags = (cfg.get("norm_before_fc", False), cfg.get("fc_norm", False))
    side.facts["feature_norms"] = feature_norms(*flags)
    check_feature_norm_weights(side, w, *flags, len(cfg["capture_layer_ids"]))
    if cfg["draft_vocab_size"] != side.facts["draft_vocab_size"]:
        side.errors.append(
            f"{side.name}: draft_config.json draft_vocab_size={cfg['draft_vocab_size']} but d2t has "
            f"{side.facts['draft_vocab_size']} rows"
        )
    return side


def side_from_store(url: str, prov: dict) -> Side:
    """A hidden-state store's provenance (the capture contract, workflows.core.provenance).
    Its capture ids are what it holds: the draft's must be among them (it may hold more,
    for other drafter families)."""
    side = Side(f"hidden-state store ({url})")
    set_capture_ids(side, prov.get("capture_layer_ids"), prov.get("layer_id_convention"))
    if "capture_layer_ids" in side.facts:
        side.facts["stored_capture_ids"] = side.facts.pop("capture_layer_ids")
    # What its capture engines reported capturing (the capture stage records it): the store
    # holds those layers, whatever the provenance names.
    if prov.get("engine_captured_layer_ids") is not None:
        side.facts["stored_capture_ids"] = [int(i) for i in prov["engine_captured_layer_ids"]]
        side.stated["stored_capture_ids"] = f"as its {prov.get('backend')} capture engine reported capturing"
        mismatch = engine_captured_mismatch(prov, side.name)
        if mismatch:
            side.errors.append(mismatch)
    side.facts.update(
        {
            k: v
            for k, v in {
                "target_hidden_size": prov.get("hidden_size"),
                "target_num_layers": prov.get("num_layers"),
                "target_vocab_size": (prov.get("target") or {}).get("vocab_size"),
                "tokenizer_sha256": prov.get("tokenizer_sha256"),
                "chat_template_sha256": prov.get("chat_template_sha256"),
                "target_path": prov.get("target_path"),
            }.items()
            if v is not None
        }
    )
    return side


def side_from_sglang_export(
    folder: Path, target_num_layers: int | None = None, target_model_type: str = "llama"
) -> Side:
    """What SGLang will really capture for an export: its eagle_config ids read by the rule
    of the target's model family, or its default layers when the config names none."""
    from safetensors.torch import load_file

    cfg = read_json(folder / draft_files.EXPORT_CONFIG)
    if "dflash_config" in cfg:
        return side_from_sglang_dspark_export(folder, cfg)
    side = Side(f"SGLang export ({folder})")
    side.facts["draft_family"] = "eagle3"
    ours = cfg.get("eagle3_pipeline", {})
    n = target_num_layers or ours.get("target_num_layers")
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        inputs = sglang_layer_inputs(ids, target_model_type)
        set_capture_ids(side, inputs, INPUT_CONVENTION)
        side.stated["capture_layer_ids"] += (
            f" for a {target_model_type} target, from eagle_aux_hidden_state_layer_ids={ids}"
        )
        if n and n - 1 in ids:
            side.errors.append(
                f"{side.name}: eagle_aux_hidden_state_layer_ids={ids} names id {n - 1}, the last layer's "
                f"output, which SGLang cannot capture (no layer {n} has it as input)"
            )
    elif n:
        set_capture_ids(side, sglang_default_layer_inputs(n), INPUT_CONVENTION)
        side.stated["capture_layer_ids"] += "; SGLang's default: config.json names no eagle_aux_hidden_state_layer_ids"
    else:
        side.errors.append(f"{side.name}: config.json has no eagle_config.eagle_aux_hidden_state_layer_ids")
    if cfg.get("architectures") != ["LlamaForCausalLMEagle3"]:
        side.errors.append(
            f"{side.name}: architectures={cfg.get('architectures')}, SGLang needs "
            "['LlamaForCausalLMEagle3'] for an EAGLE-3 draft"
        )
    side.facts.update(
        {
            k: v
            for k, v in {
                "target_hidden_size": cfg.get("target_hidden_size", cfg.get("hidden_size")),
                "target_vocab_size": cfg.get("vocab_size"),
                "tokenizer_sha256": ours.get("tokenizer_sha256"),
                "chat_template_sha256": ours.get("chat_template_sha256"),
                "target_path": ours.get("target_path"),
            }.items()
            if v is not None
        }
    )
    w = load_file(str(folder / draft_files.EXPORT_WEIGHTS))
    check_vocab_map(side, w["d2t"], w["t2d"])
    # SGLang's own reading of the flags (models/llama_eagle3.py in 0.5.23).
    flags = (
        bool((cfg.get("eagle_config") or {}).get("norm_before_fc", cfg.get("norm_before_fc", False))),
        bool(cfg.get("fc_norm") or cfg.get("use_aux_norm", False)),
    )
    side.facts["feature_norms"] = feature_norms(*flags)
    check_feature_norm_weights(side, w, *flags, len(ids) if ids is not None else 3)
    if cfg.get("draft_vocab_size") != side.facts["draft_vocab_size"]:
        side.errors.append(
            f"{side.name}: config.json draft_vocab_size={cfg.get('draft_vocab_size')} but d2t has "
            f"{side.facts['draft_vocab_size']} rows"
        )
    return side


def side_from_vllm_export(folder: Path) -> Side:
    cfg = read_json(folder / draft_files.EXPORT_CONFIG)
    if "dflash_config" in cfg:
        return side_from_vllm_dflash_export(folder, cfg)
    side = Side(f"vLLM/speculators export ({folder})")
    side.facts["draft_family"] = "eagle3"
    indices = cfg.get("eagle_aux_hidden_state_layer_ids")
    if indices is not None:  # vLLM's numbering: index L = the input of layer L (layer_ids.to_vllm_aux_layer_ids)
        set_capture_ids(side, indices, INPUT_CONVENTION)
        side.stated["capture_layer_ids"] = (
            f"vLLM's eagle_aux_hidden_state_layer_ids={list(indices)}, index L = the input of layer L"
        )
    else:
        side.errors.append(
            f"{side.name}: config.json has no eagle_aux_hidden_state_layer_ids (vLLM would capture its default layers)"
        )
    layer = cfg.get("transformer_layer_config", {})
    side.facts.update(
        {
            "target_hidden_size": cfg.get("target_hidden_size") or layer.get("hidden_size"),
            "target_vocab_size": layer.get("vocab_size"),
            "draft_vocab_size": cfg.get("draft_vocab_size"),
            "feature_norms": feature_norms(cfg.get("norm_before_fc"), cfg.get("fc_norm")),
            "target_path": str(Path(cfg["speculators_config"]["verifier"]["name_or_path"]).resolve()),
        }
    )
    return side


def side_from_engine_capture(name: str, layer_inputs: list[int]) -> Side:
    """A serving engine that captures the inputs of these layers (SGLang's own naming)."""
    side = Side(name)
    set_capture_ids(side, layer_inputs, INPUT_CONVENTION)
    return side


def sides_for_run(cfg, target_path: Path, with_export: bool = True) -> list[Side]:
    """The config, the target and every artefact of the run that exists."""
    config = Side(
        f"config (target={cfg.target.name}, draft.family={cfg.draft.family})",
        {
            "draft_family": cfg.draft.family,
            "capture_layer_ids": cfg.draft_capture_ids,
            "target_hidden_size": cfg.target.hidden_size,
            "target_num_layers": cfg.target.num_layers,
            "target_vocab_size": cfg.target.vocab_size,
        },
    )
    sides = [config, side_from_target(target_identity(target_path, cfg.cache_path))]
    layout = RunLayout.of(cfg)
    if layout.done_key("capture") is not None:
        store = HiddenStateStore(layout.store_url, layout.storage_options)
        if store.exists():  # its root attributes only: no shard is opened
            sides.append(side_from_store(layout.store_url, store.provenance))
    if (layout.draft_dir / draft_files.WEIGHTS).exists():
        sides.append(side_from_draft(layout.draft_dir))
    if with_export and (layout.sglang_export / draft_files.EXPORT_CONFIG).exists():
        sides.append(side_from_sglang_export(layout.sglang_export, cfg.target.num_layers, cfg.target.model_type))
    if with_export and (layout.vllm_export / draft_files.EXPORT_CONFIG).exists():
        sides.append(side_from_vllm_export(layout.vllm_export))
    return sides
