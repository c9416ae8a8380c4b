"""Low-level helpers: URL -> filesystem / Zarr store, bf16 <-> uint16 bits, chunk sizing."""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

# Chunk size of the big state arrays. Uncompressed shards are written and streamed with one
# file operation per array whatever the chunk size (storage.zarr_direct; bench/bench_store.py
# on the 2-core dev machine: store/raw ~0.7 write, ~0.5-0.6 stream at 0.25, 1 and 16 MB);
# it matters to zarr's own readers (compressed stores, other tools), which read whole
# chunks by sample: the smallest good size, 1 MB.
DEFAULT_CHUNK_BYTES = 1 << 20


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def filesystem(url: str, storage_options: dict | None = None):
    """(fsspec filesystem, path inside it) for a local path or an fsspec URL."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs, path.rstrip("/")


def zarr_store(url: str, storage_options: dict | None = None, read_only: bool = False):
    """A Zarr store rooted at `url` (so writes never touch metadata above it)."""
    from zarr.storage import FsspecStore, LocalStore

    if is_remote(url):
        return FsspecStore.from_url(url, storage_options=dict(storage_options or {}), read_only=read_only)
    path = url[len("file://") :] if url.startswith("file://") else url
    return LocalStore(os.path.abspath(path), read_only=read_only)


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def write_bytes_atomic(fs, path: str, data: bytes, fsync: bool = True) -> None:
    """Local: temp file (fsync'd unless `fsync=False`: then readers still never see a
    partial file, but a power loss may lose it) + rename. Object stores: a single PUT is
    already atomic."""
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    else:
        fs.pipe_file(path, data)


def parquet_bytes(table) -> bytes:
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def to_bf16_bits(t: Any) -> np.ndarray:
    """A torch tensor -> numpy uint16 holding its bf16 bit patterns (zarr has no bf16)."""
    import torch

    return t.detach().to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


def from_bf16_bits(bits: np.ndarray):
    """numpy uint16 bf16 bit patterns -> a torch bfloat16 tensor (no copy of the values)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def chunk_rows(row_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // max(1, row_bytes))
