"""SGLang's DSPARK layout (eagle3.dspark.export), held to SGLang 0.5.23's own DSpark model.

SGLang serves DSPARK on CUDA, NPU or XPU only (its server refuses a CPU), so what a CPU can
check is the model SGLang builds from the export: its config parser reads our config.json as
we mean it, its loader fills every parameter from our weights, and its Markov and confidence
heads, with the target's lm_head it shares, give the draft's own logits and confidences. The
model is built in a child process (SGLang's process-wide config and process groups), with
the CPU stand-ins of workflows/sglang_cpu_shim, in both of SGLang's verify modes: "static"
builds no confidence head, "compact" (adaptive verification) does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.schema import ConfigError
from tests.test_dspark import tiny_dspark
from workflows.core import wiring as doctor
from workflows.core.draft_files import save_draft
from workflows.core.sglang import SHIM_DIR
from workflows.export import export_dspark, export_dspark_sglang

ROOT = Path(__file__).resolve().parents[1]

# Builds SGLang's Qwen3DSparkModel from the export, loads its weights, and writes what SGLang
# holds and computes: every parameter, its parsed config, and its heads on given inputs.
SGLANG_SIDE = r"""
import json, sys, torch
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig
from sglang.srt import runtime_context
from sglang.srt.server_args import ServerArgs
from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
from sglang.srt.speculative.dspark_components.dspark_config import parse_dspark_draft_config

export, target, inputs, out = sys.argv[1:5]
runtime_context.publish(
    ServerArgs(model_path=target, device="cpu", attention_backend="torch_native", skip_tokenizer_init=True),
    role="test",
)
init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                             distributed_init_method="tcp://127.0.0.1:" + sys.argv[5])
initialize_model_parallel()
from sglang.srt.models.dspark import Qwen3DSparkModel

config = PretrainedConfig(**json.load(open(export + "/config.json")))
parsed = parse_dspark_draft_config(draft_hf_config=config)
model = Qwen3DSparkModel(config)
model.load_weights(iter(load_file(export + "/model.safetensors").items()))
x = load_file(inputs)
with torch.no_grad():
    held = {"param." + n: p.detach().clone() for n, p in model.named_parameters()}
    held["bias"] = model.markov_head.project_bias(model.markov_head.get_prev_embeddings(x["prev"]))
    if model.confidence_head is not None:
        embedded = model.markov_head.get_prev_embeddings(x["prev"])
        held["confidence"] = model.confidence_head(x["normed"], embedded)
save_file(held, out)
print(json.dumps({"gamma": parsed.gamma, "target_layer_ids": parsed.target_layer_ids,
                  "mask_token_id": parsed.mask_token_id, "markov_rank": parsed.markov_rank,
                  "confidence_head": model.confidence_head is not None}))
"""


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


def sglang_side(export: Path, target: Path, inputs: dict, tmp: Path, mode: str, port: int) -> tuple[dict, dict]:
    save_file(inputs, str(tmp / "inputs.safetensors"))
    out = tmp / f"sglang_{mode}.safetensors"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SHIM_DIR), str(ROOT)]),
        "SGLANG_RAGGED_VERIFY_MODE": mode,
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-c", SGLANG_SIDE, str(export), str(target), str(tmp / "inputs.safetensors"), str(out)]
    done = subprocess.run([*cmd, str(port)], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), load_file(str(out))


@pytest.mark.slow
def test_sglangs_own_dspark_model_loads_the_export_and_computes_the_drafts_heads(tmp_path):
    """A DSpark draft with the target's head over the whole vocabulary (draft.dspark.head=target
    with draft_vocab_size = the target's; the vocab stage's map is then the identity): SGLang's
    model holds every tensor of ours (q/k/v and gate/up fused), its Markov bias plus the target's
    head gives our logits, and its confidence head our confidences."""
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

    hidden, prev = torch.randn(5, c.hidden_size), torch.tensor([0, 7, 96, 40, 13])
    with torch.no_grad():
        logits, confidence = draft.heads(hidden, prev)  # draft order
        normed = draft.norm(hidden)
    parsed, sglang = sglang_side(export, target, {"prev": prev, "normed": normed}, tmp_path, "compact", 29741)
    assert parsed == {
        "gamma": 4,  # every slot of a block of 4 drafts
        "target_layer_ids": [1, 2, 3],
        "mask_token_id": c.mask_token_id,
        "markov_rank": 8,
        "confidence_head": True,
    }
    ours = dict(draft.named_parameters())
    for name, held in ((k.removeprefix("param."), v) for k, v in sglang.items() if k.startswith("param.")):
        attn = name.replace(".qkv_proj.", ".{}.").replace(".gate_up_proj.", ".{}.")
        if ".qkv_proj." in name:
            want = torch.cat([ours[attn.format(p)] for p in ("q_proj", "k_proj", "v_proj")])
        elif ".gate_up_proj." in name:
            want = torch.cat([ours[attn.format(p)] for p in ("gate_proj", "up_proj")])
        else:
            want = ours[name]
        assert torch.equal(held, want.detach()), name
    # SGLang's logits: the target's head on the normed state, plus its Markov bias
    served = normed @ head.T + sglang["bias"]
    assert torch.allclose(served, logits, atol=1e-5), (served - logits).abs().max()
    assert torch.equal(served.argmax(-1), logits.argmax(-1))
    assert torch.allclose(sglang["confidence"], confidence, atol=1e-6)

    # Static verification (SGLang's default) builds no confidence head and skips ours.
    parsed, _ = sglang_side(export, target, {"prev": prev, "normed": normed}, tmp_path, "static", 29742)
    assert parsed["confidence_head"] is False


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
