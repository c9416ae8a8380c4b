"""A capture shard's samples and states: what the capture stage writes and the streaming
train source hands to trainers, built by the same code so that both hold the same bytes.

`ShardRef` is what a driver sends an engine actor for one shard (where its samples are in
the generate shards, no tokens); `CorpusFiles` reads them on the actor's side into a
`ShardPlan`; `shard_data` turns a plan and an engine's states into the shard's arrays, in
the store's state dtype (storage.states); `engine_spec` is the capture engine every
actor builds (workflows.core.engines), from the `capture` section.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage.states import encode_states
from storage.store import ShardData
from workflows.core.config import FullConfig
from workflows.core.precision import engine_dtype


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


def engine_spec(cfg: FullConfig, target_path) -> dict:
    """The capture engine's EngineSpec fields (one engine per actor, on the GPUs Ray gave
    it; an SGLang actor is one TP group): the capture stage's and the streaming source's."""
    c = cfg.capture
    return {
        "target_path": str(target_path),
        "capture_ids": cfg.store_capture_ids,
        "dtype": engine_dtype(c),
        "micro_batch_tokens": c.micro_batch_tokens,
        "trust_remote_code": cfg.target.trust_remote_code,
        "threads": max(1, int(c.cpus_per_actor)),
        "device": "cuda" if c.gpus_per_actor else "cpu",
        "tp_size": cfg.target.tp_size if c.backend == "sglang" else 1,
        "seed": cfg.seed,
        "final_state": c.final_state,
        "timeout_s": c.engine_timeout_s,
        # SGLang sizes its own KV pool on GPUs (the 4096-token CPU default would refuse long samples).
        "max_total_tokens": None if c.gpus_per_actor else 4096,
    }
