"""`train.data_source=stream`: the Ray Train workers train on states that engine actors
compute while they train; nothing is stored unless `train.stream_tee=true`.

The driver plans the corpus into capture shards as the capture stage does
(workflows.core.shard_plan, into `train/stream/plan.parquet`), builds one Ray Data
dataset per training rank, rank 0's opening with the held-out shards
(workflows.train.stream_pipeline),
and hands them to Ray Train (`datasets=`, each rank reading its own through
`get_dataset_shard`; workflows.train.stream_source). Each epoch re-streams: the states
are recomputed, a deterministic function of the sample and the target, so a resume is
exact. `train/stream/summary.json` records the budget, the measured peak of the object
store, the engine actors and the corpus's skipped samples.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from eagle3.schema import ConfigError, output_dict
from storage.states import state_bytes_per_token
from storage.store import HiddenStateStore
from workflows.core.cluster import STREAM_SYSTEM_CONFIG, ensure_ray, stream_cpus
from workflows.core.config import FullConfig
from workflows.core.engines import engine_class
from workflows.core.errors import InputError
from workflows.core.layout import RunLayout
from workflows.core.log import log
from workflows.core.markers import read_json, write_json_atomic
from workflows.core.provenance import CAPTURE_CONTRACT, FINAL_IS_NORMED, store_provenance
from workflows.core.shard_plan import plan_corpus
from workflows.core.shard_states import engine_spec
from workflows.train.checkpoint import resumable_checkpoint
from workflows.train.stream_pipeline import ObjectStorePeak, StatesActor, rank_items
from workflows.train.stream_source import LEDGER
from workflows.train.trainer import TrainJob, batch_settings, job_config


def stream_key(cfg: FullConfig, layout: RunLayout) -> str:
    """What the streamed states are a function of: the corpus and the capture's output settings."""
    import hashlib
    import json

    capture = json.dumps(output_dict(cfg.capture), sort_keys=True, default=str)
    return f"stream:{layout.require_done('generate')}:{hashlib.sha256(capture.encode()).hexdigest()[:16]}"


def actors_per_worker(cfg: FullConfig) -> int:
    """`capture.actors` engine actors shared out over the training workers, at least one each."""
    return max(1, round(cfg.capture.actors / cfg.train.num_workers))


def start_ray(cfg: FullConfig) -> None:
    """Ray with a CPU for every trainer and engine actor: a local Ray started here offers as
    many logical CPUs as they reserve (they share the cores; the engines wait for the
    trainers' pace anyway); a Ray already running must have them."""
    import ray

    need = stream_cpus(cfg)
    ensure_ray(cfg.cluster, system_config=STREAM_SYSTEM_CONFIG, min_cpus=need)
    have = ray.cluster_resources().get("CPU", 0)
    if have < need:
        t, c = cfg.train, cfg.capture
        raise ConfigError(
            f"train.data_source=stream: {t.num_workers} training worker(s) x {t.cpus_per_worker:g} CPU and "
            f"{t.num_workers * actors_per_worker(cfg)} engine actor(s) x {c.cpus_per_actor:g} CPU need {need:g} "
            f"CPUs, the Ray cluster has {have:g}: lower capture.actors or train.num_workers, or raise cluster.num_cpus"
        )


def tee_store(cfg: FullConfig, layout: RunLayout, identity: dict, corpus_sha: str) -> HiddenStateStore:
    """The store the capture stage would write (its provenance, plan and location)."""
    c = cfg.capture
    plan = {"shard_samples": c.shard_samples, "corpus_sha256": corpus_sha}
    prov = store_provenance(cfg.target, c, identity, plan, engine_class(c.backend).version(), cfg.store_capture_ids)
    return HiddenStateStore.create_or_open(
        layout.store_url, prov, c.storage_options, checked=(*CAPTURE_CONTRACT, "plan")
    )


def positions_of(latest: Path | None, world: int) -> tuple[int, list[dict | None]]:
    """The step and each rank's stream position of the checkpoint resumed from."""
    if latest is None:
        return 0, [None] * world
    states = [read_json(latest / f"loop_rank{r}.json") for r in range(world)]
    return states[0]["step"], [s["position"] for s in states]


# Shards one pipeline holds at most whatever its limit, measured with Ray Data 2.60 (an engine
# actor runs about four shards ahead of its trainer however small the limit, plus the one
# the trainer holds and the one being computed): a budget must leave each this many.
SHARDS_IN_FLIGHT = 6


def data_limit(budget: int, world: int, shard_bytes: int) -> int:
    """Ray Data's object-store limit for each of the `world` pipelines so that together
    they stay within `budget`: its share less the two shards outside Ray Data's count (the
    one its trainer holds, the one an engine is writing); a budget below SHARDS_IN_FLIGHT
    shards a pipeline cannot be honoured, and is refused."""
    share = budget // world
    if share < SHARDS_IN_FLIGHT * shard_bytes:
        raise ConfigError(
            f"train.stream_budget_bytes={budget}: {world} pipeline(s) (one per training worker) "
            f"each hold up to {SHARDS_IN_FLIGHT} shards of states in flight, {shard_bytes} bytes each at most "
            f"here: at least {world * SHARDS_IN_FLIGHT * shard_bytes}; raise it, or lower capture.shard_samples"
        )
    return share - 2 * shard_bytes


def datasets_for(cfg, target_path, layout, plan_file, counts, heldout, positions, remaining, tee, shard_bytes):
    """The ranks' datasets, each mapped by its own engine actors."""
    import ray
    import ray.train
    from ray.data import ExecutionOptions, ExecutionResources

    c, t, world = cfg.capture, cfg.train, cfg.train.num_workers
    per_worker = actors_per_worker(cfg)

    teed = set(tee.committed()) if tee else set()
    datasets, stride = {}, False
    settings = batch_settings(t, 0)
    for rank in range(world):
        items, stride = rank_items(counts, cfg.seed, rank, world, positions[rank], remaining, settings)
        for item in items:  # each shard written once, by the first rank and epoch that streams it
            if tee and item["shard"] not in teed:
                item["tee"] = True
                teed.add(item["shard"])
        datasets[f"train_{rank}"] = (items, per_worker)
    # Rank 0's stream opens with the held-out shards it evaluates on (the first
    # train.eval_max_samples samples, store order; epoch -1): no engine of their own.
    eval_items, total = [], 0
    for name in heldout:
        if total >= t.eval_max_samples:
            break
        eval_items.append({"epoch": -1, "shard": name, "first": total, "skip": 0, "tee": False})
        total += counts[name]
    items, actors = datasets["train_0"]
    datasets["train_0"] = (eval_items + items, actors)
    kwargs = {
        "plan_file": str(plan_file),
        "backend": c.backend,
        "engine": engine_spec(cfg, target_path),
        "corpus_folder": str(layout.corpus_shards),
        "state_dtype": c.state_dtype,
        "train_ids": cfg.draft_capture_ids,
        "tee": None
        if tee is None
        else {
            "url": tee.url,
            "storage_options": tee.storage_options,
            "chunk_bytes": int(c.chunk_mb * (1 << 20)),
            "compression": c.compression,
        },
    }
    built = {}
    with warnings.catch_warnings():
        # As in the capture stage: bounded actor restarts go through **ray_remote_args.
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        for name, (items, actors) in datasets.items():
            ds = ray.data.from_items(items, override_num_blocks=max(1, len(items)))
            built[name] = ds.map_batches(
                StatesActor,
                batch_size=1,
                batch_format="pyarrow",
                fn_constructor_kwargs=kwargs,
                compute=ray.data.ActorPoolStrategy(size=actors),
                num_cpus=c.cpus_per_actor,
                num_gpus=c.gpus_per_actor or None,
                # A killed engine actor is restarted and its shard computed again (the same bytes).
                max_restarts=c.max_actor_restarts,
                max_task_retries=c.max_actor_restarts,
            )
    limit = data_limit(t.stream_budget_bytes, world, shard_bytes)
    options = ExecutionOptions(preserve_order=True, resource_limits=ExecutionResources(object_store_memory=limit))
    config = ray.train.DataConfig(datasets_to_split=[], execution_options=options)
    return built, config, stride, per_worker


def train_streaming(cfg: FullConfig, layout: RunLayout, target_path, identity, provenance, fields_of) -> dict:
    """Train on streamed states (module doc); `fields_of(data key)` -> the resume fields."""
    import pyarrow.parquet as pq

    from workflows.train.ray_job import run_with_ray

    out = layout.stage_dir("train")
    folder = out / LEDGER
    folder.mkdir(parents=True, exist_ok=True)
    _, skipped, corpus_sha, plan_file = plan_corpus(layout, cfg.capture.shard_samples, folder)
    table = pq.read_table(plan_file, columns=["name", "sample_ids", "n_tokens"])
    counts = dict(zip(table["name"].to_pylist(), (len(ids) for ids in table["sample_ids"].to_pylist())))
    # The largest shard's bytes as it crosses: states of the draft's layers, tokens, mask, offsets.
    per_token = state_bytes_per_token(len(cfg.draft_capture_ids), cfg.target.hidden_size, cfg.capture.state_dtype)
    shard_bytes = max(table["n_tokens"].to_pylist()) * (per_token + 5) + 8 * (max(counts.values()) + 1)
    train_names = [n for n in counts if n.startswith("train-")]
    heldout = sorted(n for n in counts if n.startswith("heldout-")) or sorted(train_names)
    if not train_names:
        raise InputError(f"{layout.corpus_shards}: the corpus has no train-split sample to stream")
    fields = fields_of(stream_key(cfg, layout))
    latest = resumable_checkpoint(cfg.train.resume, layout, "deepspeed", fields)
    if latest is None:  # a fresh start: the record of what trained starts afresh too
        for old in folder.glob("rank*.jsonl"):
            old.unlink()
    step, positions = positions_of(latest, cfg.train.num_workers)
    per_worker = actors_per_worker(cfg)
    start_ray(cfg)
    tee = tee_store(cfg, layout, identity, corpus_sha) if cfg.train.stream_tee else None
    remaining = (cfg.train.steps - step) * cfg.train.grad_accum
    from ray.data import DataContext

    # Ray Data's progress bars would break the log's lines (the dashboard shows the datasets);
    # each dataset copies the context it is built in, and Ray Train hands it to the workers.
    context = DataContext.get_current()
    bars = context.enable_progress_bars
    context.enable_progress_bars = False
    datasets, data_config, stride, per_worker = datasets_for(
        cfg, target_path, layout, plan_file, counts, heldout, positions, remaining, tee, shard_bytes
    )
    backend = cfg.capture.backend
    job = TrainJob(
        config=job_config(cfg),
        target_path=str(Path(target_path).resolve()),
        store_url=f"the stream of {layout.corpus_shards}",
        storage_options={},
        expect={},
        aux_layers=None,
        final_is_normed=bool(getattr(engine_class(backend), "final_is_normed", FINAL_IS_NORMED)),
        provenance=provenance,
        resume_fields=fields,
        train_shards=train_names,
        heldout_shards=heldout,
        backend="deepspeed",
        source="stream",
        state_dtype=cfg.capture.state_dtype,
        stream_stride=stride,
        stream_actors_per_worker=per_worker,
    )
    budget = cfg.train.stream_budget_bytes
    log(
        f"train: streaming {len(train_names)} train / {len(heldout)} held-out shards from {backend} engine actors "
        f"({per_worker} per training worker, {cfg.train.num_workers} worker(s)), states in flight within "
        f"{budget / 2**20:.0f} MiB; {'teed to ' + layout.store_url if tee else 'no store written'}; skipped {skipped}"
    )
    try:
        with ObjectStorePeak() as peak:
            run_with_ray(cfg.train, cfg.cluster, job, out, datasets=datasets, data_config=data_config)
    finally:
        context.enable_progress_bars = bars
    summary = {
        "budget_bytes": budget,
        "peak_object_store_bytes": peak.peak,
        "actors_per_worker": per_worker,
        "workers": cfg.train.num_workers,
        "skipped": skipped,
        "tee": layout.store_url if tee else None,
    }
    write_json_atomic(folder / "summary.json", summary)
    final = read_json(layout.metrics_file)
    rates = final["stream"]
    log(
        f"train: stream peak object store {peak.peak / 2**20:.1f} MiB of the {budget / 2**20:.0f} MiB budget; "
        f"inference {rates['inference_tokens_per_s_per_actor']:.0f} tok/s per engine actor, training "
        f"{rates['training_tokens_per_s_per_worker']:.0f} tok/s per worker: {rates['bound']}-bound, "
        f"{rates['actors_per_worker_suggested']} engine actor(s) per worker suggested"
    )
    return final
