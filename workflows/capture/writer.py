"""The pipelined capture-then-write loop each capture actor runs.

An engine (workflows.core.engines) turns token sequences into per-sample states
`(aux [T, n*H], final [T, H])`; the shard's arrays are made by workflows.core.shard_states
(shared with the streaming train source); `capture_and_write` runs an engine over whole
shard plans and writes each shard on a background thread while the engine computes the
next one: writing overlaps compute, and every write has finished when it returns (nothing
is left for actor teardown to flush).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from storage.store import HiddenStateStore
from workflows.core.shard_states import CorpusFiles, ShardPlan, ShardRef, shard_data

__all__ = ["CorpusFiles", "ShardPlan", "ShardRef", "capture_and_write", "failed_row", "shard_data"]


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
