"""Store throughput vs raw file I/O of the same bytes, measured in the same run.

    python -m bench.bench_store [--dir /tmp/x] [--shards 4] [--tokens 4096] [--hidden 1024]
                                [--chunk-mb 1] [--repeats 4]

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
data files on disk) and streaming tokens/s (iter_samples, prefetch on; int8 dequantised
to bf16 in the reader), int8 / bf16, interleaved and best of `--repeats` x 3 like the rest.
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


def stream_tokens(reader) -> int:
    """Stream every sample (the trainer's path): bf16 states whatever the scheme; tokens read."""
    import torch

    n = 0
    for s in reader.iter_samples(reader.shard_names()):
        n += len(s["input_ids"])
        assert s["aux"].dtype == s["final"].dtype == torch.bfloat16
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
    best = dict.fromkeys(schemes, float("inf"))
    for r in range(repeats * 3):
        for scheme in schemes if r % 2 == 0 else schemes[::-1]:  # each first in turn
            best[scheme] = min(best[scheme], with_reader(root / scheme, stream_tokens)())
    for scheme in schemes:
        out[f"{scheme}_stream_tokens_per_s"] = round(n * tokens / best[scheme])
    out["bytes_per_token_ratio"] = round(out["int8_bytes_per_token"] / out["bfloat16_bytes_per_token"], 4)
    out["file_bytes_ratio"] = round(out["int8_file_bytes_per_token"] / out["bfloat16_file_bytes_per_token"], 4)
    out["stream_tokens_per_s_ratio"] = round(best["bfloat16"] / best["int8"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--chunk-mb", type=float, nargs="+", default=[1])
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    shards = make_shards(args.shards, args.tokens, args.hidden)
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_store_"))
    try:
        bench(base / "warmup", make_shards(1, 64, 8), 8, 1, 1)  # imports and first-call costs, untimed
        for chunk_mb in args.chunk_mb:
            print(bench(base / f"c{chunk_mb}", shards, args.hidden, chunk_mb, args.repeats), flush=True)
        bench_schemes(base / "warmup-schemes", 1, 64, 8, 1, 1)  # untimed, as above
        print(
            bench_schemes(base / "schemes", args.shards, args.tokens, args.hidden, args.chunk_mb[0], args.repeats),
            flush=True,
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
