"""The GPU presets compose and load (Hydra + the strict schema) with the values they promise."""

from __future__ import annotations

import pytest

from eagle3.layer_ids import check_sglang_servable, sglang_layer_inputs
from eagle3.schema import ConfigError
from workflows.core.config import STAGES, compose


def test_kimi_target_preset():
    cfg = compose(["target=kimi_k25_int4"])
    t = cfg.target
    assert (t.name, t.model_type, t.num_layers, t.hidden_size, t.tp_size) == (
        "kimi_k25_int4",
        "deepseek_v3",
        61,
        7168,
        8,
    )
    assert t.capture_ids == [1, 29, 57] and sglang_layer_inputs(t.capture_ids, t.model_type) == [2, 30, 58]
    assert t.trust_remote_code and cfg.run_dir == "runs/kimi_k25_int4"


def test_llama_target_preset():
    t = compose(["target=llama31_8b"]).target
    assert (t.name, t.num_layers, t.hidden_size, t.vocab_size, t.tp_size) == ("llama31_8b", 32, 4096, 128256, 1)
    assert t.capture_ids == [1, 15, 28] and sglang_layer_inputs(t.capture_ids, "llama") == [2, 16, 29]


def test_kimi_experiment_one_node_of_eight_gpus():
    cfg = compose(["+experiment=kimi_k25"])
    assert cfg.target.name == "kimi_k25_int4" and cfg.target.tp_size == 8
    assert cfg.target.capture_ids == [1, 29, 57]
    assert (cfg.data.backend, cfg.data.num_engines, cfg.data.max_length) == ("sglang", 1, 8192)
    assert cfg.data.gpus_per_engine == 8 and cfg.capture.final_state == "auto"
    assert (cfg.capture.backend, cfg.capture.actors, cfg.capture.gpus_per_actor) == ("sglang", 1, 8)
    train = cfg.train
    assert (train.ttt.length, train.ttt.noise.kind, train.ttt.noise.std) == (5, "gaussian", 0.05)
    assert (train.max_seq_len, train.num_workers, train.gpus_per_worker) == (8192, 4, 1)
    assert train.acceptance_k <= train.ttt.length and list(cfg.stages) == list(STAGES)
    # Command-line overrides still win over the experiment.
    assert compose(["+experiment=kimi_k25", "train.ttt.length=7"]).train.ttt.length == 7


def test_kimi_layer_variant_trains_but_is_not_exported():
    cfg = compose(["+experiment=kimi_k25_layers_m1_2_30"])
    assert cfg.target.capture_ids == [-1, 2, 30] and cfg.run_dir == "runs/kimi_k25_int4_layers_m1_2_30"
    assert (cfg.train.ttt.length, cfg.train.max_seq_len, cfg.train.num_workers, cfg.capture.gpus_per_actor) == (
        5,
        8192,
        4,
        8,
    )  # everything else as kimi_k25
    assert list(cfg.stages) == ["target", "generate", "capture", "vocab", "train"]
    # Why it stops there: the export stage's check refuses these ids for a DeepSeek-V3 target.
    with pytest.raises(ConfigError, match=r"inputs of layers \[-1, 2, 30\]"):
        check_sglang_servable(cfg.target.capture_ids, cfg.target.num_layers, cfg.target.model_type)
    check_sglang_servable(compose(["+experiment=kimi_k25"]).target.capture_ids, 61, "deepseek_v3")


def test_llama_experiment_one_gpu():
    cfg = compose(["+experiment=llama31_8b"])
    assert cfg.target.name == "llama31_8b" and cfg.target.tp_size == 1
    assert (cfg.data.backend, cfg.capture.backend, cfg.capture.gpus_per_actor) == ("sglang", "sglang", 1)
    assert cfg.data.gpus_per_engine == 1
    assert (cfg.train.num_workers, cfg.train.gpus_per_worker) == (1, 1)
    assert cfg.run_dir == "runs/llama31_8b"


@pytest.mark.parametrize(
    "override, field",
    [("data.gpus_per_engine=4", "data.gpus_per_engine=4"), ("capture.gpus_per_actor=2", "capture.gpus_per_actor=2")],
)
def test_an_sglang_actor_holds_exactly_its_tp_group(override, field):
    with pytest.raises(
        ConfigError,
        match=rf"{field} but target.tp_size=8: an SGLang engine actor is one "
        "tensor-parallel group",
    ):
        compose(["+experiment=kimi_k25", override])
    with pytest.raises(ConfigError, match=r"capture.gpus_per_actor=0 \(SGLang on the CPU\) but target.tp_size=8"):
        compose(["+experiment=kimi_k25", "capture.gpus_per_actor=0"])
    # The HF backend runs on one GPU of its actor, whatever the TP size of the preset.
    compose(["+experiment=kimi_k25", "capture.backend=hf", "capture.gpus_per_actor=1"])


def test_specforge_train_preset_has_specforge_settings():
    """train=specforge: SpecForge 0.2.0's settings, the answers' positions only among them,
    while the project's default scores every position (docs/results.md: ablations)."""
    t = compose(["train=specforge"]).train
    assert (t.ttt.noise.kind, tuple(t.optim.betas)) == ("none", (0.9, 0.999))
    o = t.objective
    assert (o.kind, o.normalise, o.skip_unreachable, o.tokens) == ("soft_ce", "positions", True, "answer")
    assert (t.optim.warmup_steps, t.optim.min_lr_ratio) == (55, 0.0)
    assert compose([]).train.objective.tokens == "all"


def test_long_context_experiment_splits_32k_samples_over_four_gpus():
    from workflows.capture.sizing import estimate, longest_sample

    cfg = compose(["+experiment=long_context"])
    assert (cfg.data.max_length, cfg.train.max_seq_len, cfg.capture.micro_batch_tokens) == (32768, 32768, 32768)
    assert (cfg.train.num_workers, cfg.train.sequence_parallel, cfg.train.gpus_per_worker) == (8, 4, 1)
    assert cfg.train.packing and cfg.draft.family == "eagle3"
    per_token = estimate(cfg.target, cfg.capture, 1, cfg.store_capture_ids)["bytes_per_token"]
    longest = longest_sample(per_token, cfg.data, cfg.capture, cfg.train.max_seq_len)
    assert per_token == 2 * 4 * 4096 + 5 and longest["store"] == "1.07 GB"  # as the preset's comment says
    assert longest["trained_tokens"] == 32768 and not longest["alone_in_its_capture_forward"]
    # 64K, as the comment says: one sample over the 8 GPUs
    long64 = [f"{k}=65536" for k in ("data.max_length", "train.max_seq_len", "capture.micro_batch_tokens")]
    assert compose(["+experiment=long_context", *long64, "train.sequence_parallel=8"]).train.max_seq_len == 65536


def test_samples_past_the_targets_positions_are_refused_naming_both():
    with pytest.raises(ConfigError, match=r"data.max_length=4096 exceeds target.max_position_embeddings=2048"):
        compose(["target=tiny", "data.max_length=4096"])
