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
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.layer_ids import CONVENTION, from_sglang_layer_inputs, sglang_default_layer_inputs, sglang_layer_inputs
from eagle3.schema import ConfigError
from eagle3.vocab import target_ids_of
from storage.store import HiddenStateStore
from workflows.core import draft_files
from workflows.core.layout import RunLayout
from workflows.core.markers import read_json
from workflows.core.provenance import engine_captured_mismatch, target_identity

INPUT_CONVENTION = "input_of_layer"  # SGLang's layers_to_capture
FIELDS = (
    "draft_family",
    "capture_layer_ids",
    "target_num_layers",
    "target_hidden_size",
    "target_vocab_size",
    "draft_vocab_size",
    "vocab_map_sha256",
    "mask_token_id",
    "feature_norms",
    "tokenizer_sha256",
    "chat_template_sha256",
    "target_path",
)


def feature_norms(norm_before_fc, fc_norm) -> str:
    return f"norm_before_fc={bool(norm_before_fc)}, fc_norm={bool(fc_norm)}"


def check_feature_norm_weights(side: Side, names, norm_before_fc: bool, fc_norm: bool, num_aux: int) -> None:
    """The weights must match the flags both ways: SGLang leaves a missing norm weight at
    ones and silently drops a weight its config does not ask for, serving another draft."""
    names = set(names)
    want = ({"input_norm.weight"} if norm_before_fc else set()) | (
        {f"fc_norm.{i}.weight" for i in range(num_aux)} if fc_norm else set()
    )
    have = {n for n in names if n == "input_norm.weight" or n.startswith("fc_norm.")}
    if want - have:
        side.errors.append(
            f"{side.name}: {feature_norms(norm_before_fc, fc_norm)} but the weights lack {sorted(want - have)}"
        )
    if have - want:
        side.errors.append(
            f"{side.name}: weights {sorted(have - want)} are not used by "
            f"{feature_norms(norm_before_fc, fc_norm)} (SGLang would drop them silently)"
        )


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
        side.errors.append(
            f"{side.name}: capture ids {ids} have no known layer-id convention "
            f"({convention!r}; expected {CONVENTION!r} or {INPUT_CONVENTION!r})"
        )


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
    if not torch.equal(target_ids_of(d2t), t2d.nonzero().flatten()):
        side.errors.append(f"{side.name}: d2t and t2d disagree (arange + d2t lists other target ids than t2d marks)")


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


def side_from_sglang_dspark_export(folder: Path, cfg: dict) -> Side:
    """SGLang's DSpark layout (eagle3.dspark.export): vLLM's config keys, read by the same
    rules, and the target's own head: no lm_head (SGLang would skip it) and a `markov_w2` row
    per target token (SGLang's loader refuses any other shape)."""
    from safetensors.torch import load_file

    weights = load_file(str(folder / draft_files.EXPORT_WEIGHTS))
    side = side_from_vllm_dflash_export(folder, cfg, engine="SGLang", weights=weights)
    w2, vocab = weights.get("markov_head.markov_w2.weight"), cfg.get("vocab_size")
    if w2 is None or w2.shape[0] != vocab:
        side.errors.append(
            f"{side.name}: markov_head.markov_w2 is {None if w2 is None else list(w2.shape)}, SGLang's DSpark "
            f"needs a row per target token ({vocab})"
        )
    if "lm_head.weight" in weights or "d2t" in weights:
        side.errors.append(
            f"{side.name}: the weights hold a draft head (lm_head/d2t), which SGLang's DSpark skips for the "
            "target's: the draft would not be served as trained"
        )
    side.facts["draft_vocab_size"] = vocab  # the target's head drafts over every token
    return side


def side_from_vllm_dflash_export(folder: Path, cfg: dict, engine: str = "vLLM", weights: dict | None = None) -> Side:
    """vLLM's DFlash layout (eagle3.dflash.export): dflash_config's ids are ours as they are;
    the weights carry d2t (the draft vocabulary; t2d follows from it), the mask embedding's
    file names its id. A DSpark export (architecture Qwen3DSparkModel, eagle3.dspark.export)
    is the same but for the mask: vLLM's DSpark embeds the mask slots as the target's row, as
    the draft trains them, so it ships no mask-embedding file; its heads are checked too."""
    import torch
    from safetensors.torch import load_file

    dspark = "Qwen3DSparkModel" in (cfg.get("architectures") or [])
    side = Side(f"{engine} {'DSpark' if dspark else 'DFlash'} export ({folder})")
    dflash = cfg.get("dflash_config") or {}
    side.facts["draft_family"] = "dspark" if dspark else "dflash"
    if dflash.get("target_layer_ids") is None:
        side.errors.append(f"{side.name}: config.json has no dflash_config.target_layer_ids")
    else:
        set_capture_ids(side, dflash["target_layer_ids"], CONVENTION)
        side.stated["capture_layer_ids"] = f"vLLM's dflash_config.target_layer_ids={dflash['target_layer_ids']}"
    side.facts.update(
        {
            "target_hidden_size": cfg.get("target_hidden_size", cfg.get("hidden_size")),
            "target_vocab_size": cfg.get("vocab_size"),
            "mask_token_id": dflash.get("mask_token_id"),
        }
    )
    if weights is None:  # the caller's, when it has read them already
        weights = load_file(str(folder / draft_files.EXPORT_WEIGHTS))
    d2t = weights.get("d2t")
    if d2t is not None:
        t2d = torch.zeros(int(cfg.get("vocab_size", 0)), dtype=torch.bool)
        t2d[target_ids_of(d2t)] = True
        check_vocab_map(side, d2t, t2d)
    if dspark:
        check_dspark_heads(side, cfg, weights)
        return side
    mask_file = folder / draft_files.MASK_EMBEDDING
    if not mask_file.is_file():
        side.errors.append(
            f"{side.name}: no {draft_files.MASK_EMBEDDING}: vLLM would embed the mask slots with the target's row of "
            f"token {dflash.get('mask_token_id')}, not the trained mask embedding"
        )
    else:
        stated = torch.load(mask_file, weights_only=True, map_location="cpu").get("mask_token_id")
        if stated != dflash.get("mask_token_id"):
            side.errors.append(
                f"{side.name}: {draft_files.MASK_EMBEDDING} is for mask token {stated} but dflash_config.mask_token_id="
                f"{dflash.get('mask_token_id')} (vLLM refuses the pair)"
            )
    return side


def check_dspark_heads(side: Side, cfg: dict, weights: dict) -> None:
    """The heads vLLM's DSpark builds from config.json must be the ones the weights hold: a
    Markov head of `markov_rank` over the target's vocabulary, and a confidence head only where
    `enable_confidence_head` (vLLM drops a confidence head the config does not name, silently,
    and then verifies every drafted token)."""
    rank, w1 = cfg.get("markov_rank"), weights.get("markov_head.markov_w1.weight")
    if w1 is None or rank is None or tuple(w1.shape) != (cfg.get("vocab_size"), rank):
        side.errors.append(
            f"{side.name}: config.json markov_rank={rank}, vocab_size={cfg.get('vocab_size')} but "
            f"markov_head.markov_w1 is {None if w1 is None else list(w1.shape)}"
        )
    has_head = "confidence_head.proj.weight" in weights
    if bool(cfg.get("enable_confidence_head")) != has_head:
        side.errors.append(
            f"{side.name}: config.json enable_confidence_head={cfg.get('enable_confidence_head')} but the weights "
            f"{'hold' if has_head else 'lack'} confidence_head.proj"
        )
    side.facts["sample_from_anchor"] = cfg.get("sample_from_anchor", True)
    if side.facts["sample_from_anchor"] is not True:
        side.errors.append(
            f"{side.name}: sample_from_anchor={cfg.get('sample_from_anchor')}: vLLM would read the block as DFlash's "
            "anchor-plus-K fill-in, not the layout the draft trained (every slot a guess)"
        )


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


def check(sides: list[Side]) -> list[str]:
    errors = [e for s in sides for e in s.errors]
    for store in (s for s in sides if s.facts.get("stored_capture_ids") is not None):
        held = store.facts["stored_capture_ids"]
        for side in (s for s in sides if s.facts.get("capture_layer_ids") is not None):
            missing = [i for i in side.facts["capture_layer_ids"] if i not in held]
            if missing:
                errors.append(
                    f"capture_layer_ids: {side.name} says {_show(side, 'capture_layer_ids')} but {store.name} holds "
                    f"{_show(store, 'stored_capture_ids')}: {missing} are not captured"
                )
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
