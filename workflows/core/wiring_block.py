"""The wiring doctor's sides of the block drafts' exports (DFlash and DSpark): vLLM's
layout for both, and SGLang's DSpark layout (workflows.core.wiring dispatches to these by the
export's config)."""

from __future__ import annotations

from pathlib import Path

from eagle3.layer_ids import CONVENTION
from eagle3.vocab import target_ids_of
from workflows.core import draft_files
from workflows.core.wiring_facts import Side, check_vocab_map, set_capture_ids


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
