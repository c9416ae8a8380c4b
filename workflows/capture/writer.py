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
from typing import Callable, Sequence

import numpy as np
import torch

from storage.store import HiddenStateStore, ShardData
from storage.zarr_io import to_bf16_bits


@dataclass
class ShardPlan:
    name: str
    sample_ids: list[str]
    input_ids: list[list[int]]
    loss_mask: list[list[int]]

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.input_ids)


def shard_data(plan: ShardPlan, states) -> ShardData:
    lengths = [len(s) for s in plan.input_ids]
    if any(n == 0 for n in lengths):
        raise ValueError(f"shard {plan.name}: empty sample {plan.sample_ids[lengths.index(0)]!r}")
    return ShardData(
        sample_ids=list(plan.sample_ids),
        input_ids=np.concatenate([np.asarray(s, dtype=np.int32) for s in plan.input_ids]),
        loss_mask=np.concatenate([np.asarray(m, dtype=np.uint8) for m in plan.loss_mask]),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        aux=to_bf16_bits(torch.cat([a for a, _ in states])),
        final=to_bf16_bits(torch.cat([f for _, f in states])),
    )


def capture_and_write(engine, store: HiddenStateStore, plans: Sequence[ShardPlan], chunk_bytes: int,
                      compression: str = "none", before_shard: Callable[[int], None] | None = None) -> list[dict]:
    """Capture and write whole shards; shard k is written while shard k+1 is computed.

    Returns one manifest row per shard (plus capture timings), all writes finished."""
    rows: list[dict] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as pool:
        pending = None
        for k, plan in enumerate(plans):
            if before_shard is not None:
                before_shard(k)
            started = time.perf_counter()
            data = shard_data(plan, engine.states(plan.input_ids))
            compute_s = time.perf_counter() - started
            if pending is not None:
                rows.append(pending.result())
            write = pool.submit(store.write_shard, plan.name, data, chunk_bytes, compression)
            pending = _Timed(write, compute_s)
        if pending is not None:
            rows.append(pending.result())
    return rows


class _Timed:
    def __init__(self, future, compute_s: float):
        self.future, self.compute_s = future, compute_s

    def result(self) -> dict:
        row = self.future.result()
        return {**row, "compute_seconds": self.compute_s}
