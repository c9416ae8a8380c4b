"""Training from the store on Ray Train + DeepSpeed: exact resume after SIGKILL, DeepSpeed
against the plain loop, resume refusals, corrupt shards. On the tiny target, CPU, fp32."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.schema import ConfigError
from storage.reader import StoreReader
from storage.store import StoreError
from tests.helpers import kill_run
from workflows import full
from workflows.core.config import compose
from workflows.train import stage as train_stage
from workflows.train.checkpoint import AVERAGE, TRAINING_WEIGHTS, latest_ray_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def overrides(tiny_target, run_dir, *extra) -> list[str]:
    return [
        "target=tiny",
        f"cache_dir={tiny_target.parent.parent}",
        f"run_dir={run_dir}",
        "mixture=bundled",
        "data.limit=16",
        "data.max_new_tokens=24",
        "data.heldout_fraction=0.25",
        "capture.shard_samples=4",
        "data.dtype=float32",
        "capture.dtype=float32",
        "train.capture_dtype=float32",
        "train.compute_dtype=float32",
        "train.optim.lr=3e-3",
        "cluster.dashboard=false",
        "train.packing=false",
        "train.batch_size=2",
        *extra,
    ]


@pytest.fixture(scope="module")
def captured(tiny_target, tmp_path_factory):
    """A run folder with the corpus, the store (3 train + 1 held-out shards) and the vocab.
    The store holds both families' layers (EAGLE-3's [0, 2, 4], DFlash's [1, 2, 3]): each
    training below reads its own."""
    run_dir = tmp_path_factory.mktemp("captured")
    full.run(
        compose(
            overrides(
                tiny_target, run_dir, "stages=[target,generate,capture,vocab]", "capture.families=[eagle3,dflash]"
            )
        )
    )
    return run_dir


def copy_run(captured: Path, dest: Path) -> Path:
    shutil.copytree(captured, dest, ignore=shutil.ignore_patterns("train", "multirun"))
    return dest


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock figures."""
    lines = (run_dir / "train" / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"} for line in lines if line.strip()]


def train_command(tiny_target, run_dir, *extra) -> list[str]:
    return [sys.executable, "-m", "workflows.train", *overrides(tiny_target, run_dir, *extra)]


def logged_steps(run_dir: Path) -> list[int]:
    file = run_dir / "train" / "metrics.jsonl"
    if not file.exists():
        return []
    return [json.loads(line)["step"] for line in file.read_text().splitlines() if line.strip()]


# The model evaluated and saved with train.ema_decay: the weights' moving average (its state,
# and the plain loop's raw weights, go with each checkpoint). The raw weights train exactly as
# without it, so these tests hold both; the plain last-weights runs are every other test's.
AVERAGING = pytest.mark.parametrize("averaging", [("train.ema_decay=0.9",)], ids=["average"])


@pytest.mark.slow
# EAGLE-3's exact resume on Ray Train, with and without the weights' average, is held by
# tests/test_stream.py's SIGKILL (the same Trainer, DeepSpeed files and checkpoints, its
# run averaging) and the elastic tests below: here the block family's random anchors.
@pytest.mark.parametrize(
    "averaging", [("draft=dflash", "draft.dflash.num_layers=2", "draft.dflash.num_anchors=8")], ids=["dflash"]
)
def test_sigkill_mid_epoch_then_resume_is_bit_exact(tiny_target, captured, tmp_path, averaging):
    """Two Ray Train workers; a real SIGKILL of the run's process group between two
    checkpoints; the rerun's steps (losses, grad norms, accuracies, held-out figures) and
    final weights equal an uninterrupted run's exactly, for the DFlash block draft (whose
    random anchors come from the same saved generator)."""
    args = (
        "train.steps=24",
        "train.checkpoint_every=8",
        "train.eval_every=8",
        "train.log_every=1",
        "train.num_workers=2",
        *averaging,
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # The uninterrupted reference runs beside the run to be killed (its own Ray), not before
    # it: the two start-ups overlap. Sharing the cores changes timings only, not the maths.
    reference = copy_run(captured, tmp_path / "reference")
    ref_log = open(tmp_path / "reference.log", "w")
    ref_proc = subprocess.Popen(
        train_command(tiny_target, reference, *args),
        cwd=ROOT,
        env=env,
        stdout=ref_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    killed = copy_run(captured, tmp_path / "killed")
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen(
        train_command(tiny_target, killed, *args),
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        try:
            # Past the step-8 checkpoint, and Ray has recorded it (its snapshot names it).
            while (
                not logged_steps(killed)
                or logged_steps(killed)[-1] < 11
                or latest_ray_checkpoint(killed / "train") is None
            ):
                assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
                time.sleep(0.05)
        finally:
            kill_run(proc)  # the driver, Ray and both workers, at once
        assert not (killed / "train" / "DONE.json").exists() and not (killed / "train" / "metrics.json").exists()
        assert logged_steps(killed)[-1] < 23  # killed mid-run, not after it
        kept = latest_ray_checkpoint(killed / "train")
        averaged = "train.ema_decay=0.9" in averaging
        assert (kept / AVERAGE).exists() == averaged and not (kept / TRAINING_WEIGHTS).exists()

        done = subprocess.run(
            train_command(tiny_target, killed, *args), cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "train: resuming from step 8" in done.stdout
        assert ref_proc.wait(timeout=600) == 0, (tmp_path / "reference.log").read_text()[-3000:]
    finally:
        if ref_proc.poll() is None:
            kill_run(ref_proc)
    got, want = records(killed), records(reference)
    assert [r["step"] for r in want] == list(range(24))
    assert got == want
    a = load_file(str(reference / "train" / "draft" / "draft.safetensors"))
    b = load_file(str(killed / "train" / "draft" / "draft.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@AVERAGING
def test_deepspeed_on_one_worker_matches_the_plain_loop(tiny_target, captured, tmp_path, averaging):
    """The same data and seed: Ray Train + DeepSpeed (one worker) steps like torch AdamW."""
    args = ("train.steps=6", "train.checkpoint_every=0", "train.eval_every=6", "train.log_every=1", *averaging)
    ray_run = copy_run(captured, tmp_path / "ray")
    plain = copy_run(captured, tmp_path / "plain")
    full.run(compose(overrides(tiny_target, ray_run, "stages=[train]", "train.num_workers=1", *args)))
    full.run(compose(overrides(tiny_target, plain, "stages=[train]", "train.backend=local", *args)))
    got, want = records(ray_run), records(plain)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(6))
    for g, w in zip(got, want):
        assert g["tokens"] == w["tokens"] and g["lr"] == w["lr"]
        torch.testing.assert_close(g["loss"], w["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g["grad_norm"], w["grad_norm"], rtol=1e-4, atol=1e-6)
    m_ray = json.loads((ray_run / "train" / "metrics.json").read_text())
    m_plain = json.loads((plain / "train" / "metrics.json").read_text())
    assert abs(m_ray["acceptance_walk"] - m_plain["acceptance_walk"]) < 1e-6
    a = load_file(str(ray_run / "train" / "draft" / "draft.safetensors"))
    b = load_file(str(plain / "train" / "draft" / "draft.safetensors"))
    for k in a:  # the saved drafts: the same weights, or the same average
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
    assert set(m_ray["step_acc_by_position"]) and set(m_ray["acceptance_walk_by_prompt_length"])


# Slow: a Ray start and two DeepSpeed workers (~30 s on 2 cores), the one run that checks the
# wiring of train.sequence_parallel (its maths are tests/test_sequence_parallel.py's).
@pytest.mark.slow
def test_sequence_parallel_on_two_ray_workers_trains_as_one_worker(tiny_target, captured, tmp_path):
    """train.num_workers=2 train.sequence_parallel=2 (one SP group of 2: each sample split
    over both workers, data rank 0 of 1) completes, and its steps' losses, accuracies and
    token counts equal the plain loop's on the same data within float32 tolerance."""
    args = ("stages=[train]", "train.steps=2", "train.checkpoint_every=0", "train.eval_every=2", "train.log_every=1")
    split = copy_run(captured, tmp_path / "split")
    plain = copy_run(captured, tmp_path / "plain")
    full.run(compose(overrides(tiny_target, split, *args, "train.num_workers=2", "train.sequence_parallel=2")))
    full.run(compose(overrides(tiny_target, plain, *args, "train.backend=local")))
    got, want = records(split), records(plain)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1]
    for g, w in zip(got, want):
        assert g["tokens"] == w["tokens"]
        for key in ("loss", "step_acc", "step_loss"):
            torch.testing.assert_close(g[key], w[key], rtol=1e-5, atol=1e-6, msg=key)
    assert (split / "train" / "draft" / "draft.safetensors").exists()


@pytest.mark.slow
@AVERAGING
def test_online_states_train_through_the_same_loop_and_resume_exactly(tiny_target, captured, tmp_path, averaging):
    """train.data_source=online: the states the target computes in this process go through
    the store's loop (cadence, records, held-out evaluation, metrics.json), and a run killed
    for real between two checkpoints resumes to the uninterrupted run's records exactly."""
    cadence = (
        "stages=[train]",
        "train.backend=local",
        "train.steps=40",
        "train.checkpoint_every=10",
        "train.eval_every=10",
        "train.log_every=1",
        *averaging,
    )
    store = copy_run(captured, tmp_path / "store")
    full.run(compose(overrides(tiny_target, store, *cadence, "train.data_source=store")))
    online = ("train.data_source=online", "capture.shard_samples=4", *cadence)
    # The reference and the killed run train in child processes of the same threads, so that
    # their kernels round alike.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reference = copy_run(captured, tmp_path / "reference")
    ran = subprocess.run(
        train_command(tiny_target, reference, *online), cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    m_store = json.loads((store / "train" / "metrics.json").read_text())
    m_online = json.loads((reference / "train" / "metrics.json").read_text())
    assert set(m_online) == set(m_store)
    assert m_online["eval_samples"] == m_store["eval_samples"] and m_online["stream"]["samples"] > 0
    for run in (store, reference):  # one cadence: evaluated at every checkpoint and at the end
        assert [r["step"] for r in records(run)] == list(range(40))
        assert [r["step"] for r in records(run) if "eval" in r] == [9, 19, 29, 39]

    killed = copy_run(captured, tmp_path / "killed")
    proc = subprocess.Popen(
        train_command(tiny_target, killed, *online),
        cwd=ROOT,
        env=env,
        stdout=open(tmp_path / "killed.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    loop_state = killed / "train" / "checkpoint" / "loop_rank0.json"
    try:
        while not loop_state.exists():
            assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
            time.sleep(0.02)
    finally:
        kill_run(proc)
    assert not (killed / "train" / "metrics.json").exists() and logged_steps(killed)[-1] < 39
    for kept in (AVERAGE, TRAINING_WEIGHTS):
        assert (killed / "train" / "checkpoint" / kept).exists() == bool(averaging), kept
    done = subprocess.run(
        train_command(tiny_target, killed, *online), cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "train: resuming from step 10" in done.stdout
    assert records(killed) == records(reference)
    a = load_file(str(reference / "train" / "draft" / "draft.safetensors"))
    b = load_file(str(killed / "train" / "draft" / "draft.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def ledger(run_dir: Path) -> dict[tuple[int, str], list[dict]]:
    """The store path's record of what trained (train/trained/rank<r>.jsonl), by (rank,
    worker process), in order."""
    runs: dict[tuple[int, str], list[dict]] = {}
    for file in sorted((run_dir / "train" / "trained").glob("rank*.jsonl")):
        rank = int(file.stem.removeprefix("rank"))
        for line in file.read_text().splitlines():
            r = json.loads(line)
            runs.setdefault((rank, r["worker"]), []).append(r)
    return runs


def assert_each_sample_once_per_epoch(run_dir: Path, before: dict, positions: list[dict]) -> None:
    """What trained: each old rank's batches (`before`, its ledger when it stopped) up to the
    position of the checkpoint the run went on from, then the new workers' batches: every
    train sample once in each complete epoch, none twice in the last."""
    trained: dict[int, list[str]] = {}
    for (rank, _), lines in before.items():
        p = positions[rank]
        for r in lines:
            if (r["epoch"], r["batch"]) <= (p["epoch"], p["batches"]):
                trained.setdefault(r["epoch"], []).extend(r["ids"])
    after = ledger(run_dir)
    assert set(before) < set(after), "no worker of the resumed run trained"
    for key in set(after) - set(before):
        for r in after[key]:
            trained.setdefault(r["epoch"], []).extend(r["ids"])
    index = StoreReader(str(run_dir / "store")).index
    train_ids = sorted(sid for sid, (shard, _) in index.items() if shard.startswith("train-"))
    last = max(trained)
    assert last >= 2
    for epoch in range(last):  # the complete epochs: each train sample once
        assert sorted(trained[epoch]) == train_ids, epoch
    assert len(set(trained[last])) == len(trained[last]) and set(trained[last]) <= set(train_ids)


ELASTIC = ("train.steps=24", "train.checkpoint_every=8", "train.eval_every=8", "train.log_every=1")


@pytest.mark.slow
def test_a_one_worker_checkpoint_resumes_on_two_each_sample_once_per_epoch(tiny_target, captured, tmp_path):
    """Elastic resume (workflows.train.elastic): 1 Ray Train worker SIGKILLed past its step-8
    checkpoint, rerun on 2 workers to the end. The ZeRO-1 optimizer state comes back from its
    consolidated copy, and every train sample trains once in each epoch. Not bit-exact
    against the uninterrupted 1-worker run: from step 8 a step averages 2 workers' batches,
    so the steps see other samples; the held-out acceptance agrees within 10%."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def start(run_dir: Path, workers: int) -> subprocess.Popen:
        out = open(tmp_path / f"{run_dir.name}.log", "a")
        command = train_command(tiny_target, run_dir, *ELASTIC, f"train.num_workers={workers}")
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def text(run_dir: Path) -> str:
        return (tmp_path / f"{run_dir.name}.log").read_text()

    reference, run = copy_run(captured, tmp_path / "reference"), copy_run(captured, tmp_path / "run")
    ref_proc, proc = start(reference, 1), start(run, 1)  # side by side: the start-ups overlap
    try:
        try:
            while not logged_steps(run) or logged_steps(run)[-1] < 9 or latest_ray_checkpoint(run / "train") is None:
                assert proc.poll() is None, text(run)[-3000:]
                time.sleep(0.05)
        finally:
            kill_run(proc)
        kept = latest_ray_checkpoint(run / "train")
        assert (kept / "optimizer_full.safetensors").exists()
        positions = [json.loads((kept / "loop_rank0.json").read_text())["position"]]
        before = ledger(run)
        resumed = start(run, 2)
        assert resumed.wait(timeout=600) == 0, text(run)[-3000:]
        assert "on 2 worker(s) from a checkpoint of 1" in text(run)
        assert ref_proc.wait(timeout=600) == 0, text(reference)[-3000:]
    finally:
        for p in (ref_proc, proc):
            if p.poll() is None:
                kill_run(p)
    assert_each_sample_once_per_epoch(run, before, positions)
    got, want = records(run), records(reference)
    assert [r["step"] for r in got] == list(range(24)) and got[:8] == want[:8]  # equal up to the checkpoint
    m_got = json.loads((run / "train" / "metrics.json").read_text())
    m_want = json.loads((reference / "train" / "metrics.json").read_text())
    assert m_got["acceptance_walk"] == pytest.approx(m_want["acceptance_walk"], rel=0.1), (m_got, m_want)


@pytest.mark.slow
def test_a_lost_node_shrinks_an_elastic_group_and_training_goes_on(tiny_target, captured, tmp_path):
    """train.min_workers=1 of 2, a Ray of two nodes (tests.elastic_cluster) that loses one
    past the step-8 checkpoint: Ray Train restarts the group on the one worker left, which
    resumes from that checkpoint, says so in one line, and trains to the end, each train
    sample once per epoch."""
    run = copy_run(captured, tmp_path / "run")
    record = tmp_path / "record.json"
    command = [
        sys.executable,
        "-m",
        "tests.elastic_cluster",
        str(record),
        *overrides(tiny_target, run, "stages=[train]", *ELASTIC),
        "train.num_workers=2",
        "train.min_workers=1",
        "train.max_failures=1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "10"  # tests.elastic_cluster says why
    out = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert proc.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            kill_run(proc)
    text = (tmp_path / "run.log").read_text()
    lost = json.loads(record.read_text())
    assert "train: Ray Train, 1-2 (elastic) worker(s)" in text
    assert "train: resuming at step 8 on 1 worker(s) from a checkpoint of 2" in text, text[-4000:]
    assert [r["step"] for r in records(run)] == list(range(24))
    # The first group: rank 1, and rank 0's first worker (the restart's lines come after its own)
    first = json.loads((run / "train" / "trained" / "rank0.jsonl").read_text().splitlines()[0])["worker"]
    before = {key: lines for key, lines in ledger(run).items() if key[0] == 1 or key[1] == first}
    assert_each_sample_once_per_epoch(run, before, lost["positions"])


def test_a_resume_with_changed_settings_is_refused_naming_them(tiny_target, captured, tmp_path):
    run_dir = copy_run(captured, tmp_path / "run")
    base = ("stages=[train]", "train.backend=local", "train.eval_every=2", "train.log_every=2")
    full.run(compose(overrides(tiny_target, run_dir, *base, "train.steps=2")))
    checkpoint = run_dir / "train" / "checkpoint"
    assert json.loads((checkpoint / "loop_rank0.json").read_text())["step"] == 2
    with pytest.raises(ConfigError, match=r"steps: 2 -> 4"):
        full.run(compose(overrides(tiny_target, run_dir, *base, "train.steps=4")))
    with pytest.raises(ConfigError, match=r"ttt: .*'length': 7.* -> .*'length': 3"):
        full.run(
            compose(
                overrides(tiny_target, run_dir, *base, "train.steps=2", "train.ttt.length=3", "train.acceptance_k=3")
            )
        )
    with pytest.raises(ConfigError, match=r"ema_decay: 0.0 -> 0.9"):
        full.run(compose(overrides(tiny_target, run_dir, *base, "train.steps=2", "train.ema_decay=0.9")))
    # Starting afresh is explicit; a warm start takes weights only.
    full.run(compose(overrides(tiny_target, run_dir, *base, "train.steps=4", "train.resume=false")))
    assert json.loads((checkpoint / "loop_rank0.json").read_text())["step"] == 4
    warm = copy_run(captured, tmp_path / "warm")
    full.run(
        compose(overrides(tiny_target, warm, *base, "train.steps=2", f"train.init_from={run_dir / 'train' / 'draft'}"))
    )
    first_warm, first_cold = records(warm)[0], records(run_dir)[0]
    assert first_warm["loss"] < first_cold["loss"]  # it starts from the trained weights
    with pytest.raises(ConfigError, match=r"objective: .*'kind': 'soft_ce'.* -> .*'kind': 'kl_acceptance'"):
        full.run(compose(overrides(tiny_target, run_dir, *base, "train.steps=4", "train.objective.kind=kl_acceptance")))
    # Another objective and fc_norm train through the same loop; the acceptance rate is tracked.
    other = copy_run(captured, tmp_path / "other")
    full.run(
        compose(
            overrides(
                tiny_target, other, *base, "train.steps=2", "train.objective.kind=kl_acceptance", "draft.fc_norm=true"
            )
        )
    )
    alpha = json.loads((other / "train" / "metrics.json").read_text())["step_alpha"]
    assert len(alpha) == 7 and all(0 < a < 1 for a in alpha) and len(records(other)[-1]["step_alpha"]) == 7
    assert "fc_norm.2.weight" in load_file(str(other / "train" / "draft" / "draft.safetensors"))


def test_a_corrupt_shard_is_named_or_skipped_and_counted(tiny_target, captured, tmp_path):
    run_dir = copy_run(captured, tmp_path / "run")
    from storage.reader import StoreReader

    victim = StoreReader(str(run_dir / "store")).shard_names("train")[1]
    shutil.rmtree(run_dir / "store" / "shards" / victim / "aux")
    base = ("stages=[train]", "train.backend=local", "train.steps=2", "train.eval_every=2")
    with pytest.raises(StoreError, match=victim):
        full.run(compose(overrides(tiny_target, run_dir, *base)))
    full.run(compose(overrides(tiny_target, run_dir, *base, "train.on_corrupt_shard=skip")))
    metrics = json.loads((run_dir / "train" / "metrics.json").read_text())
    assert list(metrics["skipped_shards"]) == [victim]


def test_training_refuses_a_store_of_other_settings(tiny_target, captured, tmp_path):
    run_dir = copy_run(captured, tmp_path / "run")
    cfg = compose(
        overrides(
            tiny_target, run_dir, "stages=[train]", "train.backend=local", "train.steps=2", "target.hidden_size=96"
        )
    )
    with pytest.raises(Exception, match="hidden_size"):
        train_stage.run(cfg, tiny_target)
    # A draft reading a layer the store never captured: refused by name, before any worker starts.
    lacking = compose(
        overrides(
            tiny_target,
            run_dir,
            "stages=[train]",
            "train.backend=local",
            "train.steps=2",
            "draft=dflash",
            "draft.dflash.target_layer_ids=[3,5]",
        )
    )
    with pytest.raises(
        StoreError, match=r"holds capture ids \[0, 1, 2, 3, 4\], the draft reads \[3, 5\]: \[5\] are not"
    ):
        train_stage.run(lacking, tiny_target)


@pytest.mark.gpu
def test_the_trainer_runs_on_the_device_it_is_given(tiny_target, captured, tmp_path, device):
    """The plain trainer on CUDA where there is one (else the CPU): store batches, the target
    head, the noise generator and the evaluation all follow `train.device`."""
    runs = {}
    for name in ("cpu", device.type):
        run_dir = copy_run(captured, tmp_path / f"run-{name}-{len(runs)}")
        full.run(
            compose(
                overrides(
                    tiny_target,
                    run_dir,
                    "stages=[train]",
                    "train.backend=local",
                    "train.steps=3",
                    "train.eval_every=3",
                    "train.log_every=1",
                    f"train.device={name}",
                )
            )
        )
        runs[len(runs)] = (records(run_dir), json.loads((run_dir / "train" / "metrics.json").read_text()))
    (cpu_records, cpu_final), (dev_records, dev_final) = runs[0], runs[1]
    assert [r["tokens"] for r in dev_records] == [r["tokens"] for r in cpu_records]
    for a, b in zip(dev_records, cpu_records):  # fp32 on both; kernels differ by rounding only
        torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-4, atol=1e-5)
    assert dev_final["walk_passes"] == cpu_final["walk_passes"] or device.type == "cuda"


def test_a_resumed_run_keeps_its_wandb_run_id(tmp_path, monkeypatch):
    from workflows.train.tracking import wandb_run_id

    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    first = wandb_run_id(tmp_path, resume_step=0)
    assert wandb_run_id(tmp_path, resume_step=8) == first  # a resume continues the same W&B run
    assert wandb_run_id(tmp_path, resume_step=0) != first  # a fresh start is a new run
    monkeypatch.setenv("WANDB_RUN_ID", "trial7")  # a sweep agent names its trial's run
    assert wandb_run_id(tmp_path, resume_step=0) == "trial7" == wandb_run_id(tmp_path, resume_step=8)


def test_the_target_head_and_embeddings_are_read_alone_and_equal_the_models(tiny_target, tmp_path):
    from transformers import AutoModelForCausalLM

    from eagle3.target_head import TargetHead
    from workflows.core.target_weights import TargetWeightsError, read_embeddings, read_target_head

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    assert torch.equal(read_embeddings(tiny_target).float(), model.get_input_embeddings().weight)
    final = torch.randn(2, 5, model.config.hidden_size)
    ids = torch.arange(0, model.config.vocab_size, 4)
    for normed in (True, False):  # pre-norm states go through the target's own final norm
        want = TargetHead.from_hf(model, final_is_normed=normed)(final, ids)
        got = read_target_head(tiny_target, final_is_normed=normed).float()(final, ids)
        torch.testing.assert_close(got[0], want[0])
        assert torch.equal(got[1], want[1])
    empty = tmp_path / "no_weights"
    empty.mkdir()
    with pytest.raises(TargetWeightsError, match="no model.safetensors"):
        read_embeddings(empty)


def test_quality_ablation_bench_runs_its_grid_on_a_validation_split(tiny_target, captured, tmp_path, capsys):
    """bench.bench_quality end to end on the tiny store: two settings walked every step with
    an early stop, each scored with its best walk's weights; only the finalists decoded,
    chain and tree, lossless; the table written; a rerun trains nothing it kept; never
    reading the held-out shards."""
    from bench import bench_quality

    run_dir = copy_run(captured, tmp_path / "run")
    out = tmp_path / "ablation"
    args = [
        "--overrides",
        *overrides(tiny_target, run_dir, "evaluate.num_steps=3"),
        "--only",
        "base",
        "fc_norm",
        "--steps",
        "6",
        "--seeds",
        "0",
        "--validation-fraction",
        "0.3",
        "--eval-every",
        "1",
        "--patience",
        "2",
        "--decode-prompts",
        "2",
        "--decode-tokens",
        "6",
    ]
    bench_quality.main([*args, "--finalists", "0", "--out", str(out)])
    result = json.loads(out.with_suffix(".json").read_text())
    assert [r["name"] for r in result["table"]] == ["base", "fc_norm"]
    assert result["meta"]["finalists"] == ["base"]  # the baseline always, then the 0 best others
    base, fc_norm = result["table"]
    assert base["lossless"] and 1 <= base["decoded_chain"][0] <= 4 and 1 <= base["decoded_tree"][0] <= 6
    assert fc_norm["decoded_chain"] is None and fc_norm["decoded_tree"] is None
    for row in result["table"]:
        assert len(row["step_acc"]) == 3 and row["train_tokens_per_s"][0] > 1
    for trial in result["trials"]:
        steps, walks, alpha0 = zip(*trial["curve"])
        assert list(steps) == list(range(1, trial["steps_done"] + 1))  # walked every step
        # Early stop: two walks with no new best end the trial (or it ran its 6 steps).
        assert trial["steps_done"] == 6 or trial["steps_done"] - trial["best_step"] == 2, trial
        # Scored with the best walk's weights (restored where a later step was worse).
        best = walks.index(max(walks))
        assert trial["best_step"] == steps[best]
        assert trial["acceptance_walk"] == walks[best] and trial["step_alpha"][0] == alpha0[best], trial
    # This store's walks tie early: the stop and the restore both happen (not only the end).
    assert any(t["steps_done"] < 6 and t["curve"][-1][2] != t["step_alpha"][0] for t in result["trials"])
    from storage.reader import StoreReader

    reader = StoreReader(str(run_dir / "store"))
    train = {i for i, (shard, _) in reader.index.items() if shard in reader.shard_names("train")}
    meta = result["meta"]
    assert meta["val"] >= 1 and meta["fit"] + meta["val"] == len(train) < len(reader.index)  # never the held-out
    assert "| fc_norm | - | - |" in out.with_suffix(".md").read_text()

    # A rerun with one more finalist trains nothing: it decodes fc_norm's kept weights.
    weights = sorted((out.parent / "trials").glob("*.safetensors"))
    stamps = [w.stat().st_mtime_ns for w in weights]
    capsys.readouterr()
    bench_quality.main([*args, "--finalists", "1", "--out", str(out)])
    assert "0 to train (2 reused" in capsys.readouterr().out
    assert [w.stat().st_mtime_ns for w in weights] == stamps
    again = json.loads(out.with_suffix(".json").read_text())
    assert again["meta"]["finalists"] == ["base", "fc_norm"]
    assert again["table"][0] == base  # reused as it was, decoded figures included
    assert again["table"][1]["lossless"] and 1 <= again["table"][1]["decoded_chain"][0] <= 4
    assert again["table"][1]["acceptance_walk"] == fc_norm["acceptance_walk"]


def test_a_killed_quality_bench_takes_its_pool_workers_with_it(tiny_target, captured, tmp_path):
    """SIGKILL of the bench's own process (as `pkill -f bench.bench_quality` does: the
    spawned workers' command lines do not name the bench) ends its pool workers too, and
    each trial has written its walks so far."""
    run_dir = copy_run(captured, tmp_path / "run")
    cmd = [sys.executable, "-m", "bench.bench_quality", "--overrides", *overrides(tiny_target, run_dir)]
    cmd += ["--only", "base", "--steps", "100000", "--seeds", "0", "1", "--validation-fraction", "0.3"]
    cmd += ["--eval-every", "1", "--patience", "0", "--decode-prompts", "0", "--jobs", "2"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    trials = run_dir / "ablation" / "trials"
    try:
        deadline = time.monotonic() + 300
        while len(list(trials.glob("*.partial.json"))) < 2:  # both trials have walked
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.5)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        workers = [c for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
        assert len(workers) == 2, children
        os.kill(proc.pid, signal.SIGKILL)  # the parent only
        proc.wait()
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{w}").exists() for w in workers):
            assert time.monotonic() < deadline, f"pool workers {workers} outlived the killed bench"
            time.sleep(0.2)
    finally:
        kill_run(proc)
    for partial in trials.glob("*.partial.json"):
        curve = json.loads(partial.read_text())["curve"]
        assert [c[0] for c in curve] == list(range(1, len(curve) + 1)), curve  # every step, in order
    assert not list(trials.glob("*-????????????.json"))  # no trial marked done


def test_a_killed_quality_trial_resumes_from_its_last_walk_exactly(tiny_target, captured, tmp_path, capsys):
    """A trial SIGKILLed mid-run goes on from its last walk when the bench is rerun (weights,
    optimizer, noise generator, walks and the best walk's weights), and ends with the
    figures and weights of a trial never interrupted."""
    from bench import bench_quality

    run_dir = copy_run(captured, tmp_path / "run")
    args = ["--overrides", *overrides(tiny_target, run_dir), "--only", "base", "--steps", "40", "--seeds", "0"]
    args += ["--validation-fraction", "0.3", "--eval-every", "2", "--patience", "0", "--decode-prompts", "0"]
    args += ["--threads", "1"]  # one trial runs in the bench's process: with every core unless told
    killed, whole = tmp_path / "killed" / "ablation", tmp_path / "whole" / "ablation"
    cmd = [sys.executable, "-m", "bench.bench_quality", *args, "--out", str(killed)]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    partial = killed.parent / "trials"
    try:
        deadline = time.monotonic() + 300
        while not any(len(json.loads(p.read_text())["curve"]) >= 3 for p in partial.glob("*.partial.json")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.1)
    finally:
        kill_run(proc)
    (resumable,) = partial.glob("*.resume.pt")
    assert not list(partial.glob("*-????????????.json"))  # killed before its end
    capsys.readouterr()
    bench_quality.main([*args, "--out", str(killed)])
    resumed_at = int(capsys.readouterr().out.split("resumed at step ")[1].split()[0])
    assert 6 <= resumed_at < 40 and resumed_at % 2 == 0
    assert not resumable.exists()  # the finished trial drops its resume state
    bench_quality.main([*args, "--out", str(whole)])
    a, b = (json.loads(d.with_suffix(".json").read_text())["trials"][0] for d in (killed, whole))
    assert a.pop("train_tokens_per_s") > 1 and b.pop("train_tokens_per_s") > 1
    assert a == b and len(a["curve"]) == 20  # walks, best step, per-step figures: all equal
    assert a["threads"] == 1
    (wa,), (wb,) = (list((d.parent / "trials").glob("*.safetensors")) for d in (killed, whole))
    ta, tb = load_file(str(wa)), load_file(str(wb))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_the_validation_split_is_drawn_independently_of_the_heldout_split():
    """The train samples are those whose id hashes above data.heldout_fraction; the
    validation split must still take its own share of them (an unsalted hash took none
    below that fraction)."""
    from bench.bench_quality import is_validation
    from workflows.generate.ingest import split_of

    train = [i for i in (f"bundled:default-{k:04d}" for k in range(4000)) if split_of(i, 0.15) == "train"]
    for fraction in (0.1, 0.2):
        share = sum(is_validation(i, fraction) for i in train) / len(train)
        assert abs(share - fraction) < 0.02, (fraction, share)
