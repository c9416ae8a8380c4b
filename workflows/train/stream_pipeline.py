"""The streaming source's Ray Data side: engine actors computing capture shards for trainers.

Each training rank gets its own dataset (`train_<rank>`): its shards of each epoch, dealt
as the store path deals them (workflows.train.data.my_shards), one row per shard in that
order, mapped by a pool of engine actors (`StatesActor`: the capture stage's engine and
shard code, workflows.core.shard_states) with `preserve_order`, so that a rank's batches
are a function of the seed alone. Ray Data's `streaming_split`
would balance one pool over the ranks instead, but deals blocks to whichever rank asks
first: not reproducible, so not resumable exactly; one pool per rank is. Rank 0's dataset
opens with the held-out shards it evaluates on (epoch -1).

The states in flight are bounded by Ray Data's own resource limits: each dataset's
executor gets its share of `train.stream_budget_bytes` (workflows.train.streaming.
data_limit), and Ray Data's backpressure holds the engine actors back when it is full. `ObjectStorePeak`
measures what the object store really held meanwhile.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time

import numpy as np

from storage.reader import aux_slots
from storage.states import STATE_ARRAYS
from workflows.core.engine_spec import EngineSpec
from workflows.core.engines import engine_class
from workflows.core.shard_states import CorpusFiles, ShardRef, shard_data
from workflows.train.data import my_shards


class StatesActor:
    """One capture engine in a Ray actor: a row per shard in, its tokens and states out (as
    the store would hold them), the draft's layers only; with `tee`, the shard is also
    written and committed to the store, the first time it streams."""

    def __init__(
        self, plan_file: str, backend: str, engine: dict, corpus_folder: str, state_dtype: str, train_ids, tee
    ):
        import pyarrow.parquet as pq

        self.refs = {r["name"]: ShardRef(**r) for r in pq.read_table(plan_file).to_pylist()}
        self.engine = engine_class(backend)(EngineSpec(**engine))
        self.corpus, self.state_dtype = CorpusFiles(corpus_folder), state_dtype
        self.slots = aux_slots(list(engine["capture_ids"]), train_ids, "the stream")
        self.hidden = None
        self.store = None
        if tee:
            from storage.store import HiddenStateStore

            self.store = HiddenStateStore.open(tee["url"], tee["storage_options"])
            self.chunk_bytes, self.compression = tee["chunk_bytes"], tee["compression"]
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch) -> dict:
        out = []
        for item in batch.to_pylist():
            plan = self.corpus.load(self.refs[item["shard"]])
            started = time.perf_counter()
            data = shard_data(plan, self.engine.states(plan.input_ids), self.state_dtype)
            seconds = time.perf_counter() - started
            if self.store is not None and item["tee"]:
                row = self.store.write_shard(plan.name, data, self.chunk_bytes, self.compression)
                self.store.commit([row])
            arrays = {
                k: getattr(data, k) for k in ("input_ids", "loss_mask", "offsets", *STATE_ARRAYS[self.state_dtype])
            }
            out.append(
                {
                    **item,
                    "sample_ids": list(plan.sample_ids),
                    "tokens": plan.n_tokens,
                    "seconds": seconds,
                    "actor": self.name,
                    **self._select(arrays),  # one tensor column each (Arrow's, not pickled)
                }
            )
        if len(out) == 1:  # the usual call (batch_size=1): each array keeps its shape
            return {k: (np.asarray(v)[None] if isinstance(v, np.ndarray) else [v]) for k, v in out[0].items()}
        return {k: np.array([o[k] for o in out] + [None], dtype=object)[:-1] for k in out[0]}

    def _select(self, arrays: dict) -> dict:
        """The draft's layers of the captured ones (capture.families captures a union)."""
        if self.slots is None:
            return arrays
        h = arrays["final"].shape[1]
        arrays["aux"] = np.concatenate([arrays["aux"][:, k * h : (k + 1) * h] for k in self.slots], axis=1)
        if "aux_scale" in arrays:
            arrays["aux_scale"] = np.ascontiguousarray(arrays["aux_scale"][:, self.slots])
        return arrays


def epochs_needed(samples_per_epoch: int, batches: int, settings) -> int:
    """Epochs that surely hold `batches` batches of a rank with `samples_per_epoch` samples
    an epoch: a padded batch holds at most `batch_size` samples, a packed one at most
    `rows_per_batch * max_seq_len` (a sample has at least one token)."""
    most = settings.batch_size if not settings.packing else settings.rows_per_batch * settings.max_seq_len
    least = max(1, math.ceil(samples_per_epoch / most))
    return math.ceil(batches / least) + 1


def rank_items(counts: dict[str, int], seed: int, rank: int, world: int, position: dict | None, batches: int, settings):
    """The rows of rank `rank`'s dataset: its shards of each epoch (dealt as the store path
    deals them, workflows.train.data.my_shards) from the checkpoint's window on (the samples
    before it are not streamed again), enough epochs for `batches` more batches."""
    shards = [n for n in counts if n.startswith("train-")]
    start_epoch = position["epoch"] if position else 0
    window_start = position.get("window_start", 0) if position else 0
    stride = my_shards(shards, seed, start_epoch, rank, world)[1]
    # The fewest samples a rank can get in an epoch: the smallest shards' share, or a stride
    sizes = sorted(counts[n] for n in shards)
    per_epoch = sum(sizes) // world if stride else sum(sizes[: len(sizes) // world])
    items = []
    for epoch in range(start_epoch, start_epoch + epochs_needed(per_epoch, batches, settings) + 1):
        first = 0
        for name in my_shards(shards, seed, epoch, rank, world)[0]:
            n = counts[name]
            if epoch == start_epoch and first + n <= window_start:
                first += n
                continue
            skip = max(0, window_start - first) if epoch == start_epoch else 0
            items.append({"epoch": epoch, "shard": name, "first": first, "skip": skip, "tee": False})
            first += n
    return items, stride


class ObjectStorePeak:
    """The object store's use, sampled every `every` seconds while it runs: its peak above
    what it held when it started (the states in flight, and what else a run puts there)."""

    def __init__(self, every: float = 0.05):
        self.every, self.peak, self.base = every, 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="object-store-peak", daemon=True)

    @staticmethod
    def used() -> int:
        import ray
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        # Ray is pinned: its raylets' store stats (plasma bytes used, every node) via the
        # internal API behind `ray memory --stats-only`.
        state = get_state_from_address(ray.get_runtime_context().gcs_address)
        return int(get_memory_info_reply(state).store_stats.object_store_bytes_used)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.used() - self.base)
            except Exception:  # a sample lost while Ray shuts down is no reason to fail training
                pass
            self._stop.wait(self.every)

    def __enter__(self) -> "ObjectStorePeak":
        self.base = self.used()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
