"""bench.specforge_dflash_step: SpecForge's own offline DFlash training step, built from its wheel's classes at
tiny shapes on the CPU, trains (one real optimizer step per call), is fed what SpecForge's offline DFlash loader
hands over, and imports SpecForge's DFlash modules without SGLang, Ray or DeepSpeed."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.specforge_dflash_step import TINY, _batch_from_raw, _raw_sample, build_specforge_dflash_step

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def step():
    # total_steps=3: SpecForge's cosine schedule with no warmup step, so every step moves the weights.
    return build_specforge_dflash_step(**TINY, device="cpu", dtype="float32", total_steps=3)


def test_each_call_is_one_specforge_dflash_train_step_that_moves_the_draft(step):
    model = step.model
    assert type(model).__name__ == "OnlineDFlashModel"
    assert type(model).__module__ == "specforge.algorithms.common.dflash_family_model"
    assert type(model.draft_model).__module__ == "specforge.modeling.draft.dflash"
    assert len(model.draft_model.layers) == TINY["num_layers"] and model.block_size == TINY["block_size"]
    assert model.num_anchors == TINY["num_anchors"] and len(step.target_layer_ids) == TINY["num_target_layers"]
    # SpecForge's DFlash shares the target's (frozen) lm_head over the full vocabulary: no draft vocabulary.
    assert step.head == "target" and step.head_vocab == TINY["vocab"]
    assert model.lm_head.weight.shape == (TINY["vocab"], TINY["hidden"]) and not model.lm_head.weight.requires_grad
    draft_before = {n: p.detach().clone() for n, p in model.draft_model.named_parameters()}
    target_before = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("draft_model.")}
    assert target_before and all(not p.requires_grad for n, p in model.named_parameters() if n in target_before)

    losses = []
    for _ in range(3):
        # The same anchors every call (SpecForge draws them from torch's RNG): only the weights differ between calls.
        torch.manual_seed(1234)
        losses.append(step())
        result = step.last_result
        assert result.optimizer_stepped and math.isfinite(result.grad_norm) and result.grad_norm > 0
    assert all(math.isfinite(x) for x in losses), losses
    assert 5.0 < losses[0] < 8.0, losses  # about ln(512) for a random draft
    # Each call stepped the optimizer: on the same blocks the loss goes strictly down.
    assert losses[0] > losses[1] > losses[2], losses

    moved = [n for n, p in model.draft_model.named_parameters() if not torch.equal(p, draft_before[n])]
    assert {n.split(".")[0] for n in moved} >= {"layers", "fc", "norm", "hidden_norm"}, moved
    assert all(torch.equal(p, target_before[n]) for n, p in model.named_parameters() if n in target_before)


def test_step_reports_its_cpu_stand_ins_and_the_specforge_dflash_modules(step):
    assert step.backend == "sdpa" and step.loss_impl == "cross_entropy" and step.kernels == "qwen3"
    assert step.wrapper == "none" and step.device == "cpu" and step.specforge_version
    assert step.loss_decay_gamma == 7.0 and step.model.loss_decay_gamma == 7.0
    assert step.mask_token_id == TINY["vocab"] - 1 == step.model.draft_model.mask_token_id
    assert set(step.dflash_modules) <= set(step.specforge_modules), step.specforge_modules
    for name in ("specforge.training.strategies.base", "specforge.training.controller", "specforge.optimizer"):
        assert name in step.specforge_modules


def test_the_batch_is_what_specforges_offline_dflash_loader_hands_over(step, tmp_path):
    """A stored sample read back by SpecForge's own reader, store and loader gives the step's batch layout."""
    from specforge.algorithms.common.dflash_family_data import (
        build_collator,
        build_offline_normalizer,
        build_offline_reader,
    )
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    seq, width = TINY["seq"], TINY["num_target_layers"] * TINY["hidden"]
    raw = _raw_sample(vocab=TINY["vocab"], width=width, seq=seq, dtype=torch.float32, gen=torch.Generator())
    torch.save(raw, tmp_path / "data_0.ckpt")
    refs = build_offline_reader("dflash", str(tmp_path), run_id="t", ttt_length=7, max_len=seq).read()
    loader = FeatureDataLoader(
        LocalFeatureStore(),
        refs=refs,
        collate_fn=build_collator(),
        per_sample_transform=build_offline_normalizer(seq),
        strategy="dflash",
    )
    theirs = next(iter(loader))
    from bench.specforge_dflash_step import load_specforge_dflash

    ours = _batch_from_raw(load_specforge_dflash(), raw, seq=seq, device="cpu")
    assert ours.strategy == theirs.strategy == "dflash"
    assert ours.metadata["target_repr"] is theirs.metadata["target_repr"] is None
    assert sorted(ours.tensors) == sorted(theirs.tensors) == ["hidden_states", "input_ids", "loss_mask"]
    for name, tensor in theirs.tensors.items():
        assert torch.equal(ours.tensors[name], tensor), name
    # and the step's own batch has that layout
    assert {k: (tuple(v.shape), v.dtype) for k, v in step.batch.tensors.items()} == {
        k: (tuple(v.shape), v.dtype) for k, v in theirs.tensors.items()
    }


def test_it_refuses_what_specforges_dflash_cannot_build():
    with pytest.raises(ValueError, match="target's width"):
        build_specforge_dflash_step(**{**TINY, "target_hidden": 2 * TINY["hidden"]}, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="flex_attention has no CPU backward"):
        build_specforge_dflash_step(**TINY, device="cpu", dtype="float32", attention="flex_attention")


def test_the_smoke_runs_in_a_fresh_process_without_heavy_packages():
    """`python -m bench.specforge_dflash_step --tiny`: what a fresh process imports (this one may hold more)."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.specforge_dflash_step", "--tiny"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "device=cpu backend=sdpa loss=cross_entropy kernels=qwen3 wrapper=none head=target (vocab 512)" in out, out
    losses = [float(x) for x in re.findall(r"^step \d: loss (\S+)", out, re.M)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), out
    modules = re.search(r"^specforge modules: (.*)$", out, re.M).group(1).split()
    for name in ("specforge.algorithms.common.dflash_family_model", "specforge.modeling.draft.dflash"):
        assert name in modules, modules
    assert "heavy packages imported: none" in out, out
