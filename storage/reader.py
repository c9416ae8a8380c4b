"""Reading the store: random access by sample (the trainer) and streaming by shard.

Only shards listed in the manifest are visible. States come back as torch bfloat16
tensors (their stored bit patterns reinterpreted, never rounded again).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Iterator

import numpy as np
import torch

from storage.store import HiddenStateStore, StoreError
from storage.zarr_io import from_bf16_bits


class StoreReader:
    def __init__(self, url: str, storage_options: dict | None = None, expect: dict | None = None):
        self.store = HiddenStateStore.open(url, storage_options, expect=expect)
        self.provenance = self.store.provenance
        self.shards = self.store.manifest()
        self.index: dict[str, tuple[str, int]] = {}
        self._offsets: dict[str, np.ndarray] = {}
        for row in self.shards:
            ids = self._group(row["shard"]).attrs["sample_ids"]
            for k, sid in enumerate(ids):
                if sid in self.index:
                    raise StoreError(f"sample {sid!r} is in shards {self.index[sid][0]} and {row['shard']}")
                self.index[sid] = (row["shard"], k)

    @lru_cache(maxsize=None)
    def _group(self, name: str):
        return self.store.open_shard(name)

    def _offsets_of(self, name: str) -> np.ndarray:
        if name not in self._offsets:
            self._offsets[name] = self._group(name)["offsets"][...]
        return self._offsets[name]

    def __len__(self) -> int:
        return len(self.index)

    @property
    def sample_ids(self) -> list[str]:
        return list(self.index)

    def sample(self, sample_id: str) -> dict:
        """One sample: input_ids/loss_mask int64 [T], aux bf16 [T, n*H], final bf16 [T, H]."""
        if sample_id not in self.index:
            raise KeyError(f"sample {sample_id!r} is not in a committed shard of {self.store.url}")
        name, k = self.index[sample_id]
        g, off = self._group(name), self._offsets_of(name)
        a, b = int(off[k]), int(off[k + 1])
        return {"id": sample_id,
                "input_ids": torch.from_numpy(g["input_ids"][a:b].astype(np.int64)),
                "loss_mask": torch.from_numpy(g["loss_mask"][a:b].astype(np.int64)),
                "aux": from_bf16_bits(g["aux"][a:b]), "final": from_bf16_bits(g["final"][a:b])}

    def iter_shards(self) -> Iterator[dict]:
        """Whole shards in manifest order: numpy arrays plus sample_ids (bf16 still as bits)."""
        for row in self.shards:
            g = self._group(row["shard"])
            yield {"shard": row["shard"], "sample_ids": list(g.attrs["sample_ids"]),
                   **{k: g[k][...] for k in ("input_ids", "loss_mask", "offsets", "aux", "final")}}

