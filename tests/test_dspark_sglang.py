"""SGLang's DSPARK layout (eagle3.dspark.export), held to SGLang 0.5.23's own DSpark model.

SGLang serves DSPARK on CUDA, NPU or XPU only (its server refuses a CPU), so what a CPU can
check is the model SGLang builds from the export (workflows.tools.sglang_dspark_check, in a
process of its own with the CPU stand-ins): its config parser reads our config.json as we
mean it, its loader fills every parameter from our weights, and its Markov and confidence
heads compute what the draft's own do on the same tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.schema import ConfigError
from tests.test_dspark import tiny_dspark
from tests.test_export import run_sglang_tool
from workflows.core import wiring as doctor
from workflows.core.draft_files import save_draft
from workflows.export import export_dspark, export_dspark_sglang


def target_folder(folder: Path, head: torch.Tensor, norm: torch.Tensor) -> Path:
    """A target checkpoint with just what the export reads: config.json, lm_head, final norm."""
    folder.mkdir(parents=True)
    vocab, hidden = head.shape
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"lm_head.weight": head, "model.norm.weight": norm}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.slow
def test_sglangs_own_dspark_model_loads_the_export_and_computes_the_drafts_heads(tmp_path):
    """A DSpark draft with the target's head over the whole vocabulary (draft.dspark.head=target
    with draft_vocab_size = the target's; the vocab stage's map is then the identity): SGLang's
    model holds every tensor of ours (q/k/v and gate/up fused), nothing of ours is left
    unloaded, and its Markov and confidence heads give the draft's numbers."""
    draft = tiny_dspark(0, block_size=4, dtype=torch.float32)  # 97 tokens, all drafted
    c = draft.cfg
    draft.set_vocab_mapping(torch.zeros(c.vocab_size, dtype=torch.long), torch.ones(c.vocab_size, dtype=torch.bool))
    head = torch.randn(c.vocab_size, c.hidden_size)
    with torch.no_grad():
        draft.lm_head.weight.copy_(head)  # the target's head, frozen
    target = target_folder(tmp_path / "target", head, 1 + 0.1 * torch.randn(c.hidden_size))
    save_draft(tmp_path / "draft", draft, {"capture_layer_ids": [1, 2, 3], "layer_id_convention": "output_of_layer"})
    export = export_dspark_sglang(tmp_path / "draft", tmp_path / "sglang", target, "float32")
    # vLLM's folder of the same draft ships no d2t: vLLM builds no map for a draft over the whole
    # vocabulary and refuses one (served as predicted by vLLM: docs/drafters.md)
    vllm = export_dspark(tmp_path / "draft", tmp_path / "vllm", "float32")
    assert "d2t" not in load_file(str(vllm / "model.safetensors"))
    sides = [doctor.side_from_draft(tmp_path / "draft"), doctor.side_from_sglang_export(export)]
    assert doctor.check([*sides, doctor.side_from_vllm_export(vllm)]) == []

    returncode, [report] = run_sglang_tool("sglang_dspark_check", "SGLANG_DSPARK_CHECK", export)
    assert returncode == 0 and report["problems"] == [], report
    assert report["config"] == {
        "gamma": 4,  # every slot of a block of 4 drafts
        "target_layer_ids": [1, 2, 3],
        "mask_token_id": c.mask_token_id,
        "markov_rank": 8,
        "markov_head_type": "vanilla",
    }, report
    # fc, hidden_norm, norm, 2 layers x 8 (q/k/v and gate/up fused), the Markov and confidence heads
    assert report["confidence_head"] and len(report["checked"]) == 3 + 2 * 8 + 2 + 2, report["checked"]
    assert report["heads_max_abs_diff"] <= 1e-6, report


def test_a_draft_with_its_own_head_gets_no_sglang_export_and_a_shifted_one_is_named(tmp_path):
    """SGLang's DSpark drafts through the target's head: a draft over part of the vocabulary,
    or one that trained its head, is refused naming the settings that give an SGLang export
    (SGLang's own loader would fail on markov_w2's shape, or serve another head). The doctor
    reads the SGLang folder as it does vLLM's: a shifted id, a head left in, a short markov_w2."""
    draft = tiny_dspark(0, block_size=4, draft_vocab_size=40, dtype=torch.float32)
    chosen = torch.arange(40) * 2
    t2d = torch.zeros(97, dtype=torch.bool)
    t2d[chosen] = True
    draft.set_vocab_mapping(chosen - torch.arange(40), t2d)
    head = torch.randn(97, draft.cfg.hidden_size)
    target = target_folder(tmp_path / "target", head, torch.ones(draft.cfg.hidden_size))
    save_draft(tmp_path / "part", draft, {"capture_layer_ids": [1, 2, 3], "layer_id_convention": "output_of_layer"})
    with pytest.raises(ConfigError, match=r"own head over 40 of 97 tokens: train with draft.dspark.head=target "):
        export_dspark_sglang(tmp_path / "part", tmp_path / "sglang_part", target, "float32")
    assert not (tmp_path / "sglang_part").exists()

    whole = tiny_dspark(0, block_size=4, dtype=torch.float32)
    whole.set_vocab_mapping(torch.zeros(97, dtype=torch.long), torch.ones(97, dtype=torch.bool))
    save_draft(tmp_path / "trained", whole, {"capture_layer_ids": [1, 2, 3], "layer_id_convention": "output_of_layer"})
    with pytest.raises(ConfigError, match=r"trained a head of its own: train with draft.dspark.head=target"):
        export_dspark_sglang(tmp_path / "trained", tmp_path / "sglang_trained", target, "float32")

    with torch.no_grad():
        whole.lm_head.weight.copy_(head)
    save_draft(tmp_path / "shared", whole, {"capture_layer_ids": [1, 2, 3], "layer_id_convention": "output_of_layer"})
    out = export_dspark_sglang(tmp_path / "shared", tmp_path / "sglang", target, "float32")
    weights = load_file(str(out / "model.safetensors"))
    assert not {"lm_head.weight", "d2t", "t2d", "embed_tokens.weight", "mask_embedding"} & set(weights)
    cfg = json.loads((out / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [2, 3, 4]
    (out / "config.json").write_text(json.dumps(cfg))
    [error] = doctor.check([doctor.side_from_draft(tmp_path / "shared"), doctor.side_from_sglang_export(out)])
    assert error.startswith("capture_layer_ids:") and "SGLang DSpark export" in error, error
    weights["lm_head.weight"] = head
    weights["markov_head.markov_w2.weight"] = weights["markov_head.markov_w2.weight"][:40]
    save_file(weights, str(out / "model.safetensors"))
    errors = doctor.side_from_sglang_export(out).errors
    assert any("needs a row per target token (97)" in e for e in errors), errors
    assert any("which SGLang's DSpark skips for the target's" in e for e in errors), errors
