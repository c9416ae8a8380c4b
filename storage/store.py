"""Writing the hidden-state store: provenance, shard writer, commit through the manifest.

Protocol (what makes a crash harmless):
1. the driver creates the root group with the provenance (or opens it, refusing a config
   that contradicts it, by field);
2. one writer writes a whole shard group `shards/<name>` and sets its `complete` attribute
   last (the marker); a group without it is a half-written shard and is rewritten;
3. the driver commits: after checking the marker it writes the shard's manifest row as one
   small file `commits/<name>.json` (atomically: temp file + rename, or one PUT), O(1) per
   shard however many are committed;
4. `compact()` (the driver, once at the end) folds the commit log into `manifest.parquet`
   (an atomic rewrite), then deletes the folded log files. A crash between the two leaves
   rows in both places; readers de-duplicate by shard name (the log's row wins).
The manifest is `manifest.parquet` + `commits/*.json`, sorted by shard name, the same
before and after compaction. Readers list only its shards, so a shard that is not
committed does not exist.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from storage import zarr_direct
from storage.states import STATE_ARRAYS, STATE_DTYPES, state_shapes
from storage.zarr_io import (
    DEFAULT_CHUNK_BYTES,
    chunk_rows,
    filesystem,
    join,
    parquet_bytes,
    write_bytes_atomic,
    zarr_store,
)

FORMAT = "eagle3-hidden-states"
# 2: provenance names the target's weights by `target_weights_sha256` (was `target_revision`).
FORMAT_VERSION = 2
MANIFEST = "manifest.parquet"
COMMITS = "commits"  # the commit log: one <shard>.json per commit since the last compaction
# A manifest row's fields, in the parquet's column order (`split` is optional: None when unknown).
MANIFEST_SCHEMA = (
    ("shard", "string"),
    ("n_samples", "int64"),
    ("n_tokens", "int64"),
    ("nbytes", "int64"),
    ("sample_ids_sha256", "string"),
    ("writer", "string"),
    ("write_seconds", "float64"),
    ("committed_at", "string"),
    ("split", "string"),
)
COLUMNS = tuple(name for name, _ in MANIFEST_SCHEMA)


class StoreError(RuntimeError):
    """The store is missing, corrupt or inconsistent (names the shard / sample / field)."""


class ProvenanceMismatch(StoreError):
    """The store was captured under other settings than the caller's (names the field)."""


def sample_ids_hash(ids: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


def split_of(row: dict) -> str | None:
    """A shard's split: the row's `split`, else its name's prefix, the letters before the
    first "-" (`train-000000-<hash>`); None for names without one (`000000-<hash>`, the
    stores written before splits were named)."""
    if row.get("split"):
        return row["split"]
    prefix = row["shard"].split("-", 1)[0]
    return prefix if "-" in row["shard"] and prefix.isalpha() else None


def check_provenance(stored: dict, expected: dict, where: str) -> None:
    """Refuse a store whose provenance contradicts any field of `expected`, naming the field.
    Which fields matter is the caller's contract; the format version always does."""
    for name, value in {"format_version": FORMAT_VERSION, **expected}.items():
        if stored.get(name) != value:
            raise ProvenanceMismatch(
                f"{where}: provenance field '{name}' is {stored.get(name)!r} in the store but the config "
                f"asks for {value!r}; use another capture.store / run_dir or fix the config"
            )


def state_dtype_of(provenance: dict, where: str) -> str:
    """The store's scheme of states (storage.states): provenance's `state_dtype` (a store
    without one predates the field and holds bf16); one this code does not know is refused,
    naming the field."""
    scheme = provenance.get("state_dtype", "bfloat16")
    if scheme not in STATE_DTYPES:
        raise StoreError(
            f"{where}: provenance field 'state_dtype' is {scheme!r}, a scheme this code cannot read "
            f"(it knows {', '.join(STATE_DTYPES)}); read it with the code that wrote it"
        )
    return scheme


@dataclass
class ShardData:
    """One capture shard in memory: samples concatenated along the token axis. The states
    in one of the schemes of storage.states: bf16 bits (uint16 aux/final, no scales) or int8
    with float32 scales (`storage.states.encode_states` makes either)."""

    sample_ids: list[str]
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    offsets: np.ndarray  # int64 [n+1]
    aux: np.ndarray  # [T, n_aux*H]: uint16 bf16 bits, or int8
    final: np.ndarray  # [T, H]: uint16 bf16 bits, or int8
    aux_scale: np.ndarray | None = None  # int8: float32 [T, n_aux]
    final_scale: np.ndarray | None = None  # int8: float32 [T, 1]

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays a shard group holds, by name."""
        named = {k: getattr(self, k) for k in ("input_ids", "loss_mask", "offsets", "aux", "final")}
        return named | {k: v for k in ("aux_scale", "final_scale") if (v := getattr(self, k)) is not None}

    def check(self, n_aux: int, hidden_size: int, name: str, state_dtype: str = "bfloat16") -> None:
        t, n = len(self.input_ids), len(self.sample_ids)
        if n == 0:
            raise StoreError(f"shard {name}: no samples")
        problems = []
        if self.offsets.shape != (n + 1,) or self.offsets[0] != 0 or self.offsets[-1] != t:
            problems.append(f"offsets {self.offsets.shape} do not span {n} samples / {t} tokens")
        elif np.any(np.diff(self.offsets) <= 0):
            problems.append(f"empty sample {self.sample_ids[int(np.argmax(np.diff(self.offsets) <= 0))]!r}")
        if self.loss_mask.shape != (t,):
            problems.append(f"loss_mask shape {self.loss_mask.shape} != ({t},)")
        arrays, dtypes = self.arrays(), STATE_ARRAYS[state_dtype]
        for key, shape in state_shapes(state_dtype, t, n_aux, hidden_size).items():
            arr = arrays.get(key)
            if arr is None:
                problems.append(f"{key} is missing (state_dtype {state_dtype})")
            elif arr.shape != shape:
                problems.append(f"{key} shape {arr.shape} != {shape}")
            elif arr.dtype != dtypes[key]:
                problems.append(f"{key} is {arr.dtype}, not {np.dtype(dtypes[key])} (state_dtype {state_dtype})")
        extra = set(arrays) - {"input_ids", "loss_mask", "offsets", *dtypes}
        if extra:
            problems.append(f"{', '.join(sorted(extra))} not stored with state_dtype {state_dtype}")
        if problems:
            raise StoreError(f"shard {name}: " + "; ".join(problems))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays().values())


def _compressors(compression: str):
    if compression == "none":
        return None
    if compression.startswith("zstd"):
        from zarr.codecs import ZstdCodec

        level = int(compression.split(":", 1)[1]) if ":" in compression else 1
        return [ZstdCodec(level=level)]
    raise StoreError(f"compression={compression!r}: use 'none' or 'zstd[:level]'")


def _plain(value):
    """JSON for numpy scalars (rows built from numpy arrays)."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


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
    def create_or_open(
        cls, url: str, provenance: dict, storage_options: dict | None = None, checked: Sequence[str] | None = None
    ) -> "HiddenStateStore":
        """Create the store with `provenance`, or open it when its `checked` fields (all of
        them by default) agree with `provenance`."""
        store = cls(url, storage_options)
        if store.exists():
            keys = provenance.keys() if checked is None else checked
            check_provenance(store.provenance, {k: provenance.get(k) for k in keys}, f"store {store.url}")
            return store
        import zarr

        root = zarr.open_group(
            zarr_store(store.url, store.storage_options),
            mode="w-",
            attributes={"format": FORMAT, "provenance": {**provenance, "format_version": FORMAT_VERSION}},
        )
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
        meta = json.loads(self.fs.cat_file(f"{self.path}/zarr.json"))
        attrs = meta.get("attributes", {})
        if attrs.get("format") != FORMAT:
            raise StoreError(f"{self.url}: not an {FORMAT} store (format={attrs.get('format')!r})")
        return attrs["provenance"]

    def record(self, fields: dict) -> None:
        """Add recorded-only fields to the provenance (the driver, after a capture: e.g. the
        layers its engines reported capturing). The root metadata is replaced whole."""
        path = f"{self.path}/zarr.json"
        meta = json.loads(self.fs.cat_file(path))
        meta["attributes"]["provenance"] = {**meta["attributes"]["provenance"], **fields}
        write_bytes_atomic(self.fs, path, json.dumps(meta).encode())

    # ------------------------------------------------------------------ shards (writer side)
    def shard_url(self, name: str) -> str:
        return join(self.url, "shards", name)

    def open_shard(self, name: str):
        import zarr

        return zarr.open_group(zarr_store(self.shard_url(name), self.storage_options, read_only=True), mode="r")

    def shard_attrs(self, name: str) -> dict:
        """The shard group's attributes, read from its zarr.json (no zarr machinery);
        FileNotFoundError when the group does not exist."""
        return zarr_direct.read_json(self.fs, f"{self.path}/shards/{name}/zarr.json").get("attributes", {})

    def shard_is_complete(self, name: str) -> bool:
        """The writer's marker: the shard group's `complete` attribute (written last)."""
        try:
            return bool(self.shard_attrs(name).get("complete"))
        except Exception:  # absent or unreadable: not complete
            return False

    def completed_row(self, name: str) -> dict | None:
        """The manifest row a finished writer left in its shard (to commit it after a driver crash)."""
        try:
            attrs = self.shard_attrs(name)
        except Exception:
            return None
        return dict(attrs["manifest_row"]) if attrs.get("complete") and "manifest_row" in attrs else None

    def remove_shard(self, name: str) -> None:
        path = f"{self.path}/shards/{name}"
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def write_shard(
        self,
        name: str,
        data: ShardData,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        compression: str = "none",
        split: str | None = None,
    ) -> dict:
        """Write a whole shard group, then its `complete` marker. Returns its manifest row
        (with `split` when given).

        Uncompressed (the default), every file is written directly in Zarr v3's layout
        (storage.zarr_direct: one write per array, at raw file speed); compressed, the
        arrays go through zarr."""
        prov = self.provenance
        scheme = state_dtype_of(prov, f"store {self.url}")
        data.check(len(prov["capture_layer_ids"]), prov["hidden_size"], name, scheme)
        started = time.perf_counter()
        compressors = _compressors(compression)
        group_path, group = f"{self.path}/shards/{name}", None
        self.remove_shard(name)  # leftovers of an earlier attempt
        zarr_direct.put(
            self.fs, f"{group_path}/zarr.json", [json.dumps(zarr_direct.group_metadata({"complete": False})).encode()]
        )
        t = len(data.input_ids)
        for key, arr in data.arrays().items():
            # 2-d: one Zarr shard (one file) per array; chunks inside it stay ~chunk_bytes so
            # random access by sample reads little more than the sample. 1-d: one chunk.
            rows = min(t, chunk_rows(arr.shape[1] * arr.itemsize, chunk_bytes)) if arr.ndim == 2 else None
            if compressors is None:
                meta = zarr_direct.array_metadata(arr.shape, arr.dtype, rows)
                zarr_direct.put(self.fs, f"{group_path}/{key}/zarr.json", [json.dumps(meta).encode()])
                zarr_direct.write_whole(self.fs, zarr_direct.layout_of(f"{group_path}/{key}", meta), arr)
                continue
            import zarr

            if group is None:
                group = zarr.open_group(zarr_store(self.shard_url(name), self.storage_options), mode="r+")
            chunks, shards = (
                ((rows, arr.shape[1]), (math.ceil(t / rows) * rows, arr.shape[1])) if rows else ((len(arr),), None)
            )
            z = group.create_array(
                key,
                shape=arr.shape,
                dtype=arr.dtype,
                chunks=chunks,
                shards=shards,
                compressors=compressors,
                fill_value=0,
            )
            z[...] = arr
        row = {
            "shard": name,
            "n_samples": len(data.sample_ids),
            "n_tokens": t,
            "nbytes": data.nbytes,
            "sample_ids_sha256": sample_ids_hash(data.sample_ids),
            "writer": f"{socket.gethostname()}:{os.getpid()}",
            "write_seconds": time.perf_counter() - started,
        }
        if split is not None:
            row["split"] = split
        attrs = {
            "sample_ids": list(data.sample_ids),
            "n_samples": row["n_samples"],
            "n_tokens": t,
            "final_is_normed": prov["final_is_normed"],
            "sample_ids_sha256": row["sample_ids_sha256"],
            "manifest_row": row,
            "complete": True,
        }
        # The marker, last: the group's metadata replaced whole (a reader never sees half of it).
        write_bytes_atomic(
            self.fs, f"{group_path}/zarr.json", json.dumps(zarr_direct.group_metadata(attrs)).encode(), fsync=False
        )
        return row

    # ------------------------------------------------------------------ manifest (driver side)
    def _parquet_rows(self) -> list[dict]:
        import pyarrow.parquet as pq

        path = f"{self.path}/{MANIFEST}"
        try:
            with self.fs.open(path, "rb") as f:
                return pq.read_table(f).to_pylist()
        except FileNotFoundError:
            return []

    def _log_files(self) -> list[str]:
        """The commit log's files (temp files of writes in flight or killed are not in it)."""
        self.fs.invalidate_cache(f"{self.path}/{COMMITS}")  # object stores cache listings per process
        try:
            names = self.fs.ls(f"{self.path}/{COMMITS}", detail=False)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if n.endswith(".json"))

    def _log_rows(self, files: list[str]) -> list[dict] | None:
        """The rows of these log files; None when one vanished (a compaction folded it)."""
        if not files:
            return []
        blobs = self.fs.cat(files, on_error="return")  # concurrent on object stores
        rows = []
        for path in files:
            blob = blobs.get(path)
            if blob is None or isinstance(blob, FileNotFoundError):
                return None
            try:
                if isinstance(blob, Exception):  # fs.cat returns a file's error in its place
                    raise blob
                rows.append(json.loads(blob))
            except (OSError, ValueError) as exc:
                raise StoreError(f"{self.url}: commit log file {path} is unreadable ({exc})") from None
        return rows

    @staticmethod
    def _merged(parquet_rows: list[dict], log_rows: list[dict]) -> list[dict]:
        """One row per shard, sorted by name; a log row replaces the parquet's (same or newer)."""
        by_name = {r["shard"]: r for r in parquet_rows}
        by_name.update({r["shard"]: r for r in log_rows})
        return [{c: by_name[n].get(c) for c in COLUMNS} for n in sorted(by_name)]

    def manifest(self) -> list[dict]:
        """The committed shards' rows (manifest.parquet + commit log), sorted by shard name."""
        # The log is listed before the parquet is read: a compaction deletes log files only
        # after writing the parquet that holds them, so a listed file that is gone when read
        # means a newer parquet exists, and reading again sees it.
        for _ in range(10):
            files = self._log_files()
            parquet_rows = self._parquet_rows()
            log_rows = self._log_rows(files)
            if log_rows is not None:
                return self._merged(parquet_rows, log_rows)
        raise StoreError(f"{self.url}: the commit log kept changing while it was read; retry")

    def committed(self) -> dict[str, dict]:
        return {r["shard"]: r for r in self.manifest()}

    def commit(self, rows: Sequence[dict]) -> None:
        """Commit shards whose writer finished: one small log file per shard, written
        atomically after its marker is checked. Costs O(1) per shard: nothing else is read
        or rewritten (`compact()` folds the log into manifest.parquet)."""
        for row in rows:
            if not self.shard_is_complete(row["shard"]):
                raise StoreError(f"shard {row['shard']}: cannot commit, its writer did not mark it complete")
        now = time.strftime("%Y-%m-%dT%H:%M:%S")
        self.fs.makedirs(f"{self.path}/{COMMITS}", exist_ok=True)
        for row in rows:
            record = {c: row.get(c) for c in COLUMNS if c != "committed_at"} | {"committed_at": now}
            write_bytes_atomic(
                self.fs, f"{self.path}/{COMMITS}/{row['shard']}.json", json.dumps(record, default=_plain).encode()
            )

    def compact(self) -> int:
        """Fold the commit log into manifest.parquet (atomic rewrite), then delete the folded
        log files; returns how many were folded. Call it from the committing process (the
        driver), e.g. once at the end of a capture; a crash at any point loses nothing."""
        import pyarrow as pa

        files = self._log_files()
        if not files:
            return 0
        log_rows = self._log_rows(files)
        if log_rows is None:
            raise StoreError(f"{self.url}: commit log files vanished during compaction (two compactions at once?)")
        rows = self._merged(self._parquet_rows(), log_rows)
        schema = pa.schema([(name, getattr(pa, kind)()) for name, kind in MANIFEST_SCHEMA])
        table = pa.table({c: [r[c] for r in rows] for c in COLUMNS}, schema=schema)
        write_bytes_atomic(self.fs, f"{self.path}/{MANIFEST}", parquet_bytes(table))
        self.fs.rm(files)
        return len(files)

    def summary(self) -> dict[str, Any]:
        rows = self.manifest()
        return {
            "shards": len(rows),
            "samples": sum(r["n_samples"] for r in rows),
            "tokens": sum(r["n_tokens"] for r in rows),
            "bytes": sum(r["nbytes"] for r in rows),
        }
