"""The pipelined capture-then-write loop each capture actor runs.

An engine (workflows.core.engines) turns token sequences into per-sample states
`(aux [T, n*H], final [T, H])`; `capture_and_write` runs an engine over whole shard plans and writes each shard on a
background thread while the engine computes the next one: writing overlaps compute, and
every write has finished when it returns (nothing is left for actor teardown to flush).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from storage.states import encode_states
from storage.store import HiddenStateStore, ShardData


@dataclass
class ShardPlan:
    name: str
    sample_ids: list[str]
    input_ids: list[list[int]]
    loss_mask: list[list[int]]

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.input_ids)


@dataclass
class ShardRef:
    """What the driver sends an actor for one shard: where its samples are in the generate
    shards (file index and row of each), not their tokens; the actor reads those itself."""

    name: str
    sample_ids: list[str]
    files: list[int]
    rows: list[int]
    n_tokens: int


class CorpusFiles:
    """Actor side: reads the samples of a ShardRef from the committed generate shards,
    keeping the last few files' token columns (consecutive shards share files)."""

    def __init__(self, folder: str, keep: int = 2):
        self.folder, self.keep, self.cache = Path(folder), keep, {}

    def table(self, index: int):
        import pyarrow.parquet as pq

        if index not in self.cache:
            if len(self.cache) >= self.keep:
                self.cache.pop(next(iter(self.cache)))
            self.cache[index] = pq.read_table(
                self.folder / f"{index:05d}.parquet", columns=["id", "input_ids", "loss_mask"]
            )
        return self.cache[index]

    def load(self, ref: ShardRef) -> ShardPlan:
        input_ids, loss_mask = [], []
        for sid, f, r in zip(ref.sample_ids, ref.files, ref.rows):
            t = self.table(f)
            if t["id"][r].as_py() != sid:  # the corpus changed under the plan: never capture the wrong sample
                raise ValueError(
                    f"shard {ref.name}: generate shard {f} row {r} is {t['id'][r].as_py()!r}, the plan says {sid!r}"
                )
            input_ids.append(t["input_ids"][r].as_py())
            loss_mask.append(t["loss_mask"][r].as_py())
        return ShardPlan(ref.name, list(ref.sample_ids), input_ids, loss_mask)


def shard_data(plan: ShardPlan, states, state_dtype: str = "bfloat16") -> ShardData:
    """The shard's arrays; the states converted to `state_dtype` (storage.states) where the
    engine left them (its device: int8 is quantised on the GPU), then moved to the CPU."""
    lengths = [len(s) for s in plan.input_ids]
    if any(n == 0 for n in lengths):
        raise ValueError(f"shard {plan.name}: empty sample {plan.sample_ids[lengths.index(0)]!r}")
    return ShardData(
        sample_ids=list(plan.sample_ids),
        input_ids=np.concatenate([np.asarray(s, dtype=np.int32) for s in plan.input_ids]),
        loss_mask=np.concatenate([np.asarray(m, dtype=np.uint8) for m in plan.loss_mask]),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        **encode_states(states, state_dtype),
    )


def failed_row(name: str, exc: BaseException) -> dict:
    """The record an actor returns for a shard it could not capture (nothing committed)."""
    return {
        "shard": name,
        "n_samples": 0,
        "n_tokens": 0,
        "nbytes": 0,
        "sample_ids_sha256": "",
        "writer": "",
        "write_seconds": 0.0,
        "compute_seconds": 0.0,
        "error": f"{type(exc).__name__}: {exc}",
    }


def capture_and_write(
    engine,
    store: HiddenStateStore,
    plans: Sequence,
    chunk_bytes: int,
    compression: str = "none",
    retries: int | None = None,
    load: Callable[[object], ShardPlan] | None = None,
    state_dtype: str = "bfloat16",
) -> list[dict]:
    """Capture and write whole shards; shard k is written while shard k+1 is computed.

    `load` turns a plan into a ShardPlan (e.g. a ShardRef read from the corpus; default: the
    plan itself). With `retries=None` the first error propagates; with an int, a failing
    shard (load, compute or write) is retried that many times once the others are done, and
    then reported by a `failed_row` in place of its manifest row, so one bad shard does not
    stop the others. Returns one row per shard (plus capture timings), all writes finished."""
    load = load or (lambda p: p)
    rows: list[dict] = []
    failed: list[tuple[object, BaseException]] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as pool:

        def start(plan) -> _Timed:  # compute now, write on the writer thread
            shard = load(plan)
            started = time.perf_counter()
            data = shard_data(shard, engine.states(shard.input_ids), state_dtype)
            return _Timed(
                pool.submit(store.write_shard, shard.name, data, chunk_bytes, compression),
                time.perf_counter() - started,
            )

        def finish(plan, timed: _Timed) -> None:
            try:
                rows.append(timed.result())
            except Exception as exc:
                if retries is None:
                    raise
                failed.append((plan, exc))

        pending = None
        for plan in plans:
            try:
                timed = start(plan)
            except Exception as exc:
                if retries is None:
                    raise
                failed.append((plan, exc))
                timed = None
            if pending is not None:
                finish(*pending)
            pending = (plan, timed) if timed is not None else None
        if pending is not None:
            finish(*pending)
        for plan, exc in failed:  # in place, one at a time, after the others
            for _ in range(retries or 0):
                try:
                    store.remove_shard(plan.name)  # what the failed attempt left (never marked complete)
                    rows.append(start(plan).result())
                    break
                except Exception as again:
                    exc = again
            else:
                store.remove_shard(plan.name)
                rows.append(failed_row(plan.name, exc))
    return rows


class _Timed:
    def __init__(self, future, compute_s: float):
        self.future, self.compute_s = future, compute_s

    def result(self) -> dict:
        row = self.future.result()
        return {**row, "compute_seconds": self.compute_s, "error": None}
