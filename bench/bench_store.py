"""Store throughput vs raw file I/O of the same bytes, measured in the same run.

    python -m bench.bench_store [--dir /tmp/x] [--shards 4] [--tokens 4096] [--hidden 1024]
                                [--chunk-mb 1] [--repeats 4] [--only all|schemes|tensorstore]
                                [--tensorstore [--ts-shards 3] [--ts-samples 64] [--ts-tokens 512] [--ts-hidden 4096]]

Writes `--shards` capture shards (3 aux + final bf16 states of `--hidden`, plus ids/mask/
offsets) with storage.HiddenStateStore (write_shard + commit each, compact at the end),
and the same arrays' bytes as plain files (one sequential write each). Then reads both
back two ways:

- stream: StoreReader.iter_samples over every shard (whole-shard reads, the trainer's
  streaming path; every sample dict built) vs reading each raw file whole; with the
  next shard prefetched in a thread (the default) and without (`stream_noprefetch`:
  the consumer here does no work, so prefetching can only cost, more so on a busy machine);
- random: StoreReader.sample() for every sample in a shuffled order vs reading each
  sample's byte ranges from the raw files (open, seek, read per array).

Reads are timed on a fresh StoreReader built untimed (it reads the manifest only).

Prints MB/s and store/raw ratios (aims: write >= 0.66, stream read >= 0.5) per chunk size,
best of `--repeats` (reads: 3 tries each per repeat; interleaved, each side first in turn,
so machine noise and cache state hit both sides alike). Both sides go through the page
cache (no fsync of the data), as the store does. On a busy machine the ratios move by
+-0.15 from run to run: run it twice.

Then the state schemes (`capture.state_dtype`), on the same samples: a bf16 store and an
int8 store (the same bf16 values quantised), their bytes per token (the arrays, and the
data files on disk) and streaming tokens/s (iter_samples, prefetch on), int8 / bf16, two
ways: `stream_tokens_per_s_ratio` with int8 dequantised to bf16 in the reader (on the CPU:
random access, CPU-only training) and `stream_stored_tokens_per_s_ratio` with int8 left as
stored (`dequantize=False`: the trainer's batches, dequantised on its device after the copy,
workflows.train.data.to_device); interleaved and best of `--repeats` x 3 like the rest.

Then (with `--tensorstore`, needs the `tensorstore` package: the `bench` extra) TensorStore's
zarr3 driver against storage.zarr_direct on the same store, shards of `--ts-samples`
samples of `--ts-tokens` tokens at `--ts-hidden` (the default: 64 samples of 512 tokens at
H 4096, capture.shard_samples's default, ~1 GB of bf16 states a shard): streaming (every
array of every shard read whole, the arrays opened per shard, as the reader does) and
random (each sample's rows of every array, in a shuffled order, handles opened once per
shard and kept, as `StoreReader.sample` keeps them); MB/s each and tensorstore / direct.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

ARRAYS = ("input_ids", "loss_mask", "offsets", "aux", "final")


def make_shards(n: int, tokens: int, hidden: int, samples_per_shard: int = 16, state_dtype: str = "bfloat16"):
    """`n` shards of random samples; the same samples whatever `state_dtype` (int8: their
    bf16 values quantised by storage.states, as the capture writer does)."""
    import torch

    from storage.states import encode_states
    from storage.store import ShardData

    rng = np.random.default_rng(0)
    out = []
    for s in range(n):
        lengths = np.full(samples_per_shard, tokens // samples_per_shard)
        lengths[-1] += tokens - lengths.sum()
        input_ids = rng.integers(0, 50000, tokens, dtype=np.int32)
        loss_mask = rng.integers(0, 2, tokens, dtype=np.uint8)
        # Random normal floats as bf16 bits (realistic exponents; not compressible by chance).
        aux = (rng.standard_normal((tokens, 3 * hidden), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        final = (rng.standard_normal((tokens, hidden), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        states = {"aux": aux, "final": final}
        if state_dtype != "bfloat16":
            as_bf16 = [tuple(torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for a in (aux, final))]
            states = encode_states(as_bf16, state_dtype)
        out.append(
            ShardData(
                sample_ids=[f"s{s}-{i}" for i in range(samples_per_shard)],
                input_ids=input_ids,
                loss_mask=loss_mask,
                offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                **states,
            )
        )
    return out


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def with_reader(path: Path, fn):
    """`fn(reader)` timed on a fresh StoreReader built untimed (a trainer builds one per
    worker, then reads for hours; building it reads the manifest only)."""
    from storage.reader import StoreReader

    def run():
        reader = StoreReader(str(path))
        return timed(lambda: fn(reader))

    return run


def write_store(path: Path, shards, hidden: int, chunk_bytes: int, state_dtype: str = "bfloat16") -> None:
    from storage.store import HiddenStateStore

    prov = {
        "hidden_size": hidden,
        "capture_layer_ids": [1, 2, 3],
        "final_is_normed": True,
        "target": {},
        "state_dtype": state_dtype,
    }
    store = HiddenStateStore.create_or_open(str(path), prov)
    for k, s in enumerate(shards):
        store.commit([store.write_shard(f"{k:06d}", s, chunk_bytes=chunk_bytes)])
    store.compact()


def write_raw(path: Path, shards) -> None:
    path.mkdir()
    for k, s in enumerate(shards):
        for name in ARRAYS:
            with open(path / f"{k}-{name}", "wb") as f:
                f.write(getattr(s, name).tobytes())


def stream_store(reader, prefetch: bool = True) -> int:
    n = 0
    for s in reader.iter_samples(reader.shard_names(), prefetch=prefetch):
        n += sum(s[k].numel() * s[k].element_size() for k in ("aux", "final")) + 2 * s["input_ids"].numel()
    return n


def stream_raw(path: Path) -> int:
    return sum(len(p.read_bytes()) for p in sorted(path.iterdir()))


def random_store(reader, order: list[str]) -> int:
    n = 0
    for sid in order:
        s = reader.sample(sid)
        n += s["aux"].numel() * 2
    return n


def random_raw(path: Path, shards, order: list[str]) -> int:
    where = {sid: (k, i) for k, s in enumerate(shards) for i, sid in enumerate(s.sample_ids)}
    n = 0
    for sid in order:
        k, i = where[sid]
        off = shards[k].offsets  # the raw side knows its offsets (the store reads them once per shard)
        a, b = int(off[i]), int(off[i + 1])
        for name in ("input_ids", "loss_mask", "aux", "final"):
            row = getattr(shards[k], name)[:1].nbytes
            with open(path / f"{k}-{name}", "rb") as f:
                f.seek(a * row)
                data = f.read((b - a) * row)
            n += len(data) if name == "aux" else 0
    return n


def bench(root: Path, shards, hidden: int, chunk_mb: float, repeats: int) -> dict:
    total = sum(s.nbytes for s in shards)
    order = [sid for s in shards for sid in s.sample_ids]
    random.Random(0).shuffle(order)
    best: dict[str, float] = {}

    def keep(key: str, seconds: float) -> None:
        best[key] = min(best.get(key, float("inf")), seconds)

    for r in range(repeats):
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        store, raw = root / "store", root / "raw"
        # (what, timed store side, timed raw side): each returns its seconds
        steps = [
            (
                "write",
                lambda: timed(lambda: write_store(store, shards, hidden, int(chunk_mb * (1 << 20)))),
                lambda: timed(lambda: write_raw(raw, shards)),
            ),
            ("stream", with_reader(store, stream_store), lambda: timed(lambda: stream_raw(raw))),
            (
                "stream_noprefetch",
                with_reader(store, lambda rd: stream_store(rd, prefetch=False)),
                lambda: timed(lambda: stream_raw(raw)),
            ),
            (
                "random",
                with_reader(store, lambda rd: random_store(rd, order)),
                lambda: timed(lambda: random_raw(raw, shards, order)),
            ),
        ]
        for what, on_store, on_raw in steps:
            sides = [("store", on_store), ("raw", on_raw)]
            for k in range(1 if what == "write" else 3):  # reads are cheap: more tries
                for side, fn in sides if (r + k) % 2 == 0 else sides[::-1]:  # each side first in turn
                    keep(f"{side}_{what}", fn())
    assert stream_raw(raw) == total
    mb = total / 1e6
    out = {"chunk_mb": chunk_mb, "MB": round(mb, 1)}
    for what in ("write", "stream", "stream_noprefetch", "random"):
        store_s, raw_s = best[f"store_{what}"], best[f"raw_{what}"]
        out[f"{what}_store_MBps"] = round(mb / store_s)
        out[f"{what}_raw_MBps"] = round(mb / raw_s)
        out[f"{what}_ratio"] = round(raw_s / store_s, 3)
    return out


def stream_tokens(reader, dequantize: bool = True) -> int:
    """Stream every sample; tokens read. `dequantize`: bf16 states whatever the scheme (int8
    dequantised on the CPU, in the prefetch thread); False: states as stored (int8 + scales,
    the trainer's batches, dequantised on its device after the copy)."""
    import torch

    want = torch.bfloat16 if dequantize or reader.state_dtype == "bfloat16" else torch.int8
    n = 0
    for s in reader.iter_samples(reader.shard_names(), dequantize=dequantize):
        n += len(s["input_ids"])
        assert s["aux"].dtype == s["final"].dtype == want
    return n


def bench_schemes(root: Path, n: int, tokens: int, hidden: int, chunk_mb: float, repeats: int) -> dict:
    """Bytes per token and streaming tokens/s of an int8 store / a bf16 store of the same samples."""
    from storage.store import HiddenStateStore

    shutil.rmtree(root, ignore_errors=True)
    schemes = ("bfloat16", "int8")
    out: dict = {"compare": "int8 / bf16 store", "tokens": n * tokens, "hidden": hidden, "aux_layers": 3}
    for scheme in schemes:
        write_store(
            root / scheme, make_shards(n, tokens, hidden, state_dtype=scheme), hidden, int(chunk_mb * (1 << 20)), scheme
        )
        summary = HiddenStateStore(str(root / scheme)).summary()
        files = sum(f.stat().st_size for f in (root / scheme / "shards").rglob("*") if f.is_file())
        out[f"{scheme}_bytes_per_token"] = round(summary["bytes"] / summary["tokens"], 1)
        out[f"{scheme}_file_bytes_per_token"] = round(files / summary["tokens"], 1)
    # bf16 reads the same either way (bit patterns reinterpreted); int8 decoded or as stored
    sides = {
        "bfloat16": lambda rd: stream_tokens(rd),
        "int8": lambda rd: stream_tokens(rd),
        "int8_stored": lambda rd: stream_tokens(rd, dequantize=False),
    }
    best = dict.fromkeys(sides, float("inf"))
    for r in range(repeats * 3):
        for side in list(sides) if r % 2 == 0 else list(sides)[::-1]:  # each first in turn
            store = root / ("int8" if side.startswith("int8") else side)
            best[side] = min(best[side], with_reader(store, sides[side])())
    for side in sides:
        out[f"{side}_stream_tokens_per_s"] = round(n * tokens / best[side])
    out["bytes_per_token_ratio"] = round(out["int8_bytes_per_token"] / out["bfloat16_bytes_per_token"], 4)
    out["file_bytes_ratio"] = round(out["int8_file_bytes_per_token"] / out["bfloat16_file_bytes_per_token"], 4)
    out["stream_tokens_per_s_ratio"] = round(best["bfloat16"] / best["int8"], 3)
    out["stream_stored_tokens_per_s_ratio"] = round(best["bfloat16"] / best["int8_stored"], 3)
    return out


def array_paths(root: Path) -> dict[str, dict[str, str]]:
    """shard -> array -> its folder, for the committed shards of the store at `root`."""
    from storage.reader import TOKEN_ARRAYS, StoreReader
    from storage.states import STATE_ARRAYS

    reader = StoreReader(str(root))
    keys = (*TOKEN_ARRAYS, *STATE_ARRAYS[reader.state_dtype])
    return {name: {k: str(root / "shards" / name / k) for k in keys} for name in reader.shard_names()}


def ts_open(path: str, context):
    import tensorstore as ts

    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}
    return ts.open(spec, open=True, read=True, context=context).result()


def direct_open(fs, path: str):
    from storage import zarr_direct

    lay = zarr_direct.layout_of(path, zarr_direct.read_json(fs, f"{path}/zarr.json"))
    assert lay is not None, f"{path}: not a layout zarr_direct reads"
    return lay


def stream_direct(paths: dict) -> int:
    from fsspec.implementations.local import LocalFileSystem

    from storage import zarr_direct

    fs, n = LocalFileSystem(), 0
    for arrays in paths.values():
        for path in arrays.values():
            n += zarr_direct.read_whole(fs, direct_open(fs, path)).nbytes
    return n


def stream_ts(paths: dict, context) -> int:
    n = 0
    for arrays in paths.values():
        handles = [ts_open(p, context) for p in arrays.values()]  # opened per shard, like the reader
        n += sum(h.read().result().nbytes for h in handles)
    return n


def sample_rows(root: Path, paths: dict) -> list[tuple[str, int, int]]:
    """(shard, first row, end row) of every sample, shuffled."""
    from storage.reader import StoreReader

    reader = StoreReader(str(root))
    rows = []
    for name in paths:
        off = reader.read_shard(name)["offsets"]
        rows += [(name, int(off[i]), int(off[i + 1])) for i in range(len(off) - 1)]
    random.Random(0).shuffle(rows)
    return rows


def random_direct(paths: dict, rows) -> int:
    from fsspec.implementations.local import LocalFileSystem

    from storage import zarr_direct

    fs, n, readers = LocalFileSystem(), 0, {}
    for name, a, b in rows:
        if name not in readers:
            readers[name] = {
                k: zarr_direct.RowReader(fs, direct_open(fs, p)) for k, p in paths[name].items() if k != "offsets"
            }
        n += sum(r.rows(a, b).nbytes for r in readers[name].values())
    return n


def random_ts(paths: dict, rows, context) -> int:
    n, handles = 0, {}
    for name, a, b in rows:
        if name not in handles:
            handles[name] = {k: ts_open(p, context) for k, p in paths[name].items() if k != "offsets"}
        n += sum(h[a:b].read().result().nbytes for h in handles[name].values())
    return n


def bench_tensorstore(root: Path, n: int, samples: int, tokens: int, hidden: int, repeats: int) -> dict:
    """TensorStore's zarr3 driver / storage.zarr_direct on the same store (module doc)."""
    import tensorstore as ts

    shutil.rmtree(root, ignore_errors=True)
    store = root / "store"
    shards = make_shards(n, samples * tokens, hidden, samples_per_shard=samples)
    total = sum(s.nbytes for s in shards)
    write_store(store, shards, hidden, 1 << 20)
    del shards
    paths, context = array_paths(store), ts.Context()
    rows = sample_rows(store, paths)
    # The same bytes both ways, and TensorStore reads what the store wrote, value for value.
    assert stream_direct(paths) == stream_ts(paths, context)
    first = next(iter(paths.values()))
    from fsspec.implementations.local import LocalFileSystem

    from storage import zarr_direct

    fs = LocalFileSystem()
    for k, p in first.items():
        assert np.array_equal(zarr_direct.read_whole(fs, direct_open(fs, p)), ts_open(p, context).read().result())
    steps = {
        "stream": {"direct": lambda: stream_direct(paths), "tensorstore": lambda: stream_ts(paths, context)},
        "random": {
            "direct": lambda: random_direct(paths, rows),
            "tensorstore": lambda: random_ts(paths, rows, context),
        },
    }
    best: dict[str, float] = {}
    for r in range(repeats * 3):
        for what, sides in steps.items():
            for side in list(sides) if r % 2 == 0 else list(sides)[::-1]:  # each first in turn
                best[f"{side}_{what}"] = min(best.get(f"{side}_{what}", float("inf")), timed(sides[side]))
    out: dict = {
        "compare": "tensorstore / zarr_direct",
        "shards": n,
        "samples_per_shard": samples,
        "tokens_per_sample": tokens,
        "hidden": hidden,
        "MB": round(total / 1e6, 1),
        "random_reads": len(rows),
    }
    for what in steps:
        mb = total / 1e6
        out[f"{what}_direct_MBps"] = round(mb / best[f"direct_{what}"])
        out[f"{what}_tensorstore_MBps"] = round(mb / best[f"tensorstore_{what}"])
        out[f"{what}_ratio"] = round(best[f"direct_{what}"] / best[f"tensorstore_{what}"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--chunk-mb", type=float, nargs="+", default=[1])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--tensorstore", action="store_true", help="also TensorStore vs zarr_direct (module doc)")
    ap.add_argument("--ts-shards", type=int, default=2)
    ap.add_argument("--ts-samples", type=int, default=64, help="samples per shard (capture.shard_samples)")
    ap.add_argument("--ts-tokens", type=int, default=512, help="tokens per sample")
    ap.add_argument("--ts-hidden", type=int, default=4096)
    ap.add_argument("--only", choices=["all", "schemes", "tensorstore"], default="all")
    args = ap.parse_args()
    shards = make_shards(args.shards, args.tokens, args.hidden)
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_store_"))
    try:
        if args.only == "all":
            bench(base / "warmup", make_shards(1, 64, 8), 8, 1, 1)  # imports and first-call costs, untimed
            for chunk_mb in args.chunk_mb:
                print(bench(base / f"c{chunk_mb}", shards, args.hidden, chunk_mb, args.repeats), flush=True)
        if args.only in ("all", "schemes"):
            bench_schemes(base / "warmup-schemes", 1, 64, 8, 1, 1)  # untimed, as above
            print(
                bench_schemes(base / "schemes", args.shards, args.tokens, args.hidden, args.chunk_mb[0], args.repeats),
                flush=True,
            )
        if args.tensorstore or args.only == "tensorstore":
            bench_tensorstore(base / "warmup-ts", 1, 2, 16, 8, 1)  # untimed, as above
            print(
                bench_tensorstore(
                    base / "ts", args.ts_shards, args.ts_samples, args.ts_tokens, args.ts_hidden, args.repeats
                ),
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
