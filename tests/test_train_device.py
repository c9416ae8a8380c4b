"""The training path on CUDA, checked on the CPU: the dtype follows the workers' device, one
device for DeepSpeed and the batches, gradients freed before the forward, presets that do
not generate what they throw away, a bounded held-out evaluation."""

from __future__ import annotations

import types

import pytest
import torch

from eagle3.schema import ConfigError
from eagle3.target_head import TargetHead
from eagle3.training import LoopConfig, OptimConfig, PlainOptimizer, train_step
from eagle3.ttt import TTTConfig
from tests.helpers import random_draft, tiny_draft_config
from workflows.core import precision
from workflows.core.config import compose


@pytest.fixture(autouse=True)
def fresh_choice():
    precision.cpu_choice.cache_clear()
    yield
    precision.cpu_choice.cache_clear()


@pytest.mark.parametrize(
    "overrides, backend, chosen",
    [
        (["train.gpus_per_worker=1"], "deepspeed", "bfloat16"),  # GPU workers: bf16, whatever the driver's CPU
        (["train.backend=local", "train.device=cuda"], "plain", "bfloat16"),
        ([], "deepspeed", "float32"),  # CPU workers: the measured choice of this CPU
        (["train.backend=local"], "plain", "float32"),
        ([], "online", "float32"),
    ],
)
def test_the_training_dtype_follows_the_workers_device(monkeypatch, overrides, backend, chosen):
    from workflows.train.stage import training_dtype

    probed = []

    def gflops(dtype):  # a driver CPU without bf16 units: probing it would say fp32
        probed.append(dtype)
        return 8.0 if dtype == "bfloat16" else 55.0

    monkeypatch.setattr(precision, "matmul_gflops", gflops)
    cfg = compose(["target=tiny", *overrides])
    assert training_dtype(cfg.train, backend) == chosen
    assert bool(probed) == (chosen == "float32"), "a CUDA run must not probe the driver's CPU"
    # An explicit dtype is kept on every device.
    assert (
        training_dtype(compose(["target=tiny", "train.compute_dtype=float32", *overrides]).train, backend) == "float32"
    )


def test_cuda_auto_is_bf16_on_a_driver_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: pytest.fail("probed a GPU that is not here"))
    assert precision.resolve("auto", "cuda") == "bfloat16"


@pytest.mark.parametrize("gpus", ["0.5", "2", "1.5"])
def test_a_worker_holds_one_gpu_or_none(gpus):
    with pytest.raises(ConfigError, match=rf"train.gpus_per_worker={gpus}: each Ray Train worker trains on one GPU"):
        compose(["target=tiny", f"train.gpus_per_worker={gpus}"])
    assert compose(["target=tiny", "train.gpus_per_worker=1"]).train.gpus_per_worker == 1


def test_deepspeed_places_the_module_on_the_trainers_device(monkeypatch):
    """DeepSpeed 0.19.8 (pinned) takes the device from `args.device_rank` when it is given,
    else from LOCAL_RANK: with Ray's GPU (cuda:2 for a worker of local rank 1) they differ."""
    from deepspeed.runtime import engine as ds_engine

    from workflows.train.trainer import deepspeed_args

    assert deepspeed_args(torch.device("cpu")) is None  # CPU workers: DeepSpeed's own default
    args = deepspeed_args(torch.device("cuda", 2))
    assert args.device_rank == 2
    # A bare "cuda" (index None, as train.device=cuda gives) is the current device: DeepSpeed
    # compares device_rank with 0, and None broke the first H200 run of bench.gpu_suite.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert deepspeed_args(torch.device("cuda")).device_rank == 3

    chosen = []
    accelerator = types.SimpleNamespace(set_device=chosen.append, device_name=lambda i: f"cuda:{i}")
    monkeypatch.setattr(ds_engine, "get_accelerator", lambda: accelerator)
    monkeypatch.setattr(ds_engine.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(ds_engine.dist, "get_rank", lambda: 1)
    engine = types.SimpleNamespace(local_rank=1)  # what LOCAL_RANK says
    ds_engine.DeepSpeedEngine._set_distributed_vars(engine, args)
    assert engine.device == torch.device("cuda", 2) and chosen == [2]
    ds_engine.DeepSpeedEngine._set_distributed_vars(engine, None)
    assert engine.device == torch.device("cuda", 1)  # without args: LOCAL_RANK, the defect


def test_last_steps_gradients_are_freed_before_the_forward():
    cfg = tiny_draft_config()
    draft = random_draft(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    b, t = 2, 12
    batch = {
        "input_ids": torch.randint(0, cfg.vocab_size, (b, t), generator=g),
        "loss_mask": torch.ones(b, t, dtype=torch.long),
        "attention_mask": torch.ones(b, t, dtype=torch.bool),
        "aux": torch.randn(b, t, cfg.num_aux * cfg.target_hidden_size, generator=g),
        "final": torch.randn(b, t, cfg.target_hidden_size, generator=g),
    }
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=g))
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[: cfg.draft_vocab_size] = True
    draft.set_vocab_mapping(torch.zeros(cfg.draft_vocab_size, dtype=torch.long), t2d)  # draft id i = target id i
    loop = LoopConfig(
        steps=2, ttt=TTTConfig(length=2, attention="dense"), optim=OptimConfig(lr=1e-3), compute_dtype="float32"
    )
    opt = PlainOptimizer(draft, loop.optim)
    alive = []
    draft.fc.register_forward_pre_hook(lambda *_: alive.append(sum(p.grad is not None for p in draft.parameters())))
    for step in range(2):
        train_step(opt, head, [batch, batch], 1e-3, loop)  # two micro-batches: grads accumulate within a step
    assert len(alive) == 4 and alive[0] == alive[2] == 0 and alive[1] == alive[3] > 0, alive
    assert any(p.grad is not None for p in draft.parameters())  # the last step's stay for inspection


def test_presets_do_not_generate_past_the_length_samples_are_cut_to():
    with pytest.raises(ConfigError, match=r"data.max_new_tokens=600 but data.max_length=512 .*raise data.max_length"):
        compose(["target=tiny", "data.max_new_tokens=600"])
    cfg = compose(["+experiment=llama31_8b"])
    assert cfg.data.max_new_tokens < cfg.data.max_length == cfg.train.max_seq_len


def saved_bytes(t: int, vd: int, h: int, ttt: int, kind: str, block: int = 0) -> int:
    """Bytes autograd saves for backward in one forward_batch (unique storages, so the views
    of one tensor count once), batch 1, fp32."""
    from eagle3.objectives import ObjectiveConfig
    from eagle3.training import forward_batch

    cfg = tiny_draft_config(
        hidden_size=h,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=2 * h,
        vocab_size=2 * vd,
        draft_vocab_size=vd,
        target_hidden_size=h,
    )
    draft = random_draft(cfg, dtype=torch.float32).train()
    t2d = torch.zeros(2 * vd, dtype=torch.bool)
    t2d[:vd] = True
    draft.set_vocab_mapping(torch.zeros(vd, dtype=torch.long), t2d)
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 2 * vd, (1, t), generator=g),
        "loss_mask": torch.ones(1, t, dtype=torch.long),
        "attention_mask": torch.ones(1, t, dtype=torch.bool),
        "aux": torch.randn(1, t, 3 * h, generator=g),
        "final": torch.randn(1, t, h, generator=g),
    }
    head = TargetHead(torch.randn(2 * vd, h, generator=g))
    storages = {}

    def pack(x):
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        forward_batch(
            draft,
            head,
            batch,
            TTTConfig(length=ttt, attention="dense"),
            train=True,
            objective=ObjectiveConfig(kind=kind, loss_block_rows=block),
        )
    return sum(storages.values())


@pytest.mark.parametrize("t, vd, h", [(64, 4096, 32), (128, 4096, 32), (64, 8192, 64)])
@pytest.mark.parametrize(
    "kind, block, vd_tensors",
    [("soft_ce", 0, 1), ("log_acceptance", 0, 2), ("kl_acceptance", 0, 2), ("soft_ce", 48, 0)],
)
def test_a_ttt_step_saves_one_draft_vocab_distribution_for_backward(t, vd, h, kind, block, vd_tensors):
    """Per TTT step autograd keeps log_softmax's output [T, Vd] (and, where the loss is the
    acceptance rate, exp of it): the target's distribution is one shared tensor (slices, not
    a shifted copy per step), and the acceptance figure of soft_ce has no graph. The rest is
    the draft layer's [T, H] activations and the [T, T] attention of each of its 2 heads.
    Before, a soft_ce step saved 3.2 [T, Vd] tensors (a shifted copy, exp, minimum). With
    `loss_block_rows` (eagle3.chunked_loss) a soft_ce step saves none: only [T, H] inputs."""
    per_step = (saved_bytes(t, vd, h, 3, kind, block) - saved_bytes(t, vd, h, 1, kind, block)) / 2
    bound = 4 * t * (vd_tensors * vd + 24 * h + 2 * 2 * t)
    assert per_step <= bound, (per_step / (4 * t * vd), "[T, Vd] fp32 tensors per step")


def test_recomputing_the_mlp_keeps_the_gradients_and_drops_its_activations():
    """train.activation_checkpointing=mlp: the same loss and gradients (float64), and per TTT
    step autograd no longer keeps the MLP's three [T, intermediate] activations."""
    cfg = tiny_draft_config(intermediate_size=256)
    g = torch.Generator().manual_seed(0)
    t = 48
    batch = {
        "input_ids": torch.randint(0, cfg.vocab_size, (1, t), generator=g),
        "loss_mask": torch.ones(1, t, dtype=torch.long),
        "attention_mask": torch.ones(1, t, dtype=torch.bool),
        "aux": torch.randn(1, t, 3 * cfg.target_hidden_size, generator=g).double(),
        "final": torch.randn(1, t, cfg.target_hidden_size, generator=g).double(),
    }
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=g).double())
    runs = {}
    for mode in ("none", "mlp"):
        draft = random_draft(cfg, seed=0)
        loop = LoopConfig(
            steps=1,
            ttt=TTTConfig(length=3, attention="dense"),
            optim=OptimConfig(lr=1e-3),
            compute_dtype="float32",
            activation_checkpointing=mode,
        )
        opt = PlainOptimizer(draft, loop.optim)
        opt.optimizer.step = lambda: None  # keep the weights: compare the gradients of one step
        storages = {}

        def pack(x):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            loss = train_step(opt, head, [batch], 1e-3, loop)["loss"]
        runs[mode] = loss, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}, storages
    (loss_a, grads_a, saved_a), (loss_b, grads_b, saved_b) = runs["none"], runs["mlp"]
    assert loss_b == pytest.approx(loss_a, rel=1e-12) and grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], msg=name)
    mlp_bytes = 3 * t * cfg.intermediate_size * 8  # gate, up and their product, float64, per step
    assert sum(saved_a.values()) - sum(saved_b.values()) >= 3 * 0.9 * mlp_bytes  # three TTT steps
    with pytest.raises(ConfigError, match=r"train.activation_checkpointing='all' is not one of"):
        LoopConfig(steps=1, activation_checkpointing="all").validate()
