"""The streaming batch source: a Ray Train worker's batches from engine actors, no store.

Each rank reads its own Ray Data dataset (`train_<rank>`, through Ray Train's
`get_dataset_shard`; workflows.train.streaming builds them): one row per capture shard
of the rank's epochs in order, the shard's tokens and states as the store would hold them
(workflows.core.shard_states), computed by the rank's pool of engine actors. From there on
it is the store path's batching (workflows.train.data): samples in the seeded within-shard
order, windows of `shuffle_window` samples, the same seeded batch order, so that with the
same rank's shards it yields the store path's batches exactly.

Position (the checkpoint's `position`): the epoch, the batches taken in it, and the window
being trained: the index of its first sample in the epoch's sequence, the batch-order
generator's state at its start, and its batches taken. A resume re-streams the epoch from
that window's shard (the samples before it are never recomputed), rebuilds the window and
skips its batches already trained: the batches of an uninterrupted run, bit for bit.

Every batch taken is recorded by sample id in `train/stream/rank<r>.jsonl` (one line per
batch: epoch, batch number in the epoch, ids, the engine actors that computed them and the
training worker that trained it, as host:pid); a resume rewrites the lines of the batches
it trains again, so the last line of each (epoch, batch) is what trained.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import socket
import time
import warnings
from pathlib import Path
from typing import Iterator

from storage.reader import sample_order, shard_samples
from storage.states import STATE_ARRAYS, states_as_tensors
from workflows.core.errors import InputError
from workflows.core.log import log
from workflows.core.stage_metrics import StageMetrics
from workflows.train.data import (
    BatchSettings,
    SamplesInMemory,
    StreamCounts,
    eval_batches,
    hash_seed,
    window_batches,
)

LEDGER = "stream"  # train/stream/: the plan, and each rank's record of what it trained


def rng_state(state) -> list:
    """random.Random's state as JSON holds it."""
    version, internal, gauss = state
    return [version, list(internal), gauss]


def rng_from(saved: list) -> random.Random:
    rng = random.Random()
    rng.setstate((saved[0], tuple(saved[1]), saved[2]))
    return rng


class StreamSource:
    def __init__(self, job):
        self.job = job
        self.skipped: dict[str, str] = {}  # no file behind these states: nothing corrupt to skip
        self._counts = StreamCounts()
        self.throughput = {"shards": 0, "state_tokens": 0, "engine_seconds": 0.0, "wait_seconds": 0.0}
        self._heldout: SamplesInMemory | None = None
        self._ledger = None
        self._engine_of: dict[str, str] = {}  # sample id -> the engine actor that computed it (host:pid)

    @property
    def url(self) -> str:
        return self.job.store_url

    # ------------------------------------------------------------------ the interface
    def open(self, settings: BatchSettings, seed, rank, world, state, prefetch, pin) -> None:
        import ray.train

        self.settings, self.seed, self.rank, self.world, self.pin = settings, seed, rank, world, pin
        self.position = dict(state) if state else {"epoch": 0, "batches": 0}
        rows = ray.train.get_dataset_shard(f"train_{rank}").iter_rows()
        self._rows = iter(rows)
        if rank == 0:
            self._read_heldout()
        folder = Path(self.job.config.run_dir) / "train" / LEDGER
        folder.mkdir(parents=True, exist_ok=True)
        self._ledger = open(folder / f"rank{rank}.jsonl", "a")
        self._worker = f"{socket.gethostname()}:{os.getpid()}"  # which process trained each batch
        self._started = time.perf_counter()
        # The dashboard's view (Ray metrics, tag worker=rank<r>): eagle3_stage_throughput of the
        # stages "stream_inference" (per engine actor) and "stream_training" (this worker)
        self._gauges = [
            StageMetrics(f"stream_{kind}", "tokens", worker=f"rank{rank}") for kind in ("inference", "training")
        ]
        self._batches = self._stream(self.position)

    def next_batch(self) -> dict:
        batch = next(self._batches)
        self._counts.samples += int(batch["segment_ids"].max(dim=-1).values.add(1).sum())
        self._counts.tokens += int(batch["attention_mask"].sum())
        return {k: v.pin_memory() for k, v in batch.items()} if self.pin else batch

    def state(self) -> dict:
        return dict(self.position)

    @property
    def epoch(self) -> int:
        return self.position["epoch"]

    def heldout_batches(self, batch_size: int, max_seq_len: int, pad_id: int, max_samples: int) -> Iterator[dict]:
        """Rank 0's held-out batches, batched as the store's: the shards its stream opened
        with (epoch -1), read once and kept."""
        names = list(self._heldout.shards)
        return eval_batches(self._heldout, names, batch_size, max_seq_len, pad_id, max_samples=max_samples)

    def _read_heldout(self) -> None:
        shards = {}
        row = next(self._rows, None)
        while row is not None and int(row["epoch"]) == -1:
            shard = self._tensors(row)
            shards[row["shard"]] = list(shard_samples(shard, self.job.state_dtype, range(len(row["sample_ids"]))))
            row = next(self._rows, None)
        self._rows = itertools.chain([row] if row is not None else [], self._rows)
        self._heldout = SamplesInMemory(shards, self.url)

    def counts(self) -> dict:
        c = self._counts
        return {"samples": c.samples, "tokens": c.tokens, "truncated": c.truncated, **self.rates()}

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    # ------------------------------------------------------------------ throughput
    def rates(self) -> dict:
        """Inference tokens/s per engine actor (its compute time), training tokens/s of this
        worker (its wall time less the time it waited for states), which one bounds, and the
        engine actors per training worker the two rates call for."""
        t = self.throughput
        wall = time.perf_counter() - self._started
        per_actor = t["state_tokens"] / t["engine_seconds"] if t["engine_seconds"] else 0.0
        training = self._counts.tokens / max(wall - t["wait_seconds"], 1e-9)
        actors = self.job.stream_actors_per_worker
        return {
            "inference_tokens_per_s_per_actor": round(per_actor, 1),
            "training_tokens_per_s_per_worker": round(training, 1),
            "waited_fraction": round(t["wait_seconds"] / max(wall, 1e-9), 3),
            "bound": "inference" if per_actor * actors < training else "training",
            "actors_per_worker": actors,
            "actors_per_worker_suggested": math.ceil(training / per_actor) if per_actor else None,
        }

    def _epoch_done(self, epoch: int) -> None:
        r = self.rates()
        self._gauges[0].throughput(r["inference_tokens_per_s_per_actor"])
        self._gauges[1].throughput(r["training_tokens_per_s_per_worker"])
        if self.rank == 0:
            self.log_rates(f"epoch {epoch} done")

    def log_rates(self, where: str) -> None:
        r = self.rates()
        log(
            f"stream ({where}): inference {r['inference_tokens_per_s_per_actor']:.0f} tok/s per engine actor "
            f"x {r['actors_per_worker']} per worker, training {r['training_tokens_per_s_per_worker']:.0f} tok/s "
            f"per worker (waited {r['waited_fraction']:.0%} for states): {r['bound']}-bound; the rates call for "
            f"{r['actors_per_worker_suggested']} engine actor(s) per training worker"
        )

    # ------------------------------------------------------------------ the stream
    def _tensors(self, row: dict) -> dict:
        arrays = {k: row[k] for k in STATE_ARRAYS[self.job.state_dtype]}
        with warnings.catch_warnings():
            # Arrow's buffers are read-only; the samples are only ever read (collated into copies).
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            states = states_as_tensors(arrays, self.job.state_dtype, dequantize=False)
        return {
            **{k: row[k] for k in ("input_ids", "loss_mask", "offsets")},
            **states,
            "sample_ids": list(row["sample_ids"]),
        }

    def _samples(self) -> Iterator[tuple[int, int, dict]]:
        """(epoch, index in the epoch's sample sequence, sample), as the rank's rows come, to
        the end of the epochs planned."""
        while True:
            waited = time.perf_counter()
            row = next(self._rows, None)
            self.throughput["wait_seconds"] += time.perf_counter() - waited
            if row is None:
                return
            t = self.throughput
            t["shards"] += 1
            t["state_tokens"] += int(row["tokens"])
            t["engine_seconds"] += float(row["seconds"])
            epoch, ids = int(row["epoch"]), row["sample_ids"]
            self._engine_of.update(dict.fromkeys(ids, row["actor"]))
            order = sample_order(len(ids), row["shard"], hash_seed(self.seed, epoch))
            for j, sample in enumerate(shard_samples(self._tensors(row), self.job.state_dtype, order)):
                if j >= int(row["skip"]):  # trained before the checkpoint this run resumed from
                    yield epoch, int(row["first"]) + j, sample

    def _stream(self, resume: dict) -> Iterator[dict]:
        """The store path's windows and batch order (workflows.train.data.BatchStream)."""
        s, epoch, window, start, rng = self.settings, None, [], 0, None
        stride = self.job.stream_stride
        for e, k, sample in self._samples():
            if e != epoch:
                if window:
                    yield from self._window(epoch, start, window, rng)
                if epoch is not None:
                    self._epoch_done(epoch)
                epoch, window = e, []
                rng = random.Random(f"batches:{self.seed}:{e}:{self.rank}")
                if e == resume["epoch"] and "window_rng" in resume:
                    rng = rng_from(resume["window_rng"])
            if stride and k % self.world != self.rank:
                continue
            if not window:
                start = k
            window.append(sample)
            if len(window) == s.window:
                yield from self._window(epoch, start, window, rng)
                window = []
        if window:  # the last epoch planned: its last window
            yield from self._window(epoch, start, window, rng)
        raise InputError(
            f"{self.url}: the stream of worker {self.rank} ended at epoch {self.position['epoch']} before "
            f"train.steps; its epochs were planned too few (workflows.train.stream_pipeline.epochs_needed)"
        )

    def _window(self, epoch: int, start: int, window: list[dict], rng: random.Random) -> Iterator[dict]:
        before = rng_state(rng.getstate())
        pairs = window_batches(window, self.settings, rng)
        p = self.position
        resuming = p.get("epoch") == epoch and p.get("window_start") == start and "in_window" in p
        taken = p["batches"] - p["in_window"] if resuming else (p["batches"] if p.get("epoch") == epoch else 0)
        skip = p["in_window"] if resuming else 0
        for b, (batch, ids, truncated) in enumerate(pairs[skip:], start=skip + 1):
            self.position = {
                "epoch": epoch,
                "batches": taken + b,
                "window_start": start,
                "window_rng": before,
                "in_window": b,
            }
            engines = sorted({self._engine_of.pop(i, "?") for i in ids})
            line = {"epoch": epoch, "batch": taken + b, "ids": ids, "engines": engines, "worker": self._worker}
            self._ledger.write(json.dumps(line) + "\n")
            self._ledger.flush()
            self._counts.truncated += truncated
            yield batch
        window.clear()
