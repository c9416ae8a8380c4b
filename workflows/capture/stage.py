"""Stage `capture`: the target's hidden states for every sample, into the Zarr store.

    python -m workflows.capture [hydra overrides]                      # like workflows.full
    python -m workflows.capture target=kimi_k25_int4 capture.estimate_only=true \
        capture.estimate_tokens=88000000                               # size only, no target

The driver plans the corpus one generate shard at a time into `capture/plan.parquet`: shard
refs (name, sample ids, and where each sample is in the generate shards), no tokens. Ray
Data reads the refs still to do and feeds them to an actor pool of capture engines
(`capture.actors` actors, `capture.cpus_per_actor` / `gpus_per_actor` each). Each actor
reads its samples, writes complete shards (see workflows.capture.writer) and returns one
small row per shard; the driver commits each to the manifest's log. A shard that fails is
retried once by its actor, then reported: the others finish, the stage ends with an error
naming the failed shards (also in `capture/summary.json`). A killed actor is restarted and
its batch rerun (`capture.max_actor_restarts`). A rerun skips committed shards, commits
shards whose writer finished but were never committed, and rewrites half-written or failed
ones. The store is then verified and spot-checked (workflows.capture.spot_check: a few
samples recomputed by HF in the driver, every captured layer compared); the stage is marked
done only when both are clean.
Output: the store (`capture.store`, default `<run_dir>/store`) and `<run_dir>/capture/`.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
import warnings
from pathlib import Path

from eagle3.layer_ids import validate_capture_ids
from eagle3.schema import ConfigError, output_dict
from storage.reader import StoreReader
from storage.store import HiddenStateStore, state_dtype_of
from storage.verify import verify
from workflows.capture.sizing import (
    check_space,
    corpus_figures,
    estimate,
    longest_sample,
    measured_capture_tokens_per_s,
    projection,
)
from workflows.capture.spot_check import available_memory, checkpoint_parameters, skip_reason, spot_check
from workflows.capture.writer import CorpusFiles, ShardRef, capture_and_write
from workflows.core.cluster import ensure_ray
from workflows.core.config import FullConfig
from workflows.core.engine_spec import EngineSpec
from workflows.core.engines import engine_class
from workflows.core.errors import InputError, StageFailure
from workflows.core.layout import RunLayout
from workflows.core.log import log
from workflows.core.markers import (
    run_stage,
    write_json_atomic,
)
from workflows.core.provenance import CAPTURE_CONTRACT, store_provenance, target_identity
from workflows.core.shard_plan import plan_corpus, select_plans
from workflows.core.shard_states import engine_spec
from workflows.core.stage_metrics import StageMetrics
from workflows.core.targets import check_checkpoint, prepare_for


class CaptureActor:
    """One capture engine in a Ray actor: each call captures and writes whole shards."""

    def __init__(
        self,
        store_url: str,
        storage_options: dict,
        backend: str,
        engine: dict,
        chunk_bytes: int,
        compression: str,
        corpus_folder: str,
    ):
        self.engine = engine_class(backend)(EngineSpec(**engine))
        self.store = HiddenStateStore.open(store_url, storage_options)
        self.state_dtype = state_dtype_of(self.store.provenance, f"store {store_url}")  # written as the store says
        self.corpus = CorpusFiles(corpus_folder)
        self.chunk_bytes, self.compression = chunk_bytes, compression
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.metrics = _metrics()

    def __call__(self, batch) -> dict:
        import numpy as np

        refs = [ShardRef(**r) for r in batch.to_pylist()]
        # A failing shard is retried once here, then returned as an error record: the pool
        # keeps going and the driver reports it at the end. (A dead actor is Ray's to restart.)
        rows = capture_and_write(
            self.engine,
            self.store,
            refs,
            self.chunk_bytes,
            self.compression,
            retries=1,
            load=self.corpus.load,
            state_dtype=self.state_dtype,
        )
        for r in rows:
            r["actor"] = self.name
            # How this actor's engine works, for the summary: engines started (SGLang: one per
            # actor for the stage) and where the final state came from.
            r["engine_starts"] = int(getattr(self.engine, "engine_starts", 1))
            r["final_state"] = getattr(self.engine, "final_method", None) or "forward"
            # The ids the engine reports its stored blocks hold (SGLang: from the layers its model
            # set up to capture; JSON: None where it cannot tell), checked and recorded by the driver.
            r["captured_layer_ids"] = json.dumps(getattr(self.engine, "captured_layer_ids", None))
            r["layers_to_capture"] = json.dumps(getattr(self.engine, "layers_to_capture", None))  # SGLang's own
            if self.metrics and not r["error"]:
                tags = {"actor": self.name}
                self.metrics["tokens"].inc(r["n_tokens"], tags=tags)
                self.metrics["bytes"].inc(r["nbytes"], tags=tags)
                self.metrics["tps"].set(r["n_tokens"] / max(r["compute_seconds"], 1e-9), tags=tags)
        return {k: np.array([r[k] for r in rows], dtype=object) for k in rows[0]}


def shown(names: list[str], first: int = 8) -> str:
    """The first names of a long list, and how many more: one line even for 10,000 shards."""
    more = f" and {len(names) - first} more" if len(names) > first else ""
    return ", ".join(names[:first]) + more


def _metrics():
    """Ray metrics (shown by the dashboard's Prometheus/Grafana view); None if unavailable."""
    try:
        from ray.util.metrics import Counter, Gauge

        return {
            "tokens": Counter("eagle3_capture_tokens", "tokens captured", tag_keys=("actor",)),
            "bytes": Counter("eagle3_capture_bytes", "bytes written to the store", tag_keys=("actor",)),
            "tps": Gauge("eagle3_capture_tokens_per_s", "tokens/s of the last shard", tag_keys=("actor",)),
        }
    except Exception:  # metrics are a convenience, never a reason to fail a capture
        return None


class Results:
    """What the driver keeps of the returned rows: per-actor totals and the failed shards."""

    def __init__(self):
        self.per_actor: dict[str, dict] = {}
        self.failed: list[dict] = []
        self.new = 0

    def add(self, row: dict) -> None:
        if row["error"]:
            self.failed.append({"shard": row["shard"], "actor": row["actor"], "error": row["error"]})
            return
        self.new += 1
        a = self.per_actor.setdefault(
            row["actor"], {"shards": 0, "tokens": 0, "bytes": 0, "compute_s": 0.0, "write_s": 0.0}
        )
        a["shards"] += 1
        a["tokens"] += int(row["n_tokens"])
        a["bytes"] += int(row["nbytes"])
        a["compute_s"] += float(row["compute_seconds"])
        a["write_s"] += float(row["write_seconds"])
        a["engine_starts"] = max(a.get("engine_starts", 0), int(row.get("engine_starts", 1)))
        a["final_state"] = row.get("final_state", "forward")
        a["captured_layer_ids"] = json.loads(row.get("captured_layer_ids") or "null")
        a["layers_to_capture"] = json.loads(row.get("layers_to_capture") or "null")

    def per_actor_summary(self) -> dict[str, dict]:
        return {
            name: {**a, "tokens_per_s": round(a["tokens"] / max(a["compute_s"], 1e-9), 1)}
            for name, a in self.per_actor.items()
        }


def run(cfg: FullConfig, target_path: Path) -> Path:
    from tqdm import tqdm

    layout = RunLayout.of(cfg)
    c, out, url = cfg.capture, layout.stage_dir("capture"), layout.store_url
    check_checkpoint(cfg.target, Path(target_path))
    ids = cfg.store_capture_ids  # the union of the drafters' layers (capture.families)
    validate_capture_ids(ids, cfg.target.num_layers, "the store's capture ids")
    out.mkdir(parents=True, exist_ok=True)
    plans, skipped, corpus_sha, plan_file = plan_corpus(layout, c.shard_samples, out)
    if not plans:
        raise InputError(f"{layout.corpus_shards}: the corpus has no non-empty sample to capture")
    plan = {"shard_samples": c.shard_samples, "corpus_sha256": corpus_sha}
    prov = store_provenance(
        cfg.target, c, target_identity(target_path, cfg.cache_path), plan, engine_class(c.backend).version(), ids
    )
    # The provenance records the whole capture config; the key holds its output settings
    # only (eagle3.schema.NOT_OUTPUT: a raised timeout or more actors reuse the store).
    key = {
        **{k: v for k, v in prov.items() if k not in ("code_version", "config")},
        "config": output_dict(c),
        "store": url,
        **layout.chain("generate"),
    }

    def build() -> dict:
        store = HiddenStateStore.create_or_open(url, prov, c.storage_options, checked=(*CAPTURE_CONTRACT, "plan"))
        committed = store.committed()
        adopted = [row for name, _ in plans if name not in committed and (row := store.completed_row(name))]
        if adopted:  # writers finished, the driver died before committing them
            store.commit(adopted)
            committed = store.committed()
        pending = [(name, n) for name, n in plans if name not in committed]
        for name, _ in pending:
            store.remove_shard(name)  # half-written leftovers of a killed writer
        size = estimate(cfg.target, c, sum(n for _, n in pending), ids)
        space = check_space(url, size["projected_bytes"], c.ignore_space)
        log(
            f"capture: {len(plans)} shards ({len(committed)} committed, {len(adopted)} adopted, {len(pending)} to "
            f"do), {size['bytes_per_token']} B/token ({c.state_dtype}), {size['projected']} to write, skipped {skipped}"
        )
        started, result = time.perf_counter(), Results()
        if pending:
            todo = select_plans(plan_file, {name for name, _ in pending}, out / "pending.parquet")
            result = _capture_with_ray(cfg, target_path, store, todo, size["tokens"], tqdm)
        store.compact()  # fold the per-shard commit log into manifest.parquet, once
        per_actor = result.per_actor_summary()
        captured = record_captured_layers(store, ids, per_actor)
        result.failed.sort(key=lambda f: f["shard"])
        summary = {
            **store.summary(),
            "store": url,
            "skipped": skipped,
            "new_shards": result.new,
            "adopted_shards": len(adopted),
            "seconds": round(time.perf_counter() - started, 2),
            "per_actor": per_actor,
            "space": space,
            "failed_shards": result.failed,
            "bytes_per_token": size["bytes_per_token"],
            "state_dtype": c.state_dtype,
            "engine_captured_layer_ids": captured,
        }
        if result.failed:  # the other shards are committed; a rerun retries only these
            write_json_atomic(layout.capture_summary_file, {**summary, "verify_ok": None})
            names = [f["shard"] for f in result.failed]
            raise StageFailure(
                f"capture: {len(names)} shard(s) failed twice: {shown(names)}; first error: "
                f"{result.failed[0]['error']}; the others are committed: fix the cause (free space, "
                f"a dead node) and rerun, which captures only these; details in {layout.capture_summary_file}"
            )
        report = verify(url, c.storage_options)
        summary["verify_ok"] = report["ok"]
        write_json_atomic(layout.capture_summary_file, {**summary, "verify": report})
        if not report["ok"]:
            raise StageFailure(
                f"capture: verify found {len(report['problems'])} problem(s), first: "
                f"{report['problems'][0]}; see {layout.capture_summary_file}; `python -m storage.verify "
                f"{url}` lists them, and a rerun with capture.store moved away captures afresh"
            )
        try:
            summary["spot_check"] = run_spot_check(cfg, target_path, url)
        except StageFailure as exc:
            summary["spot_check"] = {"ran": True, "failed": str(exc)}
            raise
        finally:
            write_json_atomic(layout.capture_summary_file, {**summary, "verify": report})
        log(
            f"capture: {summary['samples']} samples, {summary['tokens']} tokens in {summary['shards']} shards; "
            f"per actor {per_actor}; verify clean"
        )
        return summary

    return run_stage("capture", out, key, build, shown=url)


def record_captured_layers(store: HiddenStateStore, ids: list[int], per_actor: dict) -> list[int] | None:
    """Check the ids this run's engines report capturing against the store's and record them in
    its provenance (`engine_captured_layer_ids`: the doctor and the train side compare drafts
    with them); returns what the store records (an earlier run's, when no shard was new here)."""
    reported = {name: a["captured_layer_ids"] for name, a in per_actor.items() if a.get("captured_layer_ids")}
    for name, got in reported.items():
        if got != list(ids):
            raise StageFailure(
                f"capture: actor {name}'s engine reports capturing ids {got} where the store's capture ids are "
                f"{list(ids)}: its shards hold other layers' states; fix the layer-id rule, move capture.store "
                "away and recapture"
            )
    if reported:
        inputs = next((a["layers_to_capture"] for a in per_actor.values() if a.get("layers_to_capture")), None)
        store.record(
            {"engine_captured_layer_ids": list(ids)}
            | ({"engine_layers_to_capture": inputs} if inputs else {})  # SGLang's own list: inputs of layers
        )
    return store.provenance.get("engine_captured_layer_ids")


def run_spot_check(cfg: FullConfig, target_path, url: str) -> dict:
    """The spot check of the committed store against HF in this process (workflows.capture.
    spot_check), or why it did not run: capture.spot_check_samples=0, or the memory guard."""
    c = cfg.capture
    if c.spot_check_samples == 0:
        return {"ran": False, "reason": "capture.spot_check_samples=0"}
    # The driver's own thread count is left alone (threads 0).
    spec = {**engine_spec(cfg, target_path), "threads": 0}
    reason = skip_reason(checkpoint_parameters(target_path), spec["dtype"], available_memory())
    if reason is not None:
        log(f"capture: spot check skipped: {reason}")
        return {"ran": False, "reason": reason}
    reader = StoreReader(url, c.storage_options)
    return spot_check(reader, target_path, spec, c.spot_check_samples, c.state_dtype)


def _capture_with_ray(
    cfg: FullConfig, target_path, store: HiddenStateStore, todo: Path, tokens: int, tqdm
) -> "Results":
    """Ray Data reads the shard refs from `todo` (no token crosses the object store from the
    driver); actors read the samples, capture and write; the driver commits each returned row."""
    import ray

    c = cfg.capture
    ensure_ray(cfg.cluster)
    import pyarrow.parquet as pq

    # One block per actor call, so that the calls spread over the whole pool (a single file
    # would otherwise be read as one block, i.e. one task on one actor).
    calls = math.ceil(pq.ParquetFile(todo).metadata.num_rows / c.shards_per_call)
    ds = ray.data.read_parquet(str(todo)).repartition(max(1, calls))
    engine = engine_spec(cfg, target_path)
    with warnings.catch_warnings():
        # Ray 2.60 has named parameters for resources but none yet for actor restarts: bounded
        # restarts still go through **ray_remote_args, whose deprecation warning says only that.
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        results = ds.map_batches(
            CaptureActor,
            batch_size=c.shards_per_call,
            batch_format="pyarrow",
            fn_constructor_kwargs={
                "store_url": store.url,
                "storage_options": store.storage_options,
                "backend": c.backend,
                "engine": engine,
                "chunk_bytes": int(c.chunk_mb * (1 << 20)),
                "compression": c.compression,
                "corpus_folder": str(RunLayout.of(cfg).corpus_shards),
            },
            compute=ray.data.ActorPoolStrategy(size=c.actors),
            num_cpus=c.cpus_per_actor,
            num_gpus=c.gpus_per_actor or None,
            # A killed actor (OOM, preempted node) is restarted and its batch re-run; bounded, so a
            # shard that kills every actor it meets ends the stage instead of looping.
            max_restarts=c.max_actor_restarts,
            max_task_retries=c.max_actor_restarts,
        )
    result = Results()
    bar = tqdm(total=tokens, desc="capture", unit="tok")
    metrics = StageMetrics("capture", "tokens", total=tokens)  # Ray metrics: tokens done, tokens/s
    for row in results.iter_rows():
        row = {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
        if not row["error"]:
            store.commit(
                [
                    {
                        k: row[k]
                        for k in (
                            "shard",
                            "n_samples",
                            "n_tokens",
                            "nbytes",
                            "sample_ids_sha256",
                            "writer",
                            "write_seconds",
                        )
                    }
                ]
            )
        result.add(row)
        bar.update(int(row["n_tokens"]))
        metrics.advance(int(row["n_tokens"]))
    bar.close()
    return result


def capture_main(cfg: FullConfig) -> None:
    """`python -m workflows.capture`: the stage, or with capture.estimate_only the size only."""
    if not cfg.capture.estimate_only:
        # A store shared between runs (multirun, sweeps): wait for its lock, as workflows.full does.
        with RunLayout.of(cfg).shared_stage_lock("capture"):
            run(cfg, prepare_for(cfg, log=log))
        return
    layout = RunLayout.of(cfg)
    corpus = corpus_figures(layout)
    tokens = cfg.capture.estimate_tokens or (corpus or {}).get("tokens")
    if tokens is None:
        raise ConfigError("capture.estimate_only: no finished generate stage here; set capture.estimate_tokens")
    size = estimate(cfg.target, cfg.capture, tokens, cfg.store_capture_ids)
    size["space"] = check_space(layout.store_url, size["projected_bytes"], ignore=True)
    size["projection"] = projection(cfg.capture, cfg.data, tokens, corpus, measured_capture_tokens_per_s(layout))
    size["longest_sample"] = longest_sample(size["bytes_per_token"], cfg.data, cfg.capture, cfg.train.max_seq_len)
    print(json.dumps(size, indent=2))
