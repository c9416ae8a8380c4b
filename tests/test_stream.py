"""train.data_source=stream: engine actors compute the states while Ray Train trains.

On the tiny target, CPU, float32, 2 engine actors and 2 training workers. One module
fixture runs, side by side, an uninterrupted streaming run (teeing its shards into a
store) and a streaming run that is SIGKILLed between two checkpoints and rerun; then the
store the first run teed is completed by the capture stage and trained from. The tests
hold: streaming = the store path exactly (records and weights), the budget, the resume,
and each sample of an epoch trained exactly once (by sample id).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import corpus_overrides, corpus_rows, kill_run
from workflows import full
from workflows.core.config import compose
from workflows.train.checkpoint import latest_ray_checkpoint

ROOT = Path(__file__).resolve().parents[1]
# bytes: 2 pipelines x 6 shards of the tiny target's ~85 kB (the least the budget check
# allows, workflows.train.streaming.data_limit), so that the engines run only a few shards ahead
BUDGET = 1_100_000
TRAIN = (
    "stages=[train]",
    "train.steps=24",
    "train.checkpoint_every=8",
    "train.eval_every=8",
    "train.log_every=1",
    "train.num_workers=2",
    "capture.actors=2",
    "train.max_seq_len=42",  # some samples are longer: truncated and counted, as on the store path
    f"train.stream_budget_bytes={BUDGET}",
    # The weights' moving average too: its state resumes bit for bit with the rest (the store
    # path's exact resume of it is held here, tests/test_train_scale.py holds DFlash's)
    "train.ema_decay=0.9",
)


def overrides(tiny_target, run_dir, *extra) -> list[str]:
    """The `corpus` fixture's settings (tests.helpers.corpus_overrides), on a Ray of its own size."""
    return [
        *corpus_overrides(tiny_target, run_dir),
        "train.compute_dtype=float32",
        "train.optim.lr=3e-3",
        "train.packing=false",
        "train.batch_size=2",
        *extra,
    ]


def start(tiny_target, run_dir: Path, *extra) -> subprocess.Popen:
    command = [sys.executable, "-m", "workflows.train", *overrides(tiny_target, run_dir, *extra)]
    log = open(run_dir.parent / f"{run_dir.name}.log", "a")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finished(proc: subprocess.Popen, run_dir: Path) -> None:
    assert proc.wait(timeout=600) == 0, (run_dir.parent / f"{run_dir.name}.log").read_text()[-4000:]


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "train" / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"} for line in lines if line.strip()]


def logged_steps(run_dir: Path) -> list[int]:
    file = run_dir / "train" / "metrics.jsonl"
    lines = file.read_text().splitlines() if file.exists() else []
    return [json.loads(line)["step"] for line in lines if line.strip()]


def weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "train" / "draft" / "draft.safetensors"))


def trained_by_epoch(run_dir: Path) -> dict[int, list[str]]:
    """Every rank's record of what it trained: the last line of each (rank, epoch, batch)."""
    last = {}
    for file in sorted((run_dir / "train" / "stream").glob("rank*.jsonl")):
        for line in file.read_text().splitlines():
            r = json.loads(line)
            last[(file.name, r["epoch"], r["batch"])] = r["ids"]
    epochs = defaultdict(list)
    for (_, epoch, _), ids in last.items():
        epochs[epoch] += ids
    return dict(epochs)


def kill_an_engine(run_dir: Path, proc: subprocess.Popen, base: Path) -> str:
    """SIGKILL rank 0's engine actor (a process of the run `proc` started) once the rerun has
    trained a batch from it: mid-stream, with shards still to compute (the budget keeps it
    a few shards ahead). Returns its name, host:pid."""
    ledger = run_dir / "train" / "stream" / "rank0.jsonl"
    seen = len(ledger.read_text().splitlines())
    while len(lines := ledger.read_text().splitlines()) <= seen or not lines[-1].endswith("}"):
        assert proc.poll() is None, (base / f"{run_dir.name}.log").read_text()[-4000:]
        time.sleep(0.02)
    engine = json.loads(lines[-1])["engines"][0]
    os.kill(int(engine.rsplit(":", 1)[1]), signal.SIGKILL)
    return engine


def kill_a_trainer(run_dir: Path, proc: subprocess.Popen, base: Path, after_step: int) -> str:
    """SIGKILL rank 1's training worker once a checkpoint later than `after_step` is in, and
    wait for the run to fail. Returns the error line the run ended with."""
    while (latest := latest_ray_checkpoint(run_dir / "train")) is None or checkpoint_step(latest) <= after_step:
        assert proc.poll() is None, (base / f"{run_dir.name}.log").read_text()[-4000:]
        time.sleep(0.02)
    worker = json.loads((run_dir / "train" / "stream" / "rank1.jsonl").read_text().splitlines()[-1])["worker"]
    os.kill(int(worker.rsplit(":", 1)[1]), signal.SIGKILL)
    assert proc.wait(timeout=300) != 0, "the run went on without its worker"
    kill_run(proc)  # what is left of its session (the engines, Ray)
    return [line for line in (base / f"{run_dir.name}.log").read_text().splitlines() if line.startswith("error:")][-1]


def checkpoint_step(folder: Path) -> int:
    return json.loads((folder / "loop_rank0.json").read_text())["step"]


def add_an_empty_sample(run_dir: Path) -> None:
    """A train row with no tokens in the corpus's first file (a conversation that rendered to
    nothing): both paths must count it as skipped, the same way."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    file = sorted((run_dir / "generate" / "shards").glob("*.parquet"))[0]
    table = pq.read_table(file)
    row = {**table.slice(0, 1).to_pylist()[0], "id": "empty-0", "split": "train", "input_ids": [], "loss_mask": []}
    pq.write_table(pa.concat_tables([table, pa.Table.from_pylist([row], schema=table.schema)]), file)


@pytest.fixture(scope="module")
def runs(tiny_target, corpus, tmp_path_factory):
    """(uninterrupted, killed and resumed, from the teed store) run folders, and the kill's step."""
    base = tmp_path_factory.mktemp("stream")
    reference, killed, stored = base / "reference", base / "killed", base / "stored"
    shutil.copytree(corpus / "generate", reference / "generate")
    add_an_empty_sample(reference)
    full.run(compose(overrides(tiny_target, reference, "stages=[vocab]")))
    shutil.copytree(reference, killed)
    ref = start(tiny_target, reference, *TRAIN, "train.data_source=stream", "train.stream_tee=true")
    proc = start(tiny_target, killed, *TRAIN, "train.data_source=stream")
    try:
        try:
            while not (
                logged_steps(killed) and logged_steps(killed)[-1] >= 9 and latest_ray_checkpoint(killed / "train")
            ):
                assert proc.poll() is None, (base / "killed.log").read_text()[-4000:]
                time.sleep(0.05)
        finally:
            kill_run(proc)  # the driver, Ray, the trainers and the engine actors, at once
        kill_step = logged_steps(killed)[-1]
        assert not (killed / "train" / "metrics.json").exists()
        resumed = start(tiny_target, killed, *TRAIN, "train.data_source=stream")
        killed_engine = kill_an_engine(killed, resumed, base)
        # Then one training worker, past the resumed run's next checkpoint: the run fails
        # saying so, and the next rerun resumes from that checkpoint.
        trainer_failure = kill_a_trainer(killed, resumed, base, after_step=kill_step)
        resumed = start(tiny_target, killed, *TRAIN, "train.data_source=stream")
        finished(ref, reference)
        # The teed store: the capture stage adopts its committed shards and verifies it, then
        # the store path trains on it.
        shutil.copytree(reference, stored, ignore=shutil.ignore_patterns("train"))
        full.run(compose(overrides(tiny_target, stored, "stages=[capture]")))
        store_run = start(tiny_target, stored, *TRAIN, "train.data_source=store")
        finished(resumed, killed)
        finished(store_run, stored)
    finally:
        for p in (ref, proc, *[v for k, v in locals().items() if k in ("resumed", "store_run")]):
            if p.poll() is None:
                kill_run(p)
    return reference, killed, stored, kill_step, killed_engine, trainer_failure


@pytest.mark.slow
def test_streaming_trains_exactly_as_the_store_path(runs):
    """Two workers, each rank's shards dealt as the store path deals them: the same steps
    (losses, grad norms, accuracies, held-out figures, truncations) and the same weights."""
    reference, _, stored, _, _, _ = runs
    assert [r["step"] for r in records(reference)] == list(range(24))
    assert records(reference) == records(stored)
    a, b = weights(reference), weights(stored)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    m_stream = json.loads((reference / "train" / "metrics.json").read_text())
    m_store = json.loads((stored / "train" / "metrics.json").read_text())
    for k in ("samples", "tokens", "truncated"):
        assert m_stream["stream"][k] == m_store["stream"][k], k
    # The corpus has samples past train.max_seq_len, so that both paths cut (and count) them
    assert any(len(r["input_ids"]) > 42 for r in corpus_rows(reference) if r["split"] == "train")
    assert m_stream["eval_samples"] == m_store["eval_samples"]


@pytest.mark.slow
def test_an_empty_sample_is_a_counted_skip_on_both_paths(runs):
    """The corpus row with no tokens (fixture): the stream's summary and the capture stage
    count it alike, and neither trains it."""
    reference, _, stored, _, _, _ = runs
    streamed = json.loads((reference / "train" / "stream" / "summary.json").read_text())["skipped"]
    captured = json.loads((stored / "capture" / "summary.json").read_text())["skipped"]
    assert streamed == captured == {"empty_sample": 1}
    assert "empty-0" not in {i for ids in trained_by_epoch(reference).values() for i in ids}


@pytest.mark.slow
def test_the_stream_keeps_its_states_within_the_budget_and_writes_no_store(runs):
    reference, killed, _, _, _, _ = runs
    summary = json.loads((reference / "train" / "stream" / "summary.json").read_text())
    assert summary["budget_bytes"] == BUDGET and 0 < summary["peak_object_store_bytes"] <= BUDGET
    assert summary["actors_per_worker"] == 1 and summary["workers"] == 2
    assert not (killed / "store").exists()  # no tee: nothing stored
    rates = json.loads((reference / "train" / "metrics.json").read_text())["stream"]
    assert rates["bound"] in ("inference", "training") and rates["actors_per_worker_suggested"] >= 1


@pytest.mark.slow
def test_a_killed_engine_actor_is_restarted_and_its_shards_computed_again(runs):
    """Rank 0's engine, SIGKILLed mid-stream in the resumed run: Ray Data restarts it and
    computes the shards it had not delivered again; the run still ends equal to the
    uninterrupted one (test below), its later batches computed by the new engine."""
    reference, killed, _, _, engine, _ = runs
    lines = [json.loads(line) for line in (killed / "train" / "stream" / "rank0.jsonl").read_text().splitlines()]
    after = [r["engines"] for r in lines[[r["engines"] for r in lines].index([engine]) :]]
    assert {e for engines in after for e in engines} - {engine}, "no batch came from a restarted engine"
    assert records(killed) == records(reference)


@pytest.mark.slow
def test_a_killed_training_worker_fails_the_run_in_one_line_and_the_rerun_resumes(runs):
    """Rank 1's worker SIGKILLed past the resumed run's checkpoint: the run stops with one
    line saying what died and what to do; the rerun resumes from that checkpoint (its later
    batches trained by new workers) and ends equal to the uninterrupted run (test below)."""
    reference, killed, _, kill_step, _, failure = runs
    assert "the training worker(s) of rank [1] died" in failure and "rerun the same command" in failure, failure
    lines = [json.loads(line) for line in (killed / "train" / "stream" / "rank1.jsonl").read_text().splitlines()]
    workers = [r["worker"] for r in lines]
    # the whole-run kill's, the resumed run's (killed), the rerun's: one process each
    assert len(dict.fromkeys(workers)) == 3, workers
    assert records(killed) == records(reference)


@pytest.mark.slow
def test_a_killed_stream_resumes_to_the_uninterrupted_run_training_each_sample_once(runs):
    """SIGKILL of the whole run's process group between two checkpoints; the rerun resumes
    from the latest and ends equal to the uninterrupted run, and over both runs every train
    sample of each complete epoch was trained exactly once (the last record of each batch)."""
    reference, killed, _, kill_step, _, _ = runs
    assert 9 <= kill_step < 23
    assert records(killed) == records(reference)
    a, b = weights(reference), weights(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    train_ids = sorted(r["id"] for r in corpus_rows(killed) if r["split"] == "train" and r["input_ids"])
    by_epoch = trained_by_epoch(killed)
    last = records(killed)[-1]["epoch"]
    assert sorted(by_epoch) == list(range(last + 1)) and last >= 2
    for epoch in range(last):  # the complete epochs: each train sample once
        assert sorted(by_epoch[epoch]) == train_ids, epoch
    assert len(set(by_epoch[last])) == len(by_epoch[last]) and set(by_epoch[last]) <= set(train_ids)
    assert trained_by_epoch(reference) == by_epoch


def test_a_resumed_rank_streams_from_the_shard_of_its_window_on():
    """The rows of a rank's dataset after a checkpoint inside epoch 1's window starting at
    sample 5: the shards wholly before it are not computed again, the one it starts in is
    streamed with its first samples skipped, later epochs whole; enough epochs planned."""
    from workflows.train.data import BatchSettings, my_shards
    from workflows.train.stream_pipeline import rank_items

    counts = {"train-a": 4, "train-b": 4, "train-c": 2, "heldout-a": 3}
    settings = BatchSettings(batch_size=2, packing=False)
    position = {"epoch": 1, "batches": 3, "window_start": 5, "in_window": 1}
    items, stride = rank_items(counts, 7, 0, 1, position, 10, settings)
    order = my_shards(["train-a", "train-b", "train-c"], 7, 1, 0, 1)[0]
    before = counts[order[0]]  # the window starts in the first shard or the second
    first = [i for i in items if i["epoch"] == 1]
    if before <= 5:
        assert [i["shard"] for i in first] == order[1:] and first[0]["first"] == before
        assert first[0]["skip"] == 5 - before
    else:
        assert [i["shard"] for i in first] == order and first[0]["skip"] == 5
    assert [i["skip"] for i in first[1:]] == [0] * (len(first) - 1) and not stride
    # 10 batches of at most 2 samples from epochs of 10: 2 more epochs, planned with 2 spare
    assert sorted({i["epoch"] for i in items}) == [1, 2, 3, 4]
    for epoch in (2, 3, 4):
        assert [i["shard"] for i in items if i["epoch"] == epoch] == my_shards(list(counts)[:3], 7, epoch, 0, 1)[0]


def test_a_budget_a_pipeline_cannot_hold_is_refused_naming_the_figures():
    from eagle3.schema import ConfigError
    from workflows.train.streaming import data_limit

    # 2 pipelines x 6 shards of 100 bytes: 1200 at least; Ray Data gets each share less 2 shards
    assert data_limit(1200, 2, 100) == 400
    with pytest.raises(ConfigError, match=r"train.stream_budget_bytes=1199: .* at least 1200; raise it"):
        data_limit(1199, 2, 100)


def test_streaming_refuses_the_local_backend_naming_both_settings():
    from eagle3.schema import ConfigError
    from workflows.core.config import compose
    from workflows.train.stage import backend_of

    train = compose(["train.data_source=stream", "train.backend=local"]).train
    with pytest.raises(ConfigError, match=r"train.data_source=stream feeds Ray Train workers: use train.backend=ray"):
        backend_of(train, "stream")
    assert backend_of(compose(["train.data_source=stream"]).train, "stream") == "deepspeed"
