"""Stage `capture`: the target's hidden states for every sample, into the Zarr store.

    python -m workflows.capture [hydra overrides]                      # like workflows.full
    python -m workflows.capture target=kimi_k25_int4 capture.estimate_only=true \
        capture.estimate_tokens=88000000                               # size only, no target

Ray Data feeds shard plans (whole groups of samples, fixed by the corpus) to an actor pool
of capture engines (`capture.actors` actors, `capture.cpus_per_actor` / `gpus_per_actor`
each). Each actor writes complete shards (see workflows.capture.writer); the driver commits
each returned shard to the manifest. A rerun skips committed shards, commits shards whose
writer finished but were never committed, and rewrites half-written ones. The store is then
verified; the stage is marked done only when `verify` is clean.
Output: the store (`capture.store`, default `<run_dir>/store`) and `<run_dir>/capture/`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path

from eagle3.layer_ids import validate_capture_ids
from eagle3.schema import ConfigError
from storage.store import HiddenStateStore, sample_ids_hash
from storage.verify import verify
from storage.zarr_io import is_remote
from workflows.capture.writer import ShardPlan, capture_and_write
from workflows.core.cli import log
from workflows.core.cluster import ensure_ray
from workflows.core.config import FullConfig
from workflows.core.engines import EngineSpec, engine_class
from workflows.core.errors import InputError
from workflows.core.layout import RunLayout
from workflows.core.markers import (
    clear_done,
    mark_done,
    stage_is_done,
    write_json_atomic,
)
from workflows.core.precision import engine_dtype
from workflows.core.provenance import CAPTURE_CONTRACT, identity_for, store_provenance
from workflows.core.targets import check_checkpoint, prepare_for

STATE_BYTES = 2  # bf16


def bytes_per_token(n_aux: int, hidden_size: int) -> int:
    """aux + final states (bf16) + input id (int32) + loss mask (uint8)."""
    return STATE_BYTES * (n_aux + 1) * hidden_size + 4 + 1


def estimate(cfg: FullConfig, tokens: int) -> dict:
    n_aux, h = len(cfg.target.capture_ids), cfg.target.hidden_size
    per_token = bytes_per_token(n_aux, h)
    return {"target": cfg.target.name, "num_layers": cfg.target.num_layers, "hidden_size": h,
            "capture_layer_ids": cfg.target.capture_ids, "states_per_token": f"{n_aux} aux + final",
            "bytes_per_token": per_token, "tokens": tokens, "projected_bytes": per_token * tokens,
            "projected": f"{per_token * tokens / 1e12:.3f} TB ({per_token * tokens / 2**40:.3f} TiB)"}


def check_space(dest: str, needed: int, ignore: bool) -> dict:
    """Refuse to start when the destination's filesystem has less free space than needed."""
    if is_remote(dest):
        return {"free_bytes": None, "note": "object store: free space not checked"}
    probe = Path(dest).resolve()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free and not ignore:
        raise ConfigError(
            f"capture.store={dest}: the capture needs ~{needed / 1e9:.2f} GB but {probe} has {free / 1e9:.2f} GB "
            "free; free space, choose another capture.store, or set capture.ignore_space=true"
        )
    return {"free_bytes": free, "needed_bytes": needed, "enough": needed <= free}


def plan_shards(samples: list[dict], shard_samples: int) -> tuple[list[ShardPlan], dict]:
    """Fixed groups of `shard_samples` samples in corpus order; names carry their ids' hash."""
    skipped = {"empty_sample": 0}
    kept = []
    for k, r in enumerate(samples):
        if len(r["input_ids"]) != len(r["loss_mask"]):
            raise InputError(f"corpus row {k} (id {r['id']!r}): field input_ids has {len(r['input_ids'])} "
                             f"tokens but loss_mask {len(r['loss_mask'])}")
        if not r["input_ids"]:
            skipped["empty_sample"] += 1
            continue
        kept.append(r)
    plans = []
    for k in range(0, len(kept), shard_samples):
        rows = kept[k : k + shard_samples]
        ids = [str(r["id"]) for r in rows]
        plans.append(ShardPlan(name=f"{k // shard_samples:06d}-{sample_ids_hash(ids)[:8]}", sample_ids=ids,
                               input_ids=[list(r["input_ids"]) for r in rows],
                               loss_mask=[list(r["loss_mask"]) for r in rows]))
    return plans, skipped


def corpus_hash(plans: list[ShardPlan]) -> str:
    h = hashlib.sha256()
    for p in plans:
        for sid, ids in zip(p.sample_ids, p.input_ids):
            h.update(f"{sid}:{len(ids)}:{hash(tuple(ids))}\n".encode())
    return h.hexdigest()[:16]


class CaptureActor:
    """One capture engine in a Ray actor: each call captures and writes whole shards."""

    def __init__(self, store_url: str, storage_options: dict, backend: str, engine: dict, chunk_bytes: int,
                 compression: str, fail_after_shards: int | None):
        self.engine = engine_class(backend)(EngineSpec(**engine))
        self.store = HiddenStateStore.open(store_url, storage_options)
        self.chunk_bytes, self.compression = chunk_bytes, compression
        self.fail_after, self.done = fail_after_shards, 0
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.metrics = _metrics()

    def __call__(self, batch) -> dict:
        import numpy as np

        plans = [ShardPlan(**r) for r in batch.to_pylist()]

        def fault(k):  # fault injection for the resume tests (capture.fail_after_shards)
            if self.fail_after is not None and self.done + k >= self.fail_after:
                raise RuntimeError(f"capture.fail_after_shards={self.fail_after}: simulated crash")

        rows = capture_and_write(self.engine, self.store, plans, self.chunk_bytes, self.compression, fault)
        self.done += len(rows)
        for r in rows:
            r["actor"] = self.name
            if self.metrics:
                tags = {"actor": self.name}
                self.metrics["tokens"].inc(r["n_tokens"], tags=tags)
                self.metrics["bytes"].inc(r["nbytes"], tags=tags)
                self.metrics["tps"].set(r["n_tokens"] / max(r["compute_seconds"], 1e-9), tags=tags)
        return {k: np.array([r[k] for r in rows], dtype=object) for k in rows[0]}


def _metrics():
    """Ray metrics (shown by the dashboard's Prometheus/Grafana view); None if unavailable."""
    try:
        from ray.util.metrics import Counter, Gauge

        return {"tokens": Counter("eagle3_capture_tokens", "tokens captured", tag_keys=("actor",)),
                "bytes": Counter("eagle3_capture_bytes", "bytes written to the store", tag_keys=("actor",)),
                "tps": Gauge("eagle3_capture_tokens_per_s", "tokens/s of the last shard", tag_keys=("actor",))}
    except Exception:  # metrics are a convenience, never a reason to fail a capture
        return None


def run(cfg: FullConfig, target_path: Path) -> Path:
    from tqdm import tqdm

    layout = RunLayout.of(cfg)
    c, out, url = cfg.capture, layout.stage_dir("capture"), layout.store_url
    check_checkpoint(cfg.target, Path(target_path))
    validate_capture_ids(cfg.target.capture_ids, cfg.target.num_layers, "target.capture_layer_ids")
    plans, skipped = plan_shards(layout.read_corpus(), c.shard_samples)
    if not plans:
        raise InputError(f"{layout.corpus_shards}: the corpus has no non-empty sample to capture")
    plan = {"shard_samples": c.shard_samples, "corpus_sha256": corpus_hash(plans)}
    prov = store_provenance(cfg, identity_for(cfg, target_path), plan, engine_class(c.backend).version())
    key = {**{k: v for k, v in prov.items() if k != "code_version"}, "store": url, **layout.chain("generate")}
    if stage_is_done(out, key):
        log(f"capture: reusing {url}")
        return out
    clear_done(out)
    store = HiddenStateStore.create_or_open(url, prov, c.storage_options, checked=(*CAPTURE_CONTRACT, "plan"))
    committed = store.committed()
    adopted = [row for p in plans if p.name not in committed and (row := store.completed_row(p.name))]
    if adopted:  # writers finished, the driver died before committing them
        store.commit(adopted)
        committed = store.committed()
    pending = [p for p in plans if p.name not in committed]
    for p in pending:
        store.remove_shard(p.name)  # half-written leftovers of a killed writer
    size = estimate(cfg, sum(p.n_tokens for p in pending))
    space = check_space(url, size["projected_bytes"], c.ignore_space)
    log(f"capture: {len(plans)} shards ({len(committed)} committed, {len(adopted)} adopted, {len(pending)} to "
        f"do), {size['bytes_per_token']} B/token, {size['projected']} to write, skipped {skipped}")
    started, rows = time.perf_counter(), []
    if pending:
        rows = _capture_with_ray(cfg, target_path, store, pending, tqdm)
    report = verify(url, c.storage_options)
    per_actor: dict[str, dict] = {}
    for r in rows:
        a = per_actor.setdefault(r["actor"], {"shards": 0, "tokens": 0, "bytes": 0, "compute_s": 0.0, "write_s": 0.0})
        a["shards"] += 1
        a["tokens"] += int(r["n_tokens"])
        a["bytes"] += int(r["nbytes"])
        a["compute_s"] += float(r["compute_seconds"])
        a["write_s"] += float(r["write_seconds"])
    for a in per_actor.values():
        a["tokens_per_s"] = round(a["tokens"] / max(a["compute_s"], 1e-9), 1)
    summary = {**store.summary(), "store": url, "skipped": skipped, "new_shards": len(rows),
               "adopted_shards": len(adopted), "seconds": round(time.perf_counter() - started, 2),
               "per_actor": per_actor, "space": space, "verify_ok": report["ok"],
               "bytes_per_token": size["bytes_per_token"]}
    write_json_atomic(out / "summary.json", {**summary, "verify": report})
    if not report["ok"]:
        raise RuntimeError(f"capture: verify found {len(report['problems'])} problem(s), first: "
                           f"{report['problems'][0]}; see {out / 'summary.json'}")
    mark_done(out, key, summary)
    log(f"capture: {summary['samples']} samples, {summary['tokens']} tokens in {summary['shards']} shards; "
        f"per actor {per_actor}; verify clean")
    return out


def _capture_with_ray(cfg: FullConfig, target_path, store: HiddenStateStore, pending: list[ShardPlan], tqdm) -> list:
    import ray

    c = cfg.capture
    ensure_ray(cfg.cluster)
    ds = ray.data.from_items([vars(p) for p in pending])
    # One engine per actor, on the GPUs Ray gave it (an SGLang actor is one TP group).
    engine = {"target_path": str(target_path), "layer_ids": cfg.target.capture_ids, "dtype": engine_dtype(cfg),
              "micro_batch_tokens": c.micro_batch_tokens, "trust_remote_code": cfg.target.trust_remote_code,
              "threads": max(1, int(c.cpus_per_actor)), "device": "cuda" if c.gpus_per_actor else "cpu",
              "tp_size": cfg.target.tp_size if c.backend == "sglang" else 1, "seed": cfg.seed}
    results = ds.map_batches(
        CaptureActor, batch_size=c.shards_per_call, batch_format="pyarrow",
        fn_constructor_kwargs={"store_url": store.url, "storage_options": store.storage_options,
                               "backend": c.backend, "engine": engine, "chunk_bytes": int(c.chunk_mb * (1 << 20)),
                               "compression": c.compression, "fail_after_shards": c.fail_after_shards},
        compute=ray.data.ActorPoolStrategy(size=c.actors), num_cpus=c.cpus_per_actor,
        num_gpus=c.gpus_per_actor or None)
    rows = []
    bar = tqdm(total=sum(p.n_tokens for p in pending), desc="capture", unit="tok")
    for row in results.iter_rows():
        row = {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
        store.commit([{k: row[k] for k in ("shard", "n_samples", "n_tokens", "nbytes", "sample_ids_sha256",
                                           "writer", "write_seconds")}])
        rows.append(row)
        bar.update(int(row["n_tokens"]))
    bar.close()
    return rows


def capture_main(cfg: FullConfig) -> None:
    """`python -m workflows.capture`: the stage, or with capture.estimate_only the size only."""
    if not cfg.capture.estimate_only:
        run(cfg, prepare_for(cfg, log=log))
        return
    layout = RunLayout.of(cfg)
    tokens = cfg.capture.estimate_tokens
    if tokens is None:
        tokens = sum(len(r["input_ids"]) for r in layout.read_corpus())
    size = estimate(cfg, tokens)
    size["space"] = check_space(layout.store_url, size["projected_bytes"], ignore=True)
    print(json.dumps(size, indent=2))
