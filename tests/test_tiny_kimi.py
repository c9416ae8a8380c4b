"""The Kimi-shaped tiny target (`target=tiny_kimi`): a DeepseekV3 language model (MLA, MoE)
in the kimi_k25 wrapper's checkpoint layout, its Kimi-style chat template, and how the HF
engine loads the language model out of the wrapper (refusing an incomplete one). SGLang on
it: tests/test_capture_sglang.py."""

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
