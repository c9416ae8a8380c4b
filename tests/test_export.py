"""Exports load in the consumers' own code: SGLang's LlamaForCausalLMEagle3, speculators."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.draft_config import DraftConfig
from tests.helpers import random_draft
from workflows.core import wiring as doctor
from workflows.core.draft_files import save_draft
from workflows.export import export_sglang, export_vllm, speculators_available

ROOT = Path(__file__).resolve().parents[1]


def make_draft_dir(folder: Path, target_path: Path, hidden=64, ids=(0, 2, 4), **norms) -> Path:
    from workflows.core.provenance import target_identity

    cfg = DraftConfig(
        hidden_size=hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=1024,
        draft_vocab_size=256,
        target_hidden_size=64,
        target_num_layers=6,
        capture_layer_ids=list(ids),
        **norms,
    )
    draft = random_draft(cfg, dtype=torch.float32)
    chosen = torch.arange(256) * 4  # every 4th target token
    t2d = torch.zeros(1024, dtype=torch.bool)
    t2d[chosen] = True
    draft.set_vocab_mapping(chosen - torch.arange(256), t2d)
    prov = {
        "target": target_identity(target_path, folder.parent / "cache"),
        "capture_layer_ids": list(ids),
        "layer_id_convention": "output_of_layer",
        "hidden_size": 64,
    }
    save_draft(folder, draft, prov)
    return folder


def test_sglang_export_config_and_weights(tmp_path, tiny_target):
    src = make_draft_dir(tmp_path / "draft", tiny_target, hidden=32)
    out = export_sglang(src, tmp_path / "sglang", "bfloat16")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    assert cfg["draft_vocab_size"] == 256 and cfg["vocab_size"] == 1024 and cfg["num_hidden_layers"] == 1
    assert cfg["target_hidden_size"] == 64 and cfg["hidden_size"] == 32  # written because they differ
    assert cfg["tie_word_embeddings"] is False and cfg["rope_theta"] == 10000.0
    ours, theirs = load_file(str(src / "draft.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(theirs) == set(ours) and "embed_tokens.weight" not in theirs
    assert theirs["fc.weight"].dtype == torch.bfloat16 and theirs["d2t"].dtype == torch.long
    assert torch.equal(theirs["fc.weight"], ours["fc.weight"].bfloat16())
    assert doctor.check([doctor.side_from_draft(src), doctor.side_from_sglang_export(out)]) == []
    # Same hidden size: no target_hidden_size field.
    same = export_sglang(make_draft_dir(tmp_path / "d2", tiny_target), tmp_path / "s2")
    assert "target_hidden_size" not in json.loads((same / "config.json").read_text())


def test_doctor_catches_an_export_from_another_draft(tmp_path, tiny_target):
    a = make_draft_dir(tmp_path / "a", tiny_target, ids=(0, 2, 4))
    b = export_sglang(make_draft_dir(tmp_path / "b", tiny_target, ids=(-1, 2, 4)), tmp_path / "b_sglang")
    errors = doctor.check([doctor.side_from_draft(a), doctor.side_from_sglang_export(b)])
    assert len(errors) == 1 and "says [0, 2, 4]" in errors[0] and "says [-1, 2, 4]" in errors[0]


def test_feature_norms_are_exported_and_checked_both_ways(tmp_path, tiny_target):
    src = make_draft_dir(tmp_path / "draft", tiny_target, fc_norm=True)
    out = export_sglang(src, tmp_path / "sglang", "float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_before_fc"] is False
    assert {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= set(
        load_file(str(out / "model.safetensors"))
    )
    assert doctor.check([doctor.side_from_draft(src), doctor.side_from_sglang_export(out)]) == []
    # A draft trained without the norms next to an export that asks for them.
    plain = make_draft_dir(tmp_path / "plain", tiny_target)
    errors = doctor.check([doctor.side_from_draft(plain), doctor.side_from_sglang_export(out)])
    assert any("feature_norms" in e and "fc_norm=False" in e and "fc_norm=True" in e for e in errors), errors
    # The flag dropped from config.json: SGLang would skip the norm weights without a word.
    cfg["fc_norm"] = False
    (out / "config.json").write_text(json.dumps(cfg))
    errors = doctor.check([doctor.side_from_sglang_export(out)])
    assert len(errors) == 1 and "fc_norm.0.weight" in errors[0] and "drop them silently" in errors[0], errors
    # The flag set but a weight missing: SGLang would leave that norm at ones.
    cfg["fc_norm"] = True
    (out / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(out / "model.safetensors"))
    del weights["fc_norm.2.weight"]
    save_file(weights, str(out / "model.safetensors"))
    errors = doctor.check([doctor.side_from_sglang_export(out)])
    assert len(errors) == 1 and "lack ['fc_norm.2.weight']" in errors[0], errors


def test_draft_section_refuses_both_feature_norms():
    from eagle3.schema import ConfigError
    from workflows.core.config import DraftSection

    with pytest.raises(ConfigError, match="draft.fc_norm and draft.norm_before_fc are both set"):
        DraftSection(fc_norm=True, norm_before_fc=True).validate()


def run_sglang_tool(tool: str, tag: str, *args) -> tuple[int, list[dict]]:
    """workflows.tools.<tool> in its own process with the SGLang CPU shim: (exit status,
    the JSON reports it printed on lines starting with `tag`)."""
    from workflows.core.sglang import with_shim

    env = {**with_shim(dict(os.environ)), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", f"workflows.tools.{tool}", *map(str, args)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(tag + " ")]
    assert lines, proc.stderr[-3000:]
    return proc.returncode, [json.loads(line.split(" ", 1)[1]) for line in lines]


@pytest.mark.slow
def test_sglang_loads_the_export_with_its_own_class(tmp_path, tiny_target):
    """SGLang's LlamaForCausalLMEagle3 built on CPU; every parameter checked after load_weights
    (the feature norms' too: SGLang builds them from config.json's flags). One process."""
    cases = [({}, 10), ({"fc_norm": True}, 13), ({"norm_before_fc": True, "rope_theta": 50000.0}, 11)]
    outs = [
        export_sglang(
            make_draft_dir(tmp_path / f"draft{i}", tiny_target, hidden=32, **norms), tmp_path / f"sglang{i}", "float32"
        )
        for i, (norms, _) in enumerate(cases)
    ]
    returncode, reports = run_sglang_tool("sglang_load_check", "SGLANG_LOAD_CHECK", *outs)
    assert len(reports) == len(cases) and returncode == 0, reports
    for report, (norms, params) in zip(reports, cases):
        assert report["ok"], report
        assert "model.layers.0.self_attn.qkv_proj.weight" in report["checked"]
        assert "model.layers.0.mlp.gate_up_proj.weight" in report["checked"] and "model.fc.weight" in report["checked"]
        assert len(report["checked"]) == params and report["not_ours"] == ["model.embed_tokens.weight"], report
        norm_params = [n for n in report["checked"] if n.startswith(("model.fc_norm.", "model.input_norm."))]
        assert len(norm_params) == params - 10, report
        assert report["rope_base"] == norms.get("rope_theta", 10000.0), report  # draft.rope_theta is served


@pytest.mark.slow
@pytest.mark.skipif(not speculators_available(), reason="the speculators package is not installed (extra: vllm)")
def test_vllm_export_loads_in_speculators(tmp_path, tiny_target):
    # The class speculators' converter validates with, and its config model (the fields vLLM reads).
    from speculators.convert.eagle.eagle3_legacy_model import Eagle3Speculator
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    src = make_draft_dir(tmp_path / "draft", tiny_target)
    sglang = export_sglang(src, tmp_path / "sglang", "float32")
    out = export_vllm(sglang, tmp_path / "vllm", tiny_target, [0, 2, 4])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    # vLLM's numbering: index L = the input of layer L, so ids [0, 2, 4] are indices [1, 3, 5].
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5] and cfg["draft_vocab_size"] == 256
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tiny_target)
    parsed = Eagle3SpeculatorConfig.from_pretrained(out)
    assert parsed.draft_vocab_size == 256 and parsed.eagle_aux_hidden_state_layer_ids == [1, 3, 5]
    assert parsed.transformer_layer_config.vocab_size == 1024
    weights = load_file(str(next(out.glob("*.safetensors"))))
    ours = load_file(str(src / "draft.safetensors"))
    assert torch.equal(weights["layers.0.self_attn.q_proj.weight"], ours["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(weights["d2t"], ours["d2t"]) and torch.equal(weights["t2d"], ours["t2d"])
    model = Eagle3Speculator.from_pretrained(out, verifier=None, verifier_attachment_mode="detached")
    state = model.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(state[name.replace("midlayer.", "layers.0.")].to(tensor.dtype), tensor), name
    assert doctor.check([doctor.side_from_draft(src), doctor.side_from_vllm_export(out)]) == []
    # An export that names the ids in the project's numbering (what this stage wrote before)
    # feeds the draft the layers below its own: the doctor reads vLLM's numbering and says so.
    cfg["eagle_aux_hidden_state_layer_ids"] = [0, 2, 4]
    (out / "config.json").write_text(json.dumps(cfg))
    [error] = doctor.check([doctor.side_from_draft(src), doctor.side_from_vllm_export(out)])
    assert error.startswith("capture_layer_ids:") and "says [0, 2, 4]" in error, error
    assert (
        "says [-1, 1, 3] (vLLM's eagle_aux_hidden_state_layer_ids=[0, 2, 4], index L = the input of layer L)" in error
    )


def test_the_export_stage_redoes_itself_when_vllm_export_becomes_possible_and_leaves_no_stale_export(
    tmp_path, tiny_target, monkeypatch
):
    """The stage's key records whether speculators (the vLLM export) was importable: installed
    later, a rerun adds vLLM's export; and an export that cannot write vLLM's layout removes
    the previous draft's, so that nothing downstream (the doctor, the served check) reads it."""
    import workflows.export as export
    from workflows.core.config import compose
    from workflows.core.layout import RunLayout
    from workflows.core.markers import mark_done, read_marker

    cfg = compose(["target=tiny", f"run_dir={tmp_path / 'run'}", f"cache_dir={tiny_target.parent.parent}"])
    layout = RunLayout.of(cfg)
    make_draft_dir(layout.draft_dir, tiny_target)
    mark_done(layout.stage_dir("train"), {"trained": 1}, {})
    stale = layout.vllm_export
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # an earlier draft's export
    monkeypatch.setattr(export, "speculators_available", lambda: False)
    export.run(cfg, tiny_target)
    assert read_marker(layout.stage_dir("export"))["summary"]["formats"] == ["sglang"]
    assert not stale.exists() and (layout.sglang_export / "config.json").is_file()
    monkeypatch.setattr(export, "speculators_available", lambda: True)
    export.run(cfg, tiny_target)
    assert read_marker(layout.stage_dir("export"))["summary"]["formats"] == ["sglang", "vllm"]
    assert json.loads((layout.vllm_export / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]


def make_dflash_dir(folder: Path):
    """A saved tiny block draft (6-layer target, ids [1, 2, 3], block 4, mask id 96, a
    40-token draft vocabulary: every 2nd target id); returns the draft."""
    from tests.test_dflash import tiny_dflash

    draft = tiny_dflash(draft_vocab_size=40, dtype=torch.float32)
    chosen = torch.arange(40) * 2
    t2d = torch.zeros(97, dtype=torch.bool)
    t2d[chosen] = True
    draft.set_vocab_mapping(chosen - torch.arange(40), t2d)
    prov = {"capture_layer_ids": [1, 2, 3], "layer_id_convention": "output_of_layer", "hidden_size": 24}
    save_draft(folder, draft, prov)
    return draft


def test_a_block_draft_exports_for_vllm_and_the_doctor_reads_it(tmp_path, tiny_target):
    """The DFlash export: vLLM's config (its ids in the project's numbering), the weights
    without the shared embeddings, the trained mask embedding beside them; the doctor agrees
    with the draft, and names a shifted id, a lost mask embedding and a mismatched one."""
    from eagle3.dflash.export import ARCHITECTURE
    from workflows.export import export_dflash

    draft = make_dflash_dir(tmp_path / "draft")
    out = export_dflash(tmp_path / "draft", tmp_path / "vllm", "float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURE] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": 96, "target_layer_ids": [1, 2, 3]}
    assert cfg["num_hidden_layers"] == 2 and cfg["draft_vocab_size"] == 40 and cfg["block_size"] == 4
    weights = load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in weights and "t2d" not in weights and "mask_embedding" not in weights
    assert torch.equal(weights["layers.1.self_attn.k_norm.weight"], draft.layers[1].self_attn.k_norm.weight)
    mask = torch.load(out / "mask_embedding.pt", weights_only=True)
    assert mask["mask_token_id"] == 96 and torch.equal(mask["embedding"], draft.mask_embedding.detach())
    assert doctor.check([doctor.side_from_draft(tmp_path / "draft"), doctor.side_from_vllm_export(out)]) == []
    shifted = export_dflash(tmp_path / "draft", tmp_path / "shifted", "float32", target_layer_ids=[2, 3, 4])
    [error] = doctor.check([doctor.side_from_draft(tmp_path / "draft"), doctor.side_from_vllm_export(shifted)])
    assert error.startswith("capture_layer_ids:") and "target_layer_ids=[2, 3, 4]" in error, error
    (shifted / "mask_embedding.pt").unlink()
    assert any("no mask_embedding.pt" in e for e in doctor.side_from_vllm_export(shifted).errors)
    torch.save({"mask_token_id": 5, "embedding": mask["embedding"]}, out / "mask_embedding.pt")
    assert any("is for mask token 5" in e for e in doctor.side_from_vllm_export(out).errors)
    # An EAGLE-3 export beside a block draft: the families disagree, by name.
    eagle = export_sglang(make_draft_dir(tmp_path / "e3", tiny_target), tmp_path / "sglang")
    errors = doctor.check([doctor.side_from_draft(tmp_path / "draft"), doctor.side_from_sglang_export(eagle)])
    assert any(e.startswith("draft_family:") for e in errors), errors


@pytest.mark.slow
def test_sglang_dflash_reads_the_block_export_but_drafts_through_the_targets_head(tmp_path):
    """SGLang's --speculative-algorithm DFLASH on the export vLLM reads, through SGLang's own
    code on CPU (workflows.tools.sglang_dflash_check): the config means what we mean (ids in
    our numbering, captured before layer i + 1; block 4 = anchor + 3 mask slots; mask id 96),
    every parameter of its DFlashDraftModel holds our values after its load_weights, and
    mask_embedding.pt replaces exactly the mask row of the target's table. What it cannot
    take: the draft's own lm_head and d2t (SGLang drafts through the target's lm_head), so
    SGLang would serve a different draft than the one trained. Ids shifted in the export
    are read shifted."""
    from workflows.export import export_dflash

    make_dflash_dir(tmp_path / "draft")
    outs = [
        export_dflash(tmp_path / "draft", tmp_path / "vllm", "float32"),
        export_dflash(tmp_path / "draft", tmp_path / "shifted", "float32", target_layer_ids=[2, 3, 4]),
    ]
    returncode, reports = run_sglang_tool("sglang_dflash_check", "SGLANG_DFLASH_CHECK", 6, *outs)
    assert len(reports) == 2 and returncode == 1, reports  # 1: the head SGLang drops
    report, shifted = reports
    assert report["config"] == {
        "block_size": 4,
        "mask_token_id": 96,
        "mask_token": "<|MASK|>",
        "target_layer_ids": [1, 2, 3],
        "captured_before_layers": [2, 3, 4],
    }, report
    assert report["problems"] == ["tensors SGLang never loaded: ['d2t', 'lm_head.weight']"], report
    assert len(report["checked"]) == 2 * 8 + 3 and {"fc.weight", "hidden_norm.weight", "norm.weight"} <= set(
        report["checked"]
    )
    assert "layers.1.self_attn.qkv_proj.weight" in report["checked"] and "lm_head.weight" not in report["checked"]
    assert report["mask"] == {"resolved_mask_token_id": 96, "rows_changed": [96]}, report
    shifted = shifted["config"]
    assert shifted["target_layer_ids"] == [2, 3, 4] and shifted["captured_before_layers"] == [3, 4, 5], shifted
