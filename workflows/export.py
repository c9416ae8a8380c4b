"""Stage `export`: the trained draft in the layouts serving engines load.

An EAGLE-3 draft:

    <run_dir>/export/sglang/   config.json (LlamaForCausalLMEagle3) + model.safetensors
    <run_dir>/export/vllm/     the `speculators` layout (Eagle3Speculator, layers.0.*),
                               written by speculators' own Eagle3Converter from the SGLang
                               export and re-loaded by it (validation)

A DFlash block draft (eagle3.dflash.export, which says what vLLM reads; a DSpark draft the
same, as Qwen3DSparkModel with its heads and no mask-embedding file, eagle3.dspark.export):

    <run_dir>/export/vllm/     config.json (DFlashDraftModel, dflash_config) + model.safetensors
                               + mask_embedding.pt
    <run_dir>/export/sglang/   a DSpark draft whose head is the target's only (SGLang's DSPARK
                               layout: the same config.json, no head, markov_w2 per target token)

Each family's exporter is named in EXPORTERS; an engine folder the draft's family does not
write is removed, so no export of an earlier draft is left beside this one's.

The draft's tensors already carry SGLang's key names (`fc`, `midlayer.*`, `norm`,
`lm_head`, `d2t`, `t2d`); the frozen embeddings are not stored, because both engines
take them from the target. `eagle_config.eagle_aux_hidden_state_layer_ids` is written
from the draft's provenance: SGLang reads it with our convention (id i = output of layer
i; it captures the input of layer i+1) and, when it is missing, silently falls back to
its default layers, the wiring failure this pipeline exists to prevent. The wiring
doctor runs before anything is written.

    python -m workflows.export target=tiny run_dir=runs/tiny
"""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from eagle3.dflash import export as dflash_export
from eagle3.draft_config import DraftConfig
from eagle3.dspark import export as dspark_export
from eagle3.families import family_named
from eagle3.layer_ids import check_sglang_servable, to_vllm_aux_layer_ids
from eagle3.schema import ConfigError
from workflows.core import wiring
from workflows.core.cli import stage_main
from workflows.core.config import FullConfig
from workflows.core.draft_files import (
    EXPORT_CONFIG,
    EXPORT_WEIGHTS,
    MASK_EMBEDDING,
    PROVENANCE,
    load_draft_config,
    load_provenance,
)
from workflows.core.draft_files import WEIGHTS as DRAFT_WEIGHTS
from workflows.core.layout import RunLayout
from workflows.core.log import log
from workflows.core.markers import atomic_dir, run_stage, write_json_atomic
from workflows.core.provenance import target_identity

SGLANG_ARCH = "LlamaForCausalLMEagle3"
# 2: the vLLM export names its capture ids in vLLM's numbering (format 1 wrote the project's,
# one layer off in vLLM); in the stage's key, so an export of the older format is redone.
# 3: a DSpark draft with the target's head gets SGLang's DSPARK folder too.
EXPORT_FORMAT = 3


def sglang_config(draft: DraftConfig, provenance: dict, dtype: str = "bfloat16") -> dict:
    """config.json for SGLang's LlamaForCausalLMEagle3 (fields it reads, see module doc)."""
    cfg = {
        "architectures": [SGLANG_ARCH],
        "model_type": "llama",
        "hidden_size": draft.hidden_size,
        "intermediate_size": draft.intermediate_size,
        "num_attention_heads": draft.num_attention_heads,
        "num_key_value_heads": draft.num_key_value_heads,
        "head_dim": draft.head_dim,
        "num_hidden_layers": 1,  # one EAGLE-3 decoder layer (`midlayer`)
        "hidden_act": "silu",
        "rms_norm_eps": draft.rms_norm_eps,
        "rope_theta": draft.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": draft.max_position_embeddings,
        "vocab_size": draft.vocab_size,  # the target's: embeddings are the target's
        "draft_vocab_size": draft.draft_vocab_size,
        # Separate lm_head over the draft vocabulary (the draft's own, not the target's).
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        # Feature norms before fc (SGLang and speculators read these top-level keys).
        "norm_before_fc": draft.norm_before_fc,
        "fc_norm": draft.fc_norm,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(provenance["capture_layer_ids"]),
            "use_aux_hidden_state": True,
        },
        # Ours, for the doctor: SGLang ignores unknown fields.
        "eagle3_pipeline": {
            "layer_id_convention": provenance.get("layer_id_convention"),
            "target_path": provenance.get("target", {}).get("path"),
            "tokenizer_sha256": provenance.get("target", {}).get("tokenizer_sha256"),
            "chat_template_sha256": provenance.get("target", {}).get("chat_template_sha256"),
            "target_num_layers": draft.target_num_layers,
        },
    }
    if draft.target_hidden_size != draft.hidden_size:
        cfg["target_hidden_size"] = draft.target_hidden_size
    return cfg


def export_sglang(draft_dir: Path, out: Path, dtype: str = "bfloat16") -> Path:
    import torch

    draft_cfg = load_draft_config(draft_dir)
    provenance = load_provenance(draft_dir)
    if list(provenance["capture_layer_ids"]) != list(draft_cfg.capture_layer_ids):
        raise ValueError(
            f"{draft_dir}: provenance.json capture_layer_ids={provenance['capture_layer_ids']} "
            f"but draft_config.json capture_layer_ids={draft_cfg.capture_layer_ids}"
        )
    weights = load_file(str(draft_dir / DRAFT_WEIGHTS))
    torch_dtype = getattr(torch, dtype)
    # Floating weights in the serving dtype; d2t (int64) and t2d (bool) stay as they are.
    weights = {k: (v.to(torch_dtype) if v.is_floating_point() else v).contiguous() for k, v in weights.items()}
    with atomic_dir(out) as tmp:
        save_file(weights, str(tmp / EXPORT_WEIGHTS), metadata={"format": "pt"})
        write_json_atomic(tmp / EXPORT_CONFIG, sglang_config(draft_cfg, provenance, dtype))
        write_json_atomic(tmp / PROVENANCE, provenance)
    return out


def speculators_available() -> bool:
    try:
        import speculators.convert.eagle.eagle3_converter  # noqa: F401
    except ImportError:
        return False
    return True


def export_vllm(sglang_dir: Path, out: Path, target_path: Path, capture_ids: list[int]) -> Path:
    """The speculators layout, by speculators' own converter; it re-loads the result. The
    capture ids go in vLLM's numbering (id i is index i + 1, `to_vllm_aux_layer_ids`):
    written as ours, vLLM would feed the draft the outputs of the layers below the ones
    it was trained on, a silent loss of acceptance."""
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    with atomic_dir(out) as tmp:
        Eagle3Converter().convert(
            input_path=sglang_dir,
            output_path=tmp,
            base_model=str(target_path),
            validate=True,
            eagle_aux_hidden_state_layer_ids=to_vllm_aux_layer_ids(capture_ids),
        )
        write_json_atomic(tmp / PROVENANCE, load_provenance(sglang_dir))
    return out


def export_dflash(
    draft_dir: Path, out: Path, dtype: str = "bfloat16", target_layer_ids: list[int] | None = None
) -> Path:
    """A block draft in vLLM's DFlash layout (eagle3.dflash.export). `target_layer_ids`
    overrides the draft's ids in config.json: for tests that need a mis-wired export."""
    return export_block_draft(draft_dir, out, dflash_export, dtype, target_layer_ids)


def export_dspark(
    draft_dir: Path, out: Path, dtype: str = "bfloat16", target_layer_ids: list[int] | None = None
) -> Path:
    """A DSpark draft in vLLM's layout (eagle3.dspark.export); `target_layer_ids` as export_dflash's."""
    return export_block_draft(draft_dir, out, dspark_export, dtype, target_layer_ids)


def export_dspark_sglang(draft_dir: Path, out: Path, target_path: Path, dtype: str = "bfloat16") -> Path:
    """A DSpark draft in SGLang's DSPARK layout (eagle3.dspark.export); refuses, naming the
    settings that give one, a draft whose head is not the target's."""
    import torch

    from workflows.core.target_weights import read_head_and_norm

    cfg = load_draft_config(draft_dir)
    state = load_file(str(draft_dir / DRAFT_WEIGHTS))
    refusal = dspark_export.sglang_refusal(cfg, state, lambda: read_head_and_norm(Path(target_path))[0])
    if refusal:
        raise ConfigError(f"{draft_dir}: no SGLang export: {refusal}")
    with atomic_dir(out) as tmp:
        tensors = dspark_export.sglang_tensors(state, getattr(torch, dtype))
        save_file(tensors, str(tmp / EXPORT_WEIGHTS), metadata={"format": "pt"})
        write_json_atomic(tmp / EXPORT_CONFIG, dspark_export.vllm_config(cfg, dtype))
        write_json_atomic(tmp / PROVENANCE, load_provenance(draft_dir))
    return out


def export_block_draft(draft_dir: Path, out: Path, layout, dtype: str, target_layer_ids: list[int] | None) -> Path:
    """A block draft's vLLM folder by its family's `layout` module (export_tensors, vllm_config,
    and the mask embedding's file where the layout has one)."""
    import torch

    cfg = load_draft_config(draft_dir)
    state = load_file(str(draft_dir / DRAFT_WEIGHTS))
    torch_dtype = getattr(torch, dtype)
    with atomic_dir(out) as tmp:
        save_file(layout.export_tensors(state, torch_dtype), str(tmp / EXPORT_WEIGHTS), metadata={"format": "pt"})
        if hasattr(layout, "mask_embedding_file"):
            torch.save(layout.mask_embedding_file(state, cfg, torch_dtype), tmp / MASK_EMBEDDING)
        write_json_atomic(tmp / EXPORT_CONFIG, layout.vllm_config(cfg, dtype, target_layer_ids))
        write_json_atomic(tmp / PROVENANCE, load_provenance(draft_dir))
    return out


def write_eagle3(cfg: FullConfig, layout: RunLayout, draft_dir: Path, target_path: Path) -> list[str]:
    # SGLang must capture what the draft was trained on (no id N-1; its per-family id rule).
    check_sglang_servable(
        cfg.draft_capture_ids, cfg.target.num_layers, cfg.target.model_type, "target.capture_layer_ids"
    )
    export_sglang(draft_dir, layout.sglang_export, cfg.target.dtype)
    if not speculators_available():
        log("export: the `speculators` package is not installed; vLLM export skipped (pip install -e .[vllm])")
        return ["sglang"]
    export_vllm(layout.sglang_export, layout.vllm_export, target_path, cfg.draft_capture_ids)
    return ["sglang", "vllm"]


def write_dflash(cfg: FullConfig, layout: RunLayout, draft_dir: Path, target_path: Path) -> list[str]:
    export_dflash(draft_dir, layout.vllm_export, cfg.target.dtype)
    return ["vllm"]


def write_dspark(cfg: FullConfig, layout: RunLayout, draft_dir: Path, target_path: Path) -> list[str]:
    export_dspark(draft_dir, layout.vllm_export, cfg.target.dtype)
    try:  # SGLang's layout, for a draft that drafts through the target's own head
        export_dspark_sglang(draft_dir, layout.sglang_export, target_path, cfg.target.dtype)
    except ConfigError as e:
        log(f"export: {e}")
        return ["vllm"]
    return ["vllm", "sglang"]


# Family -> its exporter: writes the family's engine folders and returns their engines.
EXPORTERS = {"eagle3": write_eagle3, "dflash": write_dflash, "dspark": write_dspark}


def run(cfg: FullConfig, target_path: Path) -> Path:
    layout = RunLayout.of(cfg)
    out = layout.stage_dir("export")
    family = family_named(cfg.draft.family)
    key = {
        "target": target_identity(target_path, cfg.cache_path),
        "dtype": cfg.target.dtype,
        "format": EXPORT_FORMAT,
        "family": family.name,
        # The formats this machine can write: installing speculators later makes a rerun add vLLM's.
        "speculators": speculators_available() if family.name == "eagle3" else None,
        **layout.chain("train"),
    }

    def build() -> dict:
        draft_dir = layout.require_draft()
        drafted = load_draft_config(draft_dir).family
        if drafted != family.name:
            raise ConfigError(
                f"{draft_dir} holds a {drafted} draft but draft.family={family.name}: rerun the train stage "
                f"(stages=[train,export,evaluate]) or set draft.family={drafted}"
            )
        # The doctor first: never export a draft whose wiring contradicts the target.
        wiring.raise_on_errors(wiring.check(wiring.sides_for_run(cfg, target_path, with_export=False)))
        for engine in ("sglang", "vllm"):  # no earlier draft's export is left beside this one's
            shutil.rmtree(layout.export_dir(engine), ignore_errors=True)
        formats = EXPORTERS[family.name](cfg, layout, draft_dir, target_path)
        wiring.raise_on_errors(wiring.check(wiring.sides_for_run(cfg, target_path, with_export=True)))
        # The train key this export was made from: evaluate scores the export only when it
        # belongs to the draft the train stage holds now.
        log(f"export: wrote {', '.join(str(out / f) for f in formats)}")
        return {"formats": formats, "train_key": key["train"]}

    return run_stage("export", out, key, build)


if __name__ == "__main__":  # built only when run: importing this module registers nothing with Hydra
    stage_main("export", run)()
