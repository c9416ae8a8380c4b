"""Writing the hidden-state store: provenance, shard writer, commit through the manifest.

Protocol (what makes a crash harmless):
1. the driver creates the root group with the provenance (or opens it, refusing a config
   that contradicts it, by field);
2. one writer writes a whole shard group `shards/<name>` and sets its `complete` attribute
   last (the marker); a group without it is a half-written shard and is rewritten;
3. the driver commits: it rewrites `manifest.parquet` (atomically) with the new row.
Readers list only the manifest's shards, so a shard that is not committed does not exist.
"""
from __future__ import annotations

import hashlib
import math
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from storage.zarr_io import (DEFAULT_CHUNK_BYTES, chunk_rows, filesystem, join, parquet_bytes, write_bytes_atomic,
                             zarr_store)

FORMAT = "eagle3-hidden-states"
# 2: provenance names the target's weights by `target_weights_sha256` (was `target_revision`).
FORMAT_VERSION = 2
MANIFEST = "manifest.parquet"


class StoreError(RuntimeError):
    """The store is missing, corrupt or inconsistent (names the shard / sample / field)."""


class ProvenanceMismatch(StoreError):
    """The store was captured under other settings than the caller's (names the field)."""


def sample_ids_hash(ids: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


def check_provenance(stored: dict, expected: dict, where: str) -> None:
    """Refuse a store whose provenance contradicts any field of `expected`, naming the field.
    Which fields matter is the caller's contract; the format version always does."""
    for name, value in {"format_version": FORMAT_VERSION, **expected}.items():
        if stored.get(name) != value:
            raise ProvenanceMismatch(
                f"{where}: provenance field '{name}' is {stored.get(name)!r} in the store but the config "
                f"asks for {value!r}; use another capture.store / run_dir or fix the config"
            )


@dataclass
class ShardData:
    """One capture shard in memory: samples concatenated along the token axis."""

    sample_ids: list[str]
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    offsets: np.ndarray  # int64 [n+1]
    aux: np.ndarray  # uint16 bf16 bits [T, n_aux*H]
    final: np.ndarray  # uint16 bf16 bits [T, H]

    def check(self, aux_width: int, hidden_size: int, name: str) -> None:
        t, n = len(self.input_ids), len(self.sample_ids)
        problems = []
        if self.offsets.shape != (n + 1,) or self.offsets[0] != 0 or self.offsets[-1] != t:
            problems.append(f"offsets {self.offsets.shape} do not span {n} samples / {t} tokens")
        elif np.any(np.diff(self.offsets) <= 0):
            problems.append(f"empty sample {self.sample_ids[int(np.argmax(np.diff(self.offsets) <= 0))]!r}")
        if self.loss_mask.shape != (t,):
            problems.append(f"loss_mask shape {self.loss_mask.shape} != ({t},)")
        if self.aux.shape != (t, aux_width):
            problems.append(f"aux shape {self.aux.shape} != ({t}, {aux_width})")
        if self.final.shape != (t, hidden_size):
            problems.append(f"final shape {self.final.shape} != ({t}, {hidden_size})")
        if problems:
            raise StoreError(f"shard {name}: " + "; ".join(problems))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.input_ids, self.loss_mask, self.offsets, self.aux, self.final))


def _compressors(compression: str):
    if compression == "none":
        return None
    if compression.startswith("zstd"):
        from zarr.codecs import ZstdCodec

        level = int(compression.split(":", 1)[1]) if ":" in compression else 1
        return [ZstdCodec(level=level)]
    raise StoreError(f"compression={compression!r}: use 'none' or 'zstd[:level]'")


class HiddenStateStore:
    """A store at a local path or an fsspec URL (s3://..., with `storage_options`)."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = str(url).rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.path = filesystem(self.url, self.storage_options)

    # ------------------------------------------------------------------ root and provenance
    def exists(self) -> bool:
        return self.fs.exists(f"{self.path}/zarr.json")

    @classmethod
    def create_or_open(cls, url: str, provenance: dict, storage_options: dict | None = None,
                       checked: Sequence[str] | None = None) -> "HiddenStateStore":
        """Create the store with `provenance`, or open it when its `checked` fields (all of
        them by default) agree with `provenance`."""
        store = cls(url, storage_options)
        if store.exists():
            keys = provenance.keys() if checked is None else checked
            check_provenance(store.provenance, {k: provenance.get(k) for k in keys}, f"store {store.url}")
            return store
        import zarr

        root = zarr.open_group(zarr_store(store.url, store.storage_options), mode="w-",
                               attributes={"format": FORMAT,
                                           "provenance": {**provenance, "format_version": FORMAT_VERSION}})
        root.create_group("shards")
        return store

    @classmethod
    def open(cls, url: str, storage_options: dict | None = None, expect: dict | None = None) -> "HiddenStateStore":
        store = cls(url, storage_options)
        if not store.exists():
            raise StoreError(f"{store.url}: no hidden-state store here (no zarr.json); run the capture stage")
        if expect:
            check_provenance(store.provenance, expect, f"store {store.url}")
        return store

    @property
    def provenance(self) -> dict:
        import json

        meta = json.loads(self.fs.cat_file(f"{self.path}/zarr.json"))
        attrs = meta.get("attributes", {})
        if attrs.get("format") != FORMAT:
            raise StoreError(f"{self.url}: not an {FORMAT} store (format={attrs.get('format')!r})")
        return attrs["provenance"]

    # ------------------------------------------------------------------ shards (writer side)
    def shard_url(self, name: str) -> str:
        return join(self.url, "shards", name)

    def open_shard(self, name: str):
        import zarr

        return zarr.open_group(zarr_store(self.shard_url(name), self.storage_options, read_only=True), mode="r")

    def shard_is_complete(self, name: str) -> bool:
        """The writer's marker: the shard group's `complete` attribute (written last)."""
        try:
            return bool(self.open_shard(name).attrs.get("complete"))
        except Exception:  # absent or unreadable: not complete
            return False

    def completed_row(self, name: str) -> dict | None:
        """The manifest row a finished writer left in its shard (to commit it after a driver crash)."""
        try:
            attrs = self.open_shard(name).attrs
        except Exception:
            return None
        return dict(attrs["manifest_row"]) if attrs.get("complete") and "manifest_row" in attrs else None

    def remove_shard(self, name: str) -> None:
        path = f"{self.path}/shards/{name}"
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def write_shard(self, name: str, data: ShardData, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                    compression: str = "none") -> dict:
        """Write a whole shard group, then its `complete` marker. Returns its manifest row."""
        import zarr

        prov = self.provenance
        data.check(len(prov["capture_layer_ids"]) * prov["hidden_size"], prov["hidden_size"], name)
        started = time.perf_counter()
        group = zarr.open_group(zarr_store(self.shard_url(name), self.storage_options), mode="w",
                                attributes={"complete": False})
        compressors = _compressors(compression)
        t = len(data.input_ids)
        for key in ("input_ids", "loss_mask", "offsets", "aux", "final"):
            arr = getattr(data, key)
            if arr.ndim == 2:
                rows = min(t, chunk_rows(arr.shape[1] * arr.itemsize, chunk_bytes))
                # One Zarr shard (one file) per array; chunks inside it stay ~chunk_bytes
                # so random access by sample reads little more than the sample.
                chunks, shards = (rows, arr.shape[1]), (math.ceil(t / rows) * rows, arr.shape[1])
            else:
                chunks, shards = (max(1, len(arr)),), None
            z = group.create_array(key, shape=arr.shape, dtype=arr.dtype, chunks=chunks, shards=shards,
                                   compressors=compressors, fill_value=0)
            z[...] = arr
        row = {"shard": name, "n_samples": len(data.sample_ids), "n_tokens": t, "nbytes": data.nbytes,
               "sample_ids_sha256": sample_ids_hash(data.sample_ids),
               "writer": f"{socket.gethostname()}:{os.getpid()}",
               "write_seconds": time.perf_counter() - started}
        group.attrs.update({"sample_ids": list(data.sample_ids), "n_samples": row["n_samples"],
                            "n_tokens": t, "final_is_normed": prov["final_is_normed"],
                            "sample_ids_sha256": row["sample_ids_sha256"], "manifest_row": row})
        group.attrs["complete"] = True  # the marker, last
        return row

    # ------------------------------------------------------------------ manifest (driver side)
    def manifest(self) -> list[dict]:
        import pyarrow.parquet as pq

        path = f"{self.path}/{MANIFEST}"
        if not self.fs.exists(path):
            return []
        with self.fs.open(path, "rb") as f:
            return pq.read_table(f).to_pylist()

    def committed(self) -> dict[str, dict]:
        return {r["shard"]: r for r in self.manifest()}

    def commit(self, rows: Sequence[dict]) -> None:
        """Add manifest rows (one per shard whose writer finished); atomic rewrite."""
        import pyarrow as pa

        for row in rows:
            if not self.shard_is_complete(row["shard"]):
                raise StoreError(f"shard {row['shard']}: cannot commit, its writer did not mark it complete")
        by_name = self.committed()
        now = time.strftime("%Y-%m-%dT%H:%M:%S")
        for row in rows:
            by_name[row["shard"]] = {**row, "committed_at": now}
        cols = ("shard", "n_samples", "n_tokens", "nbytes", "sample_ids_sha256", "writer", "write_seconds",
                "committed_at")
        table = pa.table({c: [r.get(c) for r in sorted(by_name.values(), key=lambda r: r["shard"])] for c in cols})
        write_bytes_atomic(self.fs, f"{self.path}/{MANIFEST}", parquet_bytes(table))

    def summary(self) -> dict[str, Any]:
        rows = self.manifest()
        return {"shards": len(rows), "samples": sum(r["n_samples"] for r in rows),
                "tokens": sum(r["n_tokens"] for r in rows), "bytes": sum(r["nbytes"] for r in rows)}
