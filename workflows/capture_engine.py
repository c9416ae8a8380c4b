"""Capture engines and the pipelined capture-then-write loop each Ray actor runs.

An engine turns token sequences into per-sample states `(aux [T, n*H], final [T, H])`:

* `HFEngine`: transformers forward; aux by forward hooks on the decoder layers (ids in the
  `eagle3.layer_ids` convention, the last layer's raw residual stream), `final` = HF's last
  `hidden_states` entry, i.e. *after* the final norm (`FINAL_IS_NORMED`), which is what the
  trainer's `TargetHead` expects and what SGLang returns as its hidden state.

`capture_and_write` runs an engine over whole shard plans and writes each shard on a
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

from eagle3.target_features import FINAL_IS_NORMED, capture_states, pad_right
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


def micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices grouped by length (little padding), each group's padded size <= budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups, cur = [], []
    for i in order:
        if cur and lengths[i] * (len(cur) + 1) > token_budget:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups


class HFEngine:
    backend = "hf"
    final_is_normed = FINAL_IS_NORMED

    def __init__(self, target_path: str, layer_ids: list[int], dtype: str = "float32",
                 micro_batch_tokens: int = 4096, trust_remote_code: bool = False):
        from workflows.target import load_target

        self.model, tokenizer = load_target(target_path, dtype=dtype, trust_remote_code=trust_remote_code)
        self.layer_ids = list(layer_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.micro_batch_tokens = micro_batch_tokens

    @staticmethod
    def version() -> str:
        import transformers

        return f"transformers {transformers.__version__}"

    def _padded(self, seqs, idx):
        ids, _, attn = pad_right([seqs[i] for i in idx], [[0] * len(seqs[i]) for i in idx], self.pad_id)
        return ids, attn

    @torch.no_grad()
    def states(self, seqs: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out: list = [None] * len(seqs)
        for idx in micro_batches([len(s) for s in seqs], self.micro_batch_tokens):
            ids, attn = self._padded(seqs, idx)
            aux, final = capture_states(self.model, ids, attn.long(), self.layer_ids)
            for row, i in enumerate(idx):
                n = len(seqs[i])
                out[i] = (aux[row, :n], final[row, :n])
        return out

    @torch.no_grad()
    def bare_forward(self, seqs: Sequence[Sequence[int]]) -> None:
        """The same micro-batches through a plain forward (the speed baseline)."""
        for idx in micro_batches([len(s) for s in seqs], self.micro_batch_tokens):
            ids, attn = self._padded(seqs, idx)
            self.model(input_ids=ids, attention_mask=attn.long(), use_cache=False)


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
