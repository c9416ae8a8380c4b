"""bench.gpu_suite, the GPU proof, rehearsed on the CPU at tiny shapes so that it cannot rot
before a GPU is lent: every section runs and gives figures that mean something."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagle3.training import fused_adamw

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_suite_dry_run_passes_every_section(tmp_path):
    out = tmp_path / "gpu_suite.json"
    # With only the lent machine's imports and the carried wheels (tests/lent_machine): the
    # first H200 run lost its capture section to a zarr that no wheel carried.
    lent = os.pathsep.join(p for p in (str(ROOT / "tests" / "lent_machine"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "DS_ACCELERATOR": "cpu", "PYTHONPATH": lent}
    # A second length that the time budget (0 s) skips once the first is done.
    cmd = ["--dry-run", "--seqs", "64", "80", "--budget-s", "0", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_suite", *cmd],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    r = json.loads(out.read_text())
    assert [k for k in r if k != "environment"] == [
        "gpu_tests",
        "deepspeed",
        "capture",
        "decoder",
        "dflash_step",
        "train_step",
    ]
    assert all(r[k]["ok"] for k in r), r
    # flex x2 and flex memory (test_attention_scale), four of store batches on the device
    # (test_device_batches), the block draft's training on the device (test_dflash): the dry
    # run collects them (this suite runs them itself).
    assert r["gpu_tests"]["summary"].startswith("8/") and "tests collected" in r["gpu_tests"]["summary"], r["gpu_tests"]
    row, skipped = r["train_step"]["rows"]
    assert skipped["seq"] == 80 and skipped["skipped"].startswith("budget: "), skipped
    # Every variant of our step ran (a failing one leaves its error instead of its figures).
    for name in ("ours", "blocks", "lean", "compiled", "specforge"):
        assert isinstance(row.get(f"{name}_tokens_per_s"), float), (name, row.get(name))
        assert isinstance(row[f"{name}_wall_s"], float), name  # with warm-up: where a lent window goes
    assert row["specforge_backend"] == "sdpa" and r["train_step"]["loss_block_rows"] == 16
    assert row["speedup"] == pytest.approx(row["ours_tokens_per_s"] / row["specforge_tokens_per_s"])
    # Each finished sequence length is on disk at once: a run cut by the time limit keeps it.
    assert json.loads((tmp_path / "gpu_suite.train_step.partial.json").read_text())[0]["seq"] == row["seq"]
    losses = r["deepspeed"]["losses"]
    assert losses["deepspeed"] == pytest.approx(losses["plain"], rel=1e-4)  # fp32 on the CPU
    assert losses["plain"][-1] < losses["plain"][0]  # the steps trained
    # Where capture's time goes (the question the first H200 run left, at ratio 0.30).
    assert all(isinstance(r["capture"][k], float) for k in ("compute_over_bare", "write_over_bare")), r["capture"]
    assert 0 < r["capture"]["ratio"] <= 1.5 and r["capture"]["tokens"] == sum(48 - (i % 7) * 3 for i in range(8))
    assert r["decoder"]["identical_to_greedy"] == "4/4"
    # The block draft's step and SpecForge's own DFlash step, each with its figures.
    (blocks,) = r["dflash_step"]["rows"]
    assert blocks["seq"] == 64 and r["dflash_step"]["shapes"]["block_size"] == 4
    for name in ("ours", "specforge"):
        assert isinstance(blocks.get(f"{name}_tokens_per_s"), float), (name, blocks.get(name))
    assert blocks["speedup"] == pytest.approx(blocks["ours_tokens_per_s"] / blocks["specforge_tokens_per_s"])
    assert "DFlash block draft, 2 layers, blocks of 4, 8 anchors" in done.stdout
    assert "| seq | step | tokens/s |" in done.stdout and "| 80 | skipped | budget: " in done.stdout


def test_the_suite_asks_for_the_wheels_it_needs(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_suite", "--wheels", str(tmp_path), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "no wheel; run `make gpu-wheels` here first" in done.stderr


def test_adamw_is_fused_where_the_draft_is_on_a_gpu():
    on = lambda kind: SimpleNamespace(device=torch.device(kind))  # noqa: E731 (no GPU needed to name one)
    assert fused_adamw([on("cuda"), on("cuda")]) is True
    assert fused_adamw([on("cuda"), on("cpu")]) is False and fused_adamw([on("cpu")]) is False
    assert fused_adamw([]) is False
