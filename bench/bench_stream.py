"""Streaming against a warm store: training tokens/s of `train.data_source=stream` over the
same training from the store, on the same machine, in one run; which side bounds the
stream, and its measured object-store peak over its budget.

    python -m bench.bench_stream --run-dir runs/smollm2_135m [--steps 40]

`--run-dir` is a run folder whose capture and vocab stages have finished (the warm store;
e.g. `python -m workflows.full stages=[target,generate,capture,vocab]`); without it a
tiny-target folder is built first. Both runs train copies of it for `--steps` steps with
`train.num_workers` workers (no checkpoint, one evaluation at the end); the stream's
engine actors (`capture.actors`, shared out over the workers) run beside them on the same
cores, so the ratio says what streaming costs where inference and training share a
machine: the split of cores is printed. Throughput is the logged tokens/s of the
steady-state steps (the first logging interval, with its start-up, left out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench.bench_train import steady_tokens_per_s
from workflows import full
from workflows.core.cluster import STREAM_SYSTEM_CONFIG, ensure_ray, stream_cpus
from workflows.core.config import compose


def train_copy(source: Path, scratch: Path, name: str, base: list[str], *extra: str) -> tuple[float, float]:
    dest = scratch / name
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("train", "multirun"))
    started = time.perf_counter()
    full.run(compose([*base, f"run_dir={dest}", "stages=[train]", *extra]))
    wall = time.perf_counter() - started
    tps = steady_tokens_per_s(dest)
    print(f"{name:8s} {tps:9.1f} training tokens/s steady ({wall:.0f} s with start-up)")
    return tps, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path)
    ap.add_argument("--cache-dir", default=".cache")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--overrides", nargs="*", default=[], help="more Hydra overrides for both runs")
    a = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    base = [
        f"cache_dir={Path(a.cache_dir).resolve()}",
        "cluster.dashboard=false",
        "train.checkpoint_every=0",
        f"train.steps={a.steps}",
        f"train.eval_every={a.steps}",
        f"train.log_every={max(1, a.steps // 8)}",
        *a.overrides,
    ]
    # This process's Ray, started first with a logical CPU for each trainer and engine actor
    # (as workflows.full does for a stream), serves the source's stages and both runs.
    probe = compose([*base, "run_dir=unused"]) if a.run_dir else compose(["target=tiny", *base, "run_dir=unused"])
    ensure_ray(probe.cluster, system_config=STREAM_SYSTEM_CONFIG, min_cpus=stream_cpus(probe))
    source = a.run_dir
    if source is None:
        base = ["target=tiny", "mixture=bundled", "data.limit=48", "data.max_new_tokens=64", *base]
        source = scratch / "source"
        full.run(compose([*base, f"run_dir={source}", "stages=[target,generate,capture,vocab]"]))
    source = source.resolve()
    cfg = compose([*base, f"run_dir={source}"])
    stream, stream_wall = train_copy(source, scratch, "stream", base, "train.data_source=stream")
    store, store_wall = train_copy(source, scratch, "store", base, "train.data_source=store")
    rates = json.loads((scratch / "stream" / "train" / "metrics.json").read_text())["stream"]
    summary = json.loads((scratch / "stream" / "train" / "stream" / "summary.json").read_text())
    t, c = cfg.train, cfg.capture
    actors = summary["actors_per_worker"] * t.num_workers
    print(
        f"cores: {os.cpu_count()} shared by {t.num_workers} training worker(s) x {t.cpus_per_worker:g} CPU and "
        f"{actors} engine actor(s) x {c.cpus_per_actor:g} CPU ({c.backend}, {cfg.target.name})"
    )
    ratio = f"{stream / store:.3f} (wall with start-up {stream_wall / store_wall:.2f}x)"
    print(f"stream / warm store training tokens/s: {ratio}")
    print(
        f"bound: {rates['bound']} (inference {rates['inference_tokens_per_s_per_actor']:.0f} tok/s per engine actor, "
        f"training {rates['training_tokens_per_s_per_worker']:.0f} tok/s per worker; "
        f"{rates['actors_per_worker_suggested']} engine actor(s) per worker suggested)"
    )
    peak, budget = summary["peak_object_store_bytes"], summary["budget_bytes"]
    print(f"peak object store / budget: {peak / budget:.4f} ({peak / 2**20:.2f} of {budget / 2**20:.0f} MiB)")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
