"""Store throughput vs raw sequential file I/O of the same bytes, in one run.

    python -m bench.bench_store [--dir /tmp/x] [--shards 4] [--tokens 4096] [--hidden 1024] [--chunk-mb 1 4 16]

Writes `--shards` capture shards (3 aux + final bf16 states of `--hidden`, plus ids/mask/
offsets) with storage.HiddenStateStore, and the same arrays' bytes as plain files with
one sequential write each; then reads both back whole (streaming by shard). Prints MB/s of
each and the ratios store/raw for every chunk size (aims: >= 0.66 write, >= 0.5 read).
Both sides go through the page cache (no fsync), as the store does.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np


def make_shards(n: int, tokens: int, hidden: int, samples_per_shard: int = 16):
    from storage.store import ShardData

    rng = np.random.default_rng(0)
    out = []
    for s in range(n):
        lengths = np.full(samples_per_shard, tokens // samples_per_shard)
        lengths[-1] += tokens - lengths.sum()
        out.append(ShardData(
            sample_ids=[f"s{s}-{i}" for i in range(samples_per_shard)],
            input_ids=rng.integers(0, 50000, tokens, dtype=np.int32),
            loss_mask=rng.integers(0, 2, tokens, dtype=np.uint8),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            # Random normal floats as bf16 bits (realistic exponents; not compressible by chance).
            aux=(rng.standard_normal((tokens, 3 * hidden), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16),
            final=(rng.standard_normal((tokens, hidden), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)))
    return out


def bench(root: Path, shards, hidden: int, chunk_mb: float) -> dict:
    from storage.reader import StoreReader
    from storage.store import HiddenStateStore

    total = sum(s.nbytes for s in shards)
    prov = {"hidden_size": hidden, "capture_layer_ids": [1, 2, 3], "final_is_normed": True,
            "target": {}}
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    store = HiddenStateStore.create_or_open(str(root / "store"), prov)
    t = time.perf_counter()
    for k, s in enumerate(shards):
        store.commit([store.write_shard(f"{k:06d}", s, chunk_bytes=int(chunk_mb * (1 << 20)))])
    store_w = time.perf_counter() - t

    raw = root / "raw"
    raw.mkdir()
    t = time.perf_counter()
    for k, s in enumerate(shards):
        for name in ("input_ids", "loss_mask", "offsets", "aux", "final"):
            with open(raw / f"{k}-{name}", "wb") as f:
                f.write(getattr(s, name).tobytes())
    raw_w = time.perf_counter() - t

    t = time.perf_counter()
    n = sum(sum(a.nbytes for k, a in d.items() if k not in ("shard", "sample_ids"))
            for d in StoreReader(str(root / "store")).iter_shards())
    store_r = time.perf_counter() - t
    assert n == total, (n, total)
    t = time.perf_counter()
    m = sum(len(p.read_bytes()) for p in sorted(raw.iterdir()))
    raw_r = time.perf_counter() - t
    assert m == total
    mb = total / 1e6
    return {"chunk_mb": chunk_mb, "MB": round(mb, 1), "store_write_MBps": round(mb / store_w), "raw_write_MBps": round(mb / raw_w),
            "write_ratio": round(raw_w / store_w, 3), "store_read_MBps": round(mb / store_r),
            "raw_read_MBps": round(mb / raw_r), "read_ratio": round(raw_r / store_r, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--chunk-mb", type=float, nargs="+", default=[0.25, 1, 4, 16])
    args = ap.parse_args()
    shards = make_shards(args.shards, args.tokens, args.hidden)
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_store_"))
    try:
        for chunk_mb in args.chunk_mb:
            print(bench(base / f"c{chunk_mb}", shards, args.hidden, chunk_mb), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
