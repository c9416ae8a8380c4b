"""Plain file I/O on the store's uncompressed Zarr v3 arrays: the fast path for whole shards.

Zarr's own read path costs ~10x a plain file read on whole shards (per-chunk requests and
copies through its event loop). The arrays the store writes uncompressed have a layout
simple enough to read and write with one file operation, and these functions do so
without changing a byte of the format: zarr reads what they write, and they read what
zarr wrote. Format facts used (Zarr v3 core spec and its sharding codec spec):

- an array's metadata is `<array>/zarr.json`; with the "default" chunk key encoding and
  the "/" separator, the chunk at grid position (i, j) is the file `<array>/c/i/j`;
- the "bytes" codec stores a chunk's elements in C order with the configured endianness;
- a "sharding_indexed" chunk (a shard) holds its inner chunks, each encoded by the inner
  codecs, followed (index_location "end") by an index: one (offset, nbytes) pair of
  little-endian uint64 per inner chunk in C order of the inner grid, (2**64-1, 2**64-1)
  for a chunk that is absent (all fill value), then, with the crc32c index codec, the
  index's CRC-32C as a little-endian uint32. Inner chunks are always whole (the last one
  padded with the fill value).

Handled layouts, the two the store writes: a 1-d array in one chunk (`c/0`), and a 2-d
array of full-width rows in one shard (`c/0/0`) of row-chunks. Anything else (a compressor,
another grid) gives `None` from `layout_of` and the caller uses zarr. Problems in the
bytes (missing file, short file, bad index checksum, chunk sizes) raise `CorruptArray`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
from fsspec.implementations.local import LocalFileSystem

ABSENT = 2**64 - 1  # the sharding index's marker of an absent inner chunk
_DTYPES = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32", "float64"}


class CorruptArray(Exception):
    """The array's files contradict its metadata (the message says how)."""


def _is_local(fs) -> bool:
    return isinstance(fs, LocalFileSystem)


@dataclass(frozen=True)
class Layout:
    """Where and how an array's one data file is laid out."""

    file: str  # path of the data file inside the filesystem
    shape: tuple[int, ...]
    dtype: np.dtype  # little-endian
    fill_value: float | int
    chunk_rows: int | None  # rows per inner chunk; None for a plain (unsharded) 1-d chunk
    n_chunks: int  # inner chunks in the shard (1 for a plain chunk)
    row_bytes: int  # bytes of one row (all of shape[1:])

    @property
    def index_bytes(self) -> int:  # the sharding index plus its crc32c
        return 0 if self.chunk_rows is None else 16 * self.n_chunks + 4


def _bytes_codec_ok(codec: dict, dtype: np.dtype) -> bool:
    """A "bytes" codec whose output is the little-endian elements (endian may be absent for 1 byte)."""
    if codec.get("name") != "bytes":
        return False
    endian = (codec.get("configuration") or {}).get("endian")
    return endian == "little" or (endian is None and dtype.itemsize == 1)


def layout_of(array_path: str, meta: dict) -> Layout | None:
    """The layout of an array from its zarr.json, or None when it is not one handled here."""
    try:
        if (
            meta.get("zarr_format") != 3
            or meta.get("node_type") != "array"
            or meta.get("storage_transformers")
            or meta.get("data_type") not in _DTYPES
            or meta["chunk_key_encoding"] != {"name": "default", "configuration": {"separator": "/"}}
            or meta["chunk_grid"].get("name") != "regular"
        ):
            return None
        dtype = np.dtype(meta["data_type"]).newbyteorder("<")
        shape = tuple(int(n) for n in meta["shape"])
        outer = tuple(int(n) for n in meta["chunk_grid"]["configuration"]["chunk_shape"])
        codecs, fill = meta["codecs"], meta["fill_value"]
        if not isinstance(fill, (int, float)) or len(codecs) != 1 or not shape or 0 in shape:
            return None
        row_bytes = dtype.itemsize * (shape[1] if len(shape) == 2 else 1)
        if len(shape) == 1 and outer == shape and _bytes_codec_ok(codecs[0], dtype):
            return Layout(f"{array_path}/c/0", shape, dtype, fill, None, 1, row_bytes)
        if len(shape) == 2 and codecs[0].get("name") == "sharding_indexed":
            conf = codecs[0]["configuration"]
            inner = tuple(int(n) for n in conf["chunk_shape"])
            index_codecs = conf["index_codecs"]
            if (
                outer[1] == shape[1]
                and outer[0] >= shape[0]
                and inner[1] == shape[1]
                and outer[0] % inner[0] == 0
                and len(conf["codecs"]) == 1
                and _bytes_codec_ok(conf["codecs"][0], dtype)
                and conf.get("index_location", "end") == "end"
                and len(index_codecs) == 2
                and _bytes_codec_ok(index_codecs[0], np.dtype("u8"))
                and index_codecs[1].get("name") == "crc32c"
            ):
                return Layout(f"{array_path}/c/0/0", shape, dtype, fill, inner[0], outer[0] // inner[0], row_bytes)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return None


# ---------------------------------------------------------------------------------- reading
def _read_file(fs, path: str) -> np.ndarray:
    """A whole file as a writable uint8 array (locally one `readinto`, no extra copy)."""
    try:
        if _is_local(fs):
            with open(path, "rb") as f:
                buf = np.empty(os.fstat(f.fileno()).st_size, dtype=np.uint8)
                if f.readinto(memoryview(buf)) != len(buf):
                    raise CorruptArray(f"{path}: file changed while read")
                return buf
        return np.frombuffer(bytearray(fs.cat_file(path)), dtype=np.uint8)
    except FileNotFoundError:
        raise CorruptArray(f"data file {path} is missing") from None


def _read_into(fs, path: str, start: int, out: memoryview) -> None:
    """Fill `out` with the file's bytes from `start`; a short file is corrupt."""
    try:
        if _is_local(fs):
            with open(path, "rb") as f:
                f.seek(start)
                got = f.readinto(out)
        else:
            data = fs.cat_file(path, start=start, end=start + len(out))
            got = len(data)
            out[:got] = data
    except FileNotFoundError:
        raise CorruptArray(f"data file {path} is missing") from None
    if got != len(out):
        raise CorruptArray(f"data file {path} is truncated: {start + got} bytes, needed {start + len(out)}")


def _file_size(fs, path: str) -> int:
    try:
        return os.path.getsize(path) if _is_local(fs) else int(fs.size(path))
    except FileNotFoundError:
        raise CorruptArray(f"data file {path} is missing") from None


def _parse_index(lay: Layout, tail: np.ndarray, file_size: int) -> np.ndarray:
    """The checked sharding index, int64 [n_chunks, 2] of (offset, nbytes); -1 marks absent chunks."""
    import google_crc32c  # zarr's own dependency for the crc32c codec

    if len(tail) != lay.index_bytes:
        raise CorruptArray(f"data file {lay.file} is truncated: {file_size} bytes, too short for its index")
    body = tail[:-4]
    if google_crc32c.value(body.tobytes()) != int(tail[-4:].view("<u4")[0]):
        raise CorruptArray(f"data file {lay.file}: shard index checksum mismatch (truncated or overwritten)")
    raw = body.view("<u8").reshape(lay.n_chunks, 2)
    absent = (raw == ABSENT).all(axis=1)
    present = raw[~absent]
    chunk_bytes = lay.chunk_rows * lay.row_bytes
    last = file_size - lay.index_bytes - chunk_bytes  # the last offset a whole chunk fits at
    if len(present) and (last < 0 or np.any(present[:, 1] != chunk_bytes) or np.any(present[:, 0] > last)):
        raise CorruptArray(
            f"data file {lay.file}: shard index points outside the file or at chunks of the "
            f"wrong size (expected {chunk_bytes} bytes each, data part "
            f"{file_size - lay.index_bytes} bytes)"
        )
    return np.where(absent[:, None], -1, raw.astype(np.int64))  # offsets now fit int64; -1: absent


def read_whole(fs, lay: Layout) -> np.ndarray:
    """The whole array: one file read; a zero-copy view when the inner chunks lie in order."""
    buf = _read_file(fs, lay.file)
    n_elems = lay.shape[0] * lay.row_bytes // lay.dtype.itemsize
    if lay.chunk_rows is None:
        if len(buf) != n_elems * lay.dtype.itemsize:
            raise CorruptArray(f"data file {lay.file} has {len(buf)} bytes, expected {n_elems * lay.dtype.itemsize}")
        return buf.view(lay.dtype).reshape(lay.shape)
    index = _parse_index(lay, buf[len(buf) - lay.index_bytes :] if len(buf) >= lay.index_bytes else buf, len(buf))
    chunk_bytes = lay.chunk_rows * lay.row_bytes
    if np.array_equal(index[:, 0], np.arange(lay.n_chunks) * chunk_bytes):  # what the store writes
        return buf[: n_elems * lay.dtype.itemsize].view(lay.dtype).reshape(lay.shape)
    out = np.empty(lay.shape, dtype=lay.dtype)  # chunks out of order or absent: copy chunk by chunk
    for c, (offset, _) in enumerate(index):
        a, b = c * lay.chunk_rows, min((c + 1) * lay.chunk_rows, lay.shape[0])
        if a >= b:  # a chunk wholly past the array's end (a shard larger than the array)
            continue
        if offset < 0:
            out[a:b] = lay.fill_value
        else:
            out[a:b] = buf[offset : offset + (b - a) * lay.row_bytes].view(lay.dtype).reshape(b - a, *lay.shape[1:])
    return out


class RowReader:
    """Rows a:b of one array by ranged reads (random access by sample); the index is read once."""

    def __init__(self, fs, lay: Layout):
        self.fs, self.lay, self._index = fs, lay, None

    def index(self) -> np.ndarray:
        if self._index is None:
            lay = self.lay
            size = _file_size(self.fs, lay.file)
            if size < lay.index_bytes:
                raise CorruptArray(f"data file {lay.file} is truncated: {size} bytes, too short for its index")
            tail = np.empty(lay.index_bytes, dtype=np.uint8)
            _read_into(self.fs, lay.file, size - lay.index_bytes, memoryview(tail))
            self._index = _parse_index(lay, tail, size)
        return self._index

    def rows(self, a: int, b: int) -> np.ndarray:
        lay = self.lay
        if not 0 <= a < b <= lay.shape[0]:
            raise CorruptArray(f"rows {a}:{b} outside the array's {lay.shape[0]} rows ({lay.file})")
        out = np.empty((b - a, *lay.shape[1:]), dtype=lay.dtype)
        flat = memoryview(out.reshape(-1).view(np.uint8))
        if lay.chunk_rows is None:
            _read_into(self.fs, lay.file, a * lay.row_bytes, flat)
            return out
        index, r = self.index(), lay.chunk_rows
        # Byte ranges of the wanted rows, chunk by chunk; ranges back to back (in the file and
        # in `out`) merge, so the store's own layout costs one read.
        pieces: list[list[int]] = []  # [file start, file end, first output row, end output row]
        for c in range(a // r, (b - 1) // r + 1):
            lo, hi = max(a, c * r) - a, min(b, (c + 1) * r) - a  # output rows this chunk supplies
            offset = int(index[c, 0])
            if offset < 0:  # absent chunk: all fill value
                out[lo:hi] = lay.fill_value
                continue
            s = offset + (lo + a - c * r) * lay.row_bytes
            e = s + (hi - lo) * lay.row_bytes
            if pieces and pieces[-1][1] == s and pieces[-1][3] == lo:
                pieces[-1][1], pieces[-1][3] = e, hi
            else:
                pieces.append([s, e, lo, hi])
        for s, e, lo, hi in pieces:
            _read_into(self.fs, lay.file, s, flat[lo * lay.row_bytes : hi * lay.row_bytes])
        return out


# ---------------------------------------------------------------------------------- writing
def array_metadata(shape: tuple[int, ...], dtype, chunk_rows: int | None) -> dict:
    """The zarr.json of an uncompressed array in a handled layout, as zarr itself writes it
    (tests/test_store.py compares the two): `chunk_rows=None` is a 1-d array in one chunk;
    else a 2-d array in one shard of `chunk_rows`-row inner chunks (the last one padded)."""
    dtype = np.dtype(dtype)
    bytes_codec = {"name": "bytes"} if dtype.itemsize == 1 else {"name": "bytes", "configuration": {"endian": "little"}}
    if chunk_rows is None:
        grid, codecs = list(shape), [bytes_codec]
    else:
        grid = [-(-shape[0] // chunk_rows) * chunk_rows, shape[1]]
        codecs = [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": [chunk_rows, shape[1]],
                    "codecs": [bytes_codec],
                    "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                    "index_location": "end",
                },
            }
        ]
    return {
        "shape": list(shape),
        "data_type": dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,
        "codecs": codecs,
        "attributes": {},
        "zarr_format": 3,
        "node_type": "array",
        "storage_transformers": [],
    }


def group_metadata(attributes: dict) -> dict:
    return {"attributes": attributes, "zarr_format": 3, "node_type": "group"}


def put(fs, path: str, parts: list) -> None:
    """Write a file from byte-like parts (locally without joining them first)."""
    if _is_local(fs):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            for p in parts:
                f.write(p)
    else:
        fs.pipe_file(path, b"".join(parts))  # one PUT


def write_whole(fs, lay: Layout, arr: np.ndarray) -> None:
    """Write the array's data file in the layout its zarr.json describes."""
    arr = np.ascontiguousarray(arr, dtype=lay.dtype)
    if arr.shape != lay.shape:
        raise ValueError(f"{lay.file}: array shape {arr.shape} != metadata shape {lay.shape}")
    parts = [memoryview(arr.reshape(-1).view(np.uint8))]
    if lay.chunk_rows is not None:
        import google_crc32c  # zarr's own dependency for the crc32c codec

        chunk_bytes = lay.chunk_rows * lay.row_bytes
        pad = np.full((lay.n_chunks * lay.chunk_rows - lay.shape[0], *lay.shape[1:]), lay.fill_value, dtype=lay.dtype)
        index = np.empty((lay.n_chunks, 2), dtype="<u8")
        index[:, 0] = np.arange(lay.n_chunks, dtype=np.uint64) * chunk_bytes  # chunks back to back, in order
        index[:, 1] = chunk_bytes
        crc = np.array([google_crc32c.value(index.tobytes())], dtype="<u4")
        parts += [memoryview(pad.reshape(-1).view(np.uint8)), index.tobytes(), crc.tobytes()]
    put(fs, lay.file, parts)


def read_json(fs, path: str) -> dict:
    """A zarr.json (or any small JSON file); FileNotFoundError when absent."""
    if _is_local(fs):  # plain open: fsspec's local layer costs more than the read
        with open(path, "rb") as f:
            return json.loads(f.read())
    return json.loads(fs.cat_file(path))
