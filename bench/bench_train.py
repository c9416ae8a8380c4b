"""Training throughput from the store: Ray Train + DeepSpeed against the plain loop, and the
loader against what training consumes; all measured in one run, on the same data.

    python -m bench.bench_train --run-dir runs/smollm2_135m [--steps 40]

`--run-dir` is a run folder whose capture and vocab stages have finished (e.g. `python -m
workflows.full stages=[target,generate,capture,vocab]`); without it a small tiny-target
folder is built first. Each configuration trains a copy of the folder for `--steps` steps
(no checkpoint, one evaluation at the end); throughput is the logged tokens/s of the
steady-state steps (the first logging interval, with its start-up, is left out). Prints:

    ray(1 worker) / plain      at most 1.15x slower is the goal (same cores for both)
    loader / consumption       the loader's batches/s over the plain loop's steps/s, >= 3x
    ray(2 workers) / ray(1)    reported
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from workflows import full
from workflows.core.config import compose


def steady_tokens_per_s(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines() if line]
    rows = [r for r in rows if "tokens_per_s" in r and "eval" not in r][1:]  # past start-up, no eval inside
    if not rows:
        raise SystemExit("too few logged steps; raise --steps")
    return sum(r["tokens_per_s"] for r in rows) / len(rows)


def train_copy(source: Path, scratch: Path, name: str, base: list[str], *extra: str) -> float:
    dest = scratch / name
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("train", "multirun"))
    started = time.perf_counter()
    full.run(compose([*base, f"run_dir={dest}", "stages=[train]", *extra]))
    tps = steady_tokens_per_s(dest)
    final = json.loads((dest / "train" / "metrics.json").read_text())
    print(
        f"{name:16s} {tps:9.1f} tokens/s steady ({time.perf_counter() - started:.0f} s with start-up); "
        f"held-out walk acceptance {final['acceptance_walk']:.3f}, step-0 accuracy {final['step_acc'][0]:.3f}"
    )
    return tps


def loader_rate(run_dir: Path, base: list[str], batches: int) -> tuple[float, float]:
    """(batches/s, tokens/s) of one worker's stream alone, past its first batch."""
    from workflows.core.layout import RunLayout
    from workflows.train.data import BatchStream
    from workflows.train.trainer import batch_settings

    cfg = compose([*base, f"run_dir={run_dir}"])
    reader = RunLayout.of(cfg).open_store()
    stream = BatchStream(reader, reader.shard_names("train"), batch_settings(cfg.train, 0), cfg.seed, prefetch=1)
    next(stream)
    tokens, started = 0, time.perf_counter()
    for _ in range(batches):
        tokens += int(next(stream)["attention_mask"].sum())
    dt = time.perf_counter() - started
    stream.close()
    return batches / dt, tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path)
    ap.add_argument("--cache-dir", default=".cache")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2, help="cores for the plain loop and the 1-worker run")
    ap.add_argument("--overrides", nargs="*", default=[], help="more Hydra overrides for every run")
    a = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-train-"))
    base = [
        f"cache_dir={Path(a.cache_dir).resolve()}",
        "cluster.dashboard=false",
        "train.checkpoint_every=0",
        f"train.steps={a.steps}",
        f"train.eval_every={a.steps}",
        f"train.log_every={max(1, a.steps // 8)}",
        *a.overrides,
    ]
    source = a.run_dir
    if source is None:
        base = ["target=tiny", "mixture=bundled", "data.limit=48", "data.max_new_tokens=64", *base]
        source = scratch / "source"
        full.run(compose([*base, f"run_dir={source}", "stages=[target,generate,capture,vocab]"]))
    source = source.resolve()
    torch.set_num_threads(a.threads)
    plain = train_copy(source, scratch, "plain", base, "train.backend=local")
    ray1 = train_copy(
        source, scratch, "ray-1-worker", base, "train.num_workers=1", f"train.cpus_per_worker={a.threads}"
    )
    ray2 = train_copy(
        source, scratch, "ray-2-workers", base, "train.num_workers=2", f"train.cpus_per_worker={max(1, a.threads // 2)}"
    )
    steps_per_s = plain / max(1.0, tokens_per_step(scratch / "plain"))
    batches_per_s, loader_tps = loader_rate(source, base, batches=max(8, a.steps // 2))
    print(f"loader           {loader_tps:9.1f} tokens/s, {batches_per_s:.1f} batches/s")
    print(f"ray(1 worker) / plain tokens/s: {ray1 / plain:.3f}  (slowdown {plain / ray1:.3f}x; goal <= 1.15x)")
    print(f"loader / consumption (batches/s over plain steps/s): {batches_per_s / steps_per_s:.1f}x (goal >= 3x)")
    print(f"ray(2 workers) / ray(1 worker) tokens/s: {ray2 / ray1:.3f}")
    shutil.rmtree(scratch, ignore_errors=True)


def tokens_per_step(run_dir: Path) -> float:
    """Mean real tokens per optimizer step of a finished run (its metrics.jsonl)."""
    rows = [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines() if line]
    return sum(r["tokens"] for r in rows) / len(rows)


if __name__ == "__main__":
    main()
