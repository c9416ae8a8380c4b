"""Stage `train`: train the EAGLE-3 draft with training-time test on the target's states.

From the capture stage's store (the default once capture has finished in the run folder):
`train.num_workers` Ray Train workers each stream their own shards of the store and run
DeepSpeed on the draft (workflows.train.ray_job), or, with `train.backend=local`, the plain
loop runs in this process (the reference). The target's head and embeddings are read alone
from its checkpoint; the store's provenance must match the config field by field. Held-out
evaluation comes from the store's held-out shards every `train.eval_every` steps.
Checkpoints every `train.checkpoint_every` steps; a rerun resumes from the latest (weights,
optimizer, data position, noise RNG, bit for bit), and refuses a checkpoint whose data, TTT
length or step budget differ, naming them; a store-path checkpoint resumes on another number
of workers too (workflows.train.elastic).

"Online" states (`train.data_source=online`, no capture) are computed here by the target
(on `train.device`), kept in memory and trained by the same Trainer as the store's, with its
checkpoints and metrics: a laptop convenience.

Outputs in `<run_dir>/train/`:

    ray/draft/       Ray Train's checkpoints (DeepSpeed per rank + loop state + draft)
    checkpoint/      the local backend's checkpoint
    draft/           the final draft weights, config and provenance
    metrics.jsonl    one record per logged step
    metrics.json     final held-out evaluation: per-step accuracy, walk acceptance, breakdowns
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch

from eagle3.schema import ConfigError, output_dict, to_dict
from storage.store import StoreError
from workflows.core.config import DraftSection, FullConfig, TrainSection
from workflows.core.engine_spec import EngineSpec
from workflows.core.engines import HFEngine
from workflows.core.errors import InputError
from workflows.core.layout import RunLayout
from workflows.core.log import log
from workflows.core.markers import read_json, run_stage
from workflows.core.precision import resolve
from workflows.core.provenance import FINAL_IS_NORMED, capture_contract, draft_provenance, target_identity
from workflows.train.checkpoint import resumable_checkpoint
from workflows.train.data import SamplesInMemory
from workflows.train.sources import ShardSource
from workflows.train.trainer import Trainer, TrainJob, job_config, trained_ledger


def data_source(train: TrainSection, layout: RunLayout) -> str:
    if train.data_source != "auto":
        return train.data_source
    return "store" if layout.done_key("capture") is not None else "online"


def backend_of(train: TrainSection, source: str) -> str:
    if train.elastic and (source != "store" or train.backend == "local"):
        raise ConfigError(
            f"train.min_workers={train.min_workers} (elastic scaling) needs Ray Train workers reading the "
            f"store: train.data_source={source} with train.backend={train.backend} cannot resume on another "
            "number of workers; set train.min_workers=0"
        )
    if source == "stream" and train.backend == "local":
        raise ConfigError(
            "train.data_source=stream feeds Ray Train workers: use train.backend=ray (or auto); "
            "train.data_source=online computes the states in this process"
        )
    if source == "stream" and train.sequence_parallel > 1:
        raise ConfigError(
            f"train.sequence_parallel={train.sequence_parallel} with train.data_source=stream: the stream "
            "feeds each worker its own samples, while a sequence-parallel group shares one; train from "
            "the store (train.data_source=store)"
        )
    if source == "online":
        if train.backend == "ray":
            raise ConfigError(
                "train.backend=ray trains from the store: run the capture stage first, or set "
                "train.backend=local for online states"
            )
        if train.sequence_parallel > 1:
            raise ConfigError(
                f"train.sequence_parallel={train.sequence_parallel} splits a sample over Ray Train workers, "
                "which train from the store (or the stream): run the capture stage first; online states "
                "train in this process"
            )
        return "online"
    return "plain" if train.backend == "local" else "deepspeed"


def resume_fields(
    train: TrainSection, draft: DraftSection, seed: int, backend: str, store_key: str, elastic: bool = False
) -> dict:
    """What a checkpoint must agree on to be resumed: the data, the schedule, the maths, and
    the world size unless the resume can change it (`elastic`: the store path on Ray Train,
    workflows.train.elastic). `sequence_parallel` is there only when above 1 (an SP 1 run's
    fields are as before it existed): a split run's data rank is rank // sequence_parallel,
    so its checkpoints hold another stream position per rank than an unsplit run's, and are
    refused by it."""
    split = {"sequence_parallel": train.sequence_parallel} if train.sequence_parallel > 1 else {}
    fields = {
        **split,
        "data": store_key,
        "ttt": to_dict(train.ttt),
        "objective": to_dict(train.objective),
        "steps": train.steps,
        "optim": to_dict(train.optim),
        "dropout": train.dropout,
        "ema_decay": train.ema_decay,
        "world_size": train.num_workers if backend == "deepspeed" else 1,
        "backend": backend,
        "batching": {
            "batch_size": train.batch_size,
            "packing": train.packing,
            "max_seq_len": train.max_seq_len,
            "rows_per_batch": train.rows_per_batch,
            "shuffle_window": train.shuffle_window,
            "grad_accum": train.grad_accum,
        },
        "draft": to_dict(draft),
        "seed": seed,
        "compute_dtype": train.compute_dtype,
        "zero_stage": train.zero_stage if backend == "deepspeed" else None,
        "init_from": train.init_from,
    }
    if elastic:
        del fields["world_size"]
    return fields


def worker_device(train: TrainSection, backend: str) -> str:
    """The device type the draft trains on: Ray workers hold GPUs when `gpus_per_worker > 0`,
    the local loop and online training use `train.device`."""
    if backend == "deepspeed":
        return "cuda" if train.gpus_per_worker > 0 else "cpu"
    return train.device


def training_dtype(train: TrainSection, backend: str) -> str:
    """`train.compute_dtype` settled for the device the workers train on, never by a probe
    of this driver's CPU (a CPU head node placing GPU workers would otherwise pick fp32)."""
    device = worker_device(train, backend)
    dtype = resolve(train.compute_dtype, device)
    if dtype == "float16":  # a GPU without bf16: the draft trains in bf16 autocast or fp32 only
        log(f"train: the {device} device has no bf16; the draft trains in float32")
        return "float32"
    return dtype


def run(cfg: FullConfig, target_path: Path) -> Path:
    # Workers may run elsewhere (and Hydra's working directory is the driver's): absolute paths.
    cfg = dataclasses.replace(cfg, run_dir=str(cfg.run_path), cache_dir=str(cfg.cache_path))
    source = data_source(cfg.train, RunLayout.of(cfg))
    backend = backend_of(cfg.train, source)
    # "auto" settles here, for the workers' device; the key and the loop see the dtype really used.
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, compute_dtype=training_dtype(cfg.train, backend))
    )
    layout = RunLayout.of(cfg)
    out = layout.stage_dir("train")
    _, vocab_summary = layout.read_vocab()
    identity = target_identity(target_path, cfg.cache_path)
    key = {
        "train": output_dict(cfg.train),
        "draft": output_dict(cfg.draft),
        "seed": cfg.seed,
        "target": identity,
        "capture_layer_ids": cfg.draft_capture_ids,
        **layout.chain("generate", "vocab", *(["capture"] if source == "store" else [])),
        # Streamed states are computed as the capture stage would: its output settings make them.
        **({"capture": output_dict(cfg.capture)} if source == "stream" else {}),
    }

    def build() -> dict:
        provenance = draft_provenance(cfg, identity, vocab_summary)
        if backend == "online":
            final = train_online(cfg, layout, target_path, provenance)
        elif source == "stream":
            from workflows.train.streaming import train_streaming

            def fields_of(data_key: str) -> dict:
                return resume_fields(cfg.train, cfg.draft, cfg.seed, backend, data_key)

            final = train_streaming(cfg, layout, target_path, identity, provenance, fields_of)
        else:
            final = train_from_store(cfg, layout, target_path, identity, provenance, backend)
        log(
            f"train: held-out acceptance (walk, k={final['k']}) {final['acceptance_walk']:.3f}; "
            f"per-position average {final['acceptance_per_position_average']:.3f}; step acc "
            f"{[round(a, 3) for a in final['step_acc']]}"
        )
        return {k: final[k] for k in ("acceptance_walk", "acceptance_per_position_average", "k")}

    return run_stage("train", out, key, build)


def store_expectation(cfg: FullConfig, identity: dict) -> dict:
    """The capture contract the train stage holds a store to: every field but the capture
    ids, of which the store must hold the draft's (the reader checks them)."""
    contract = capture_contract(cfg.target, cfg.capture, identity, cfg.store_capture_ids)
    return {k: v for k, v in contract.items() if k != "capture_layer_ids"}


def train_from_store(
    cfg: FullConfig, layout: RunLayout, target_path: Path, identity: dict, provenance: dict, backend: str
) -> dict:
    out = layout.stage_dir("train")
    # The store may hold more layers than the draft reads (capture.families): the contract
    # holds every other field, and the reader hands out the draft's layers, refusing a store
    # that lacks one, by name.
    expect = store_expectation(cfg, identity)
    reader = layout.open_store(expect=expect, aux_layers=cfg.draft_capture_ids)
    train_shards, heldout_shards = reader.shard_names("train"), reader.shard_names("heldout")
    if not train_shards:
        raise StoreError(
            f"store {layout.store_url}: no committed shard of the train split (shards are named "
            "train-*/heldout-* since format 2 of the capture plan); rerun stages=[capture] into a new "
            "store"
        )
    if not heldout_shards:
        log("train: the store has no held-out shard (data.heldout_fraction too small?); evaluating on train data")
    fields = resume_fields(
        cfg.train, cfg.draft, cfg.seed, backend, layout.require_done("capture"), elastic=backend == "deepspeed"
    )
    latest = resumable_checkpoint(cfg.train.resume, layout, backend, fields)
    if latest is None:  # a fresh start: the record of what trained starts afresh too
        shutil.rmtree(trained_ledger(cfg), ignore_errors=True)
    job = TrainJob(
        config=job_config(cfg),
        target_path=str(Path(target_path).resolve()),
        store_url=layout.store_url,
        storage_options=dict(layout.storage_options),
        expect=expect,
        aux_layers=cfg.draft_capture_ids,
        final_is_normed=bool(reader.provenance.get("final_is_normed", FINAL_IS_NORMED)),
        provenance=provenance,
        resume_fields=fields,
        train_shards=train_shards,
        heldout_shards=heldout_shards,
        backend=backend,
    )
    train = cfg.train
    log(
        f"train: {len(train_shards)} train / {len(heldout_shards)} held-out shards of {layout.store_url}, "
        f"{train.steps} steps, TTT length {train.ttt.length}, "
        f"{'packed to ' + str(train.max_seq_len) if train.packing else 'padded'}, {train.compute_dtype}"
    )
    if backend == "deepspeed":
        from workflows.train.ray_job import run_with_ray

        run_with_ray(cfg.train, cfg.cluster, job, out)
    else:
        Trainer(job).fit(latest)
    return read_json(layout.metrics_file)


# ---------------------------------------------------------------------- online (no store)
def online_shards(engine, rows: list[dict], split: str, shard_samples: int) -> dict[str, list[dict]]:
    """The target's states for `rows`, computed here and kept in memory, in shards named as
    the store names them (`train-00000`, ...), so that the stream shuffles them alike."""
    from tqdm import tqdm

    shards = {}
    for start in tqdm(range(0, len(rows), shard_samples), desc=f"online states ({split})", unit="shard"):
        part = rows[start : start + shard_samples]
        states = engine.states([r["input_ids"] for r in part])
        shards[f"{split}-{start // shard_samples:05d}"] = [
            {
                "id": r["id"],
                "input_ids": torch.tensor(r["input_ids"], dtype=torch.int64),
                "loss_mask": torch.tensor(r["loss_mask"], dtype=torch.int64),
                "aux": aux.cpu(),
                "final": final.cpu(),
            }
            for r, (aux, final) in zip(part, states)
        ]
    return shards


def train_online(cfg: FullConfig, layout: RunLayout, target_path: Path, provenance: dict) -> dict:
    """The target computes the states here, then the same Trainer as for the store trains on
    them (with checkpoints and resume: the states are a function of the corpus)."""
    samples = layout.read_corpus()
    train_rows = [r for r in samples if r["split"] == "train"]
    # Held-out evaluation reads at most eval_max_samples (workflows.train.data.eval_batches).
    heldout_rows = [r for r in samples if r["split"] == "heldout"][: cfg.train.eval_max_samples]
    if not train_rows:
        raise InputError(f"{layout.corpus_shards}: the corpus has no train-split sample")
    device = cfg.train.device
    engine = HFEngine(
        EngineSpec(
            str(target_path),
            dtype=resolve(cfg.train.capture_dtype, device),
            device=device,
            capture_ids=cfg.draft_capture_ids,
            trust_remote_code=cfg.target.trust_remote_code,
        )
    )
    cfg.target.check_against_hf_config(engine.model.config)
    shard_samples = cfg.capture.shard_samples
    shards = {
        **online_shards(engine, train_rows, "train", shard_samples),
        **online_shards(engine, heldout_rows, "heldout", shard_samples),
    }
    pad_id, final_is_normed = engine.pad_id, engine.final_is_normed
    del engine  # the target's layers are no longer needed; keep memory for training
    online_key = f"online:{layout.require_done('generate')}:{layout.require_done('vocab')}"
    fields = resume_fields(cfg.train, cfg.draft, cfg.seed, "plain", online_key)
    latest = resumable_checkpoint(cfg.train.resume, layout, "plain", fields)
    log(
        f"train: {len(train_rows)} train / {len(heldout_rows)} held-out samples (online, in this process), "
        f"{cfg.train.steps} steps"
    )
    job = TrainJob(
        config=job_config(cfg),
        target_path=str(Path(target_path).resolve()),
        store_url=f"online states of {layout.corpus_shards}",
        storage_options={},
        expect={},
        aux_layers=None,
        final_is_normed=final_is_normed,
        provenance=provenance,
        resume_fields=fields,
        train_shards=[n for n in shards if n.startswith("train-")],
        heldout_shards=[n for n in shards if n.startswith("heldout-")],
        backend="plain",
        pad_id=pad_id,
    )
    source = ShardSource(SamplesInMemory(shards, job.store_url), job.train_shards, job.heldout_shards)
    Trainer(job, source=source).fit(latest)
    return read_json(layout.metrics_file)
