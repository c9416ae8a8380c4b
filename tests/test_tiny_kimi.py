"""The Kimi-shaped tiny target (`target=tiny_kimi`): a DeepseekV3 language model (MLA, MoE)
in the kimi_k25 wrapper's checkpoint layout, its Kimi-style chat template, and how the HF
engine loads the language model out of the wrapper (refusing an incomplete one), and the
whole pipeline on it through SGLang and vLLM."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from eagle3.schema import ConfigError, from_dict
from eagle3.target_spec import TargetSpec

CONF = Path(__file__).resolve().parents[1] / "conf" / "target"


@pytest.mark.slow  # the tiny_kimi build: about a minute, once a session
def test_the_checkpoint_is_kimi_k25s_layout_with_a_deepseek_v3_inside(tiny_kimi_target):
    """What both engines read: the wrapper's config around the language model's, every
    tensor under `language_model.`, the MLA latent vLLM's CPU backend needs (512 + 64) and
    the yarn RoPE SGLang's CPU backend needs; the HF engine loads the language model alone,
    with the checkpoint's own tensors (no random ones)."""
    from safetensors import safe_open

    from workflows.core.target_weights import read_embeddings, read_head_and_norm
    from workflows.core.targets import load_target

    config = json.loads((tiny_kimi_target / "config.json").read_text())
    text = config["text_config"]
    assert (config["model_type"], config["architectures"]) == ("kimi_k25", ["KimiK25ForConditionalGeneration"])
    assert (text["model_type"], text["architectures"]) == ("deepseek_v3", ["DeepseekV3ForCausalLM"])
    assert config["vision_config"]["vt_hidden_size"] == 32 and config["tie_word_embeddings"] is False
    # vLLM builds the wrapper's image processor at start, serving its language model alone or not
    media = json.loads((tiny_kimi_target / "preprocessor_config.json").read_text())["media_proc_cfg"]
    assert (media["patch_size"], media["merge_kernel_size"], media["temporal_merge_kernel_size"]) == (14, 2, 4)
    assert text["kv_lora_rank"] + text["qk_rope_head_dim"] == 576
    assert text["rope_scaling"]["type"] == text["rope_parameters"]["rope_type"] == "yarn"
    assert {k: text[k] for k in ("topk_method", "scoring_func", "n_group", "topk_group", "first_k_dense_replace")} == {
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
    }
    with safe_open(str(tiny_kimi_target / "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
    assert all(n.startswith("language_model.") for n in names) and len(names) == 281
    assert "language_model.model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in names  # layer 0 is dense

    model, tokenizer = load_target(tiny_kimi_target)
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and len(model.model.layers) == 8
    assert sum(p.numel() for p in model.parameters()) == 11_328_256
    torch.testing.assert_close(model.get_input_embeddings().weight, read_embeddings(tiny_kimi_target), rtol=0, atol=0)
    head, norm = read_head_and_norm(tiny_kimi_target)
    torch.testing.assert_close(model.lm_head.weight, head, rtol=0, atol=0)
    torch.testing.assert_close(model.model.norm.weight, norm, rtol=0, atol=0)
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tokenizer.eos_token_id


@pytest.mark.slow  # the tiny_kimi build: about a minute, once a session
def test_the_kimi_template_renders_thinking_and_tool_calls_as_kimi_does(tiny_kimi_target):
    """Kimi-K2.5's markup, each tag one token; thinking and tool tags are not special (they
    survive SGLang's filter of special ids); the tool format is the kimi_k2 family, and the
    template gives exact masks with and without tools."""
    from transformers import AutoTokenizer

    from eagle3 import tool_calls as tc
    from eagle3.chat_template import check_template, check_tool_template, render, template_messages

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_kimi_target))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "reasoning_content": "Look it up.",
            "content": "",
            "tool_calls": [tc.call("weather", {"city": "Oslo"})],
        },
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "Rain."},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    text = render(tokenizer, template_messages(messages), tools=tools)
    assert text == (
        "<|im_system|>tool_declare<|im_middle|>"
        '[{"type": "function", "function": {"name": "weather", "parameters": {}}}]<|im_end|>'
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Oslo?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>\nLook it up.\n</think>\n\n"
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.weather:0<|tool_call_argument_begin|>{"city": "Oslo"}'
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.weather:0\nrain<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Rain.<|im_end|>"
    )
    assert render(tokenizer, template_messages(messages[1:2]), add_generation_prompt=True, thinking=False).endswith(
        "<|im_assistant|>assistant<|im_middle|><think></think>"
    )
    for tag in ("<think>", "</think>", "<|tool_call_begin|>", "<|im_middle|>", "<|im_end|>"):
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1, tag
    markup = tokenizer.convert_tokens_to_ids(["<think>", "<|tool_calls_section_begin|>"])
    assert not set(markup) & set(tokenizer.all_special_ids)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in tokenizer.all_special_ids
    check_template(tokenizer)
    assert check_tool_template(tokenizer) == "kimi_k2"


def _copy_with(src: Path, dst: Path, keep) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({n: t for n, t in tensors.items() if keep(n)}, str(dst / "model.safetensors"), {"format": "pt"})
    return dst


@pytest.mark.slow  # the tiny_kimi build: about a minute, once a session
def test_an_incomplete_wrapper_is_refused_by_name(tiny_kimi_target, tmp_path):
    """transformers would initialise a missing tensor at random with a warning; the loader
    refuses, naming it; a wrapper with no `language_model.` tensors at all is refused too."""
    from workflows.core.targets import load_target

    missing = _copy_with(tiny_kimi_target, tmp_path / "missing", lambda n: "layers.3.self_attn.kv_b_proj" not in n)
    with pytest.raises(ConfigError, match=r"lacks 1 tensors \(e.g. 'model.layers.3.self_attn.kv_b_proj.weight'"):
        load_target(missing)
    renamed = tmp_path / "renamed"
    _copy_with(tiny_kimi_target, renamed, lambda n: False)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_kimi_target / "model.safetensors"))
    save_file({"text." + n: t for n, t in tensors.items()}, str(renamed / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ConfigError, match="no tensor of it is under 'language_model.'"):
        load_target(renamed)


def test_the_builder_refuses_what_it_does_not_build(tmp_path):
    """A tiny_kimi_trained preset that is not a deepseek_v3, or whose key/value heads differ
    from its query heads (MLA has one per query head), is refused before anything is built."""
    from workflows.core.targets import prepare_target

    spec = from_dict(TargetSpec, yaml.safe_load((CONF / "tiny_kimi.yaml").read_text()), "target")
    with pytest.raises(ConfigError, match="source=tiny_kimi_trained builds a deepseek_v3"):
        prepare_target(dataclasses.replace(spec, model_type="llama"), tmp_path)
    with pytest.raises(ConfigError, match="MLA has one key/value head per query head"):
        prepare_target(dataclasses.replace(spec, num_key_value_heads=2), tmp_path)


# The whole pipeline on the Kimi-shaped target, on the engines' paths: SGLang's engine actors
# generate and capture, both engines serve. 24 conversations (4 held out) of 32 greedy tokens,
# float32 throughout, a draft trained 200 steps at lr 3e-3 in this process (acceptance ~3.4 of 5).
KIMI_RUN = (
    "target=tiny_kimi",
    "mixture=bundled",
    "data.limit=24",
    "data.max_new_tokens=32",
    "data.heldout_fraction=0.25",
    "data.backend=sglang",
    "data.num_engines=1",
    "capture.backend=sglang",
    "data.dtype=float32",
    "capture.dtype=float32",
    "train.capture_dtype=float32",
    "train.compute_dtype=float32",
    "train.steps=200",
    "train.optim.lr=3e-3",
    "train.backend=local",  # Ray Train and DeepSpeed: tests/test_train_scale.py, on the same loop
    "evaluate.max_new_tokens=32",
    "evaluate.device=cpu",
    "evaluate.served=auto",
)


@pytest.mark.slow  # ~1.7 minutes: two SGLang engine actors, training, three engines serving
@pytest.mark.sglang
def test_every_stage_runs_on_the_kimi_shaped_target_and_both_engines_serve_it_as_predicted(
    tiny_kimi_target, tmp_path, monkeypatch
):
    """`python -m workflows.full target=tiny_kimi` on SGLang's engines: SGLang's greedy answers
    are HF's token for token and its captured states HF's (the capture stage's spot check, on
    by default); the engine reports capturing the inputs of layers [2, 4, 5] for ids [1, 3, 4]
    (DeepSeek's rule), and the exports say so in each engine's numbering; SGLang and vLLM
    (the wrapper's language model alone, CPU_MLA) serve the draft at the reference decoder's
    figure, identical to greedy; the report's headline holds both. Mis-wired, the export is
    flagged: one layer off (the family's +1 forgotten) by the wiring doctor, and a draft
    served on other layers by the served check. Without the shim's MLA stand-in
    (workflows/sglang_cpu_shim/sglang_cpu_mla) torch_native prefills read the latent KV pool
    as plain keys and values: on this target's head sizes the first prefill fails (batch2
    [4, 128] against the latent's [4, 576]); where they line up, the tokens differ from HF's
    without an error."""
    import shutil

    from tests.helpers import corpus_rows
    from workflows import full
    from workflows.core.config import compose
    from workflows.core.engine_spec import EngineSpec
    from workflows.core.engines import make_engine
    from workflows.core.serving import ServeJob, served_check, verdict, vllm_target_args
    from workflows.core.wiring import check, sides_for_run

    run = tmp_path / "run"
    cfg = compose([*KIMI_RUN, f"cache_dir={tiny_kimi_target.parent.parent}", f"run_dir={run}"])
    logs = []
    monkeypatch.setattr(full, "log", logs.append)
    full.run(cfg)

    # generate: SGLang's answers (32 greedy tokens, then the template's end) are HF's, on
    # the held-out rows and as many train rows
    rows = corpus_rows(run)
    heldout = [r for r in rows if r["split"] == "heldout"]
    n = len(heldout)  # held out by a hash of the id: 4 of these 24
    assert len(rows) == 24 and n >= 3 and all(r["finish"] == "length" for r in rows)
    checked = heldout + [r for r in rows if r["split"] == "train"][:n]
    prompts = [r["input_ids"][: r["loss_mask"].index(1)] for r in checked]
    hf = make_engine("hf", EngineSpec(str(tiny_kimi_target), dtype="float32", capture_ids=[1, 3, 4]))
    greedy = [ids for ids, _ in hf.generate(prompts, max_new_tokens=32)]
    assert [r["input_ids"][len(p) : len(p) + 32] for p, r in zip(prompts, checked)] == greedy
    assert all(len(set(ids)) >= 5 for ids in greedy)  # text, not one token repeated

    # capture: what SGLang reported capturing, and its states against HF's
    summary = json.loads((run / "capture" / "summary.json").read_text())
    (actor,) = summary["per_actor"].values()
    assert (actor["layers_to_capture"], summary["engine_captured_layer_ids"]) == ([2, 4, 5], [1, 3, 4])
    spot = summary["spot_check"]
    assert spot["ran"] and spot["layers"] == ["id 1", "id 3", "id 4", "final"]
    assert spot["rel_diff"] <= 2**-8 < spot["tolerance"], spot  # the store's bfloat16 rounding, no more

    # export: the same layers, in each engine's numbering
    sglang_cfg = json.loads((run / "export" / "sglang" / "config.json").read_text())
    vllm_cfg = json.loads((run / "export" / "vllm" / "config.json").read_text())
    assert sglang_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang adds 1 (first id 1)
    assert vllm_cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: index L = the input of layer L

    # served: both engines at the prediction, identical to greedy, both in the headline
    report = json.loads((run / "report" / "report.json").read_text())
    assert report["prompts"] == n and report["lossless"] and report["acceptance_decoded"] > 3
    for engine in ("sglang", "vllm"):
        served = report["served"][engine]
        assert served["matches_prediction"] and served["identical_to_greedy"] == n, served
        assert abs(served["served_over_predicted"] - 1) <= 0.02
    headline = next(line for line in logs if line.startswith("acceptance: "))
    assert "served by sglang 0.5.23" in headline and "served by vllm 0.32.0" in headline

    # mis-wired: one layer off, as the seed's deployment was; the doctor names both sides
    vllm_export = run / "export" / "vllm"
    (vllm_export / "config.json").write_text(json.dumps({**vllm_cfg, "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}))
    errors = check(sides_for_run(cfg, tiny_kimi_target))
    assert any("capture_layer_ids" in e and "vLLM" in e for e in errors), errors
    # On this 8-layer target the states one layer apart are alike: drafts served one layer off
    # lost 0% to 6% here (docs/serving.md), not always past the served check's 2%. So the
    # doctor guards that, and the served check is held to a draft served on layers it was not
    # trained on: [5, 6, 7], the last three (this draft: 3.20 against 3.64, x0.88).
    miswired = tmp_path / "miswired"
    shutil.copytree(vllm_export, miswired)
    (miswired / "config.json").write_text(json.dumps({**vllm_cfg, "eagle_aux_hidden_state_layer_ids": [5, 6, 7]}))
    held = [json.loads(line) for line in (run / "report" / "prompts.jsonl").read_text().splitlines()]
    job = ServeJob(
        engine="vllm",
        target_path=str(tiny_kimi_target),
        draft_path=str(miswired),
        num_steps=report["num_steps"],
        topk=1,
        num_draft_tokens=report["num_draft_tokens"],
        prompts=[h["input_ids"] for h in held],
        max_new_tokens=[h["max_new_tokens"] for h in held],
        eos=held[0]["stop_token_ids"],
        timeout_s=600,
        **vllm_target_args(tiny_kimi_target, "cpu"),
    )
    greedy_of = {tuple(p): ids for p, ids in zip(prompts, greedy)}
    predicted = report["served"]["vllm"]["predicted"]
    flagged = served_check(
        job,
        [greedy_of[tuple(h["input_ids"])] for h in held],
        predicted,
        "acceptance_decoded_vllm_definition",
        tolerance=0.02,
    )
    assert flagged["identical_to_greedy"] == n and flagged["served_over_predicted"] < 0.95, flagged
    assert not flagged["matches_prediction"]
    assert "BELOW PREDICTION by more than 2%" in verdict(flagged)
