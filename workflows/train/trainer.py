"""The trainer: the one training loop (eagle3.training.fit) over a worker's stream.

`Trainer.fit` is run by each Ray Train worker with DeepSpeed doing the optimizer step
(`DeepSpeedStep`: ZeRO stage, bf16, gradient accumulation and clipping from the config),
or alone in this process with a plain torch AdamW (`PlainStep`, the reference the tests
compare DeepSpeed against). The states come from the store (storage.reader) or, online,
from samples computed by the target in this process (workflows.train.data.SamplesInMemory):
the same stream, evaluation, checkpoints and metrics either way. Per optimizer step: the
learning rate of the warmup + cosine schedule, `grad_accum` micro-batches from this
worker's stream (workflows.train.data), eagle3.training.train_step (the TTT forward, loss
and backward of each, one optimizer step): the one step of every backend, the tests and
the benchmarks. Every `eval_every` steps rank 0 evaluates the held-out shards; every
`checkpoint_every` steps every rank saves its part (workflows.train.checkpoint) with the
loop state, so that a resume continues the same data, noise and schedule bit for bit.

A job (`TrainJob`) carries the config and plain values with absolute paths: Ray pickles it
to workers that may run on another node of the cluster.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3.families import build_model
from eagle3.sequence_parallel import SequenceParallel
from eagle3.target_spec import TargetSpec
from eagle3.training import LoopHooks, PlainOptimizer, fit, make_optimizer
from eagle3.weight_average import WeightAverage
from storage.reader import StoreReader
from workflows.core.config import DraftSection, FullConfig
from workflows.core.draft_files import draft_state, load_draft_weights, save_draft
from workflows.core.layout import RunLayout
from workflows.core.log import log
from workflows.core.markers import atomic_dir, write_json_atomic
from workflows.core.target_weights import read_embeddings, read_head_and_norm, read_target_head
from workflows.train import checkpoint as ckpt
from workflows.train import elastic
from workflows.train.data import BatchSettings, to_device
from workflows.train.evaluation import evaluate_heldout
from workflows.train.sources import ShardSource
from workflows.train.tracking import Tracker


@dataclass
class TrainJob:
    config: FullConfig  # run_dir and cache_dir absolute, no secrets (workflows.train.stage.job_config)
    target_path: str
    store_url: str
    storage_options: dict
    expect: dict  # the capture contract the store must meet (workflows.core.provenance)
    aux_layers: list[int] | None  # the capture ids the draft reads, of those the store holds
    final_is_normed: bool
    provenance: dict  # what the draft files carry
    resume_fields: dict  # what a resume must not change (workflows.train.checkpoint)
    train_shards: list[str]
    heldout_shards: list[str]
    backend: str  # "deepspeed" (a Ray Train worker) or "plain" (this process)
    pad_id: int = 0  # the online engine's pad id; store batches pad with 0 (masked either way)
    # "store": the store's shards; "stream": states from engine actors through Ray Data
    # (workflows.train.stream_source); online states are handed to the Trainer as a source.
    source: str = "store"
    state_dtype: str = "bfloat16"  # the stream's states, as the store would hold them
    stream_stride: bool = False  # the stream: fewer train shards than workers, ranks stride over samples
    stream_actors_per_worker: int = 0  # the stream: engine actors feeding each training worker


def job_config(cfg: FullConfig) -> FullConfig:
    """The config as the workers get it. Secrets stay out of what crosses Ray: the store's
    credentials travel once, in the job's storage_options; the target's env is not needed."""
    return dataclasses.replace(
        cfg,
        capture=dataclasses.replace(cfg.capture, storage_options={}),
        target=dataclasses.replace(cfg.target, env={}),
    )


def batch_settings(train, pad_id: int) -> BatchSettings:
    return BatchSettings(
        batch_size=train.batch_size,
        packing=train.packing,
        max_seq_len=train.max_seq_len,
        rows_per_batch=train.rows_per_batch,
        window=train.shuffle_window,
        pad_id=pad_id,
    )


def build_draft(
    section: DraftSection, target: TargetSpec, target_path: str, vocab, *, seed: int, init_from: str | None = None
) -> torch.nn.Module:
    """The draft at its seeded initialisation, with the target's embeddings and the vocab map;
    the same on every worker. `init_from`: a trained draft to warm-start from (weights only,
    a fresh optimizer and schedule)."""
    torch.manual_seed(seed)
    draft = build_model(section.build(target, vocab))
    draft.load_target_embeddings(read_embeddings(Path(target_path)).float())
    draft.set_vocab_mapping(vocab.d2t, vocab.t2d)
    from_target, frozen = section.head_from_target()
    if from_target:
        draft.init_head_from_target(*read_head_and_norm(Path(target_path)))
    # A frozen head leaves the optimizer (it takes the parameters that require a gradient), the
    # weight average and the gradients; it is saved with the weights all the same.
    draft.lm_head.weight.requires_grad_(not frozen)
    if init_from:
        load_draft_weights(Path(init_from), draft)
    return draft


class PlainStep(PlainOptimizer):
    """The plain optimizer with its checkpoint files."""

    def __init__(self, draft, optim):
        super().__init__(draft, optim)

    def save(self, folder: Path) -> None:
        torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")

    def load(self, folder: Path) -> None:
        self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True, map_location="cpu"))


class DeepSpeedStep:
    """A DeepSpeed engine over the draft, with a torch AdamW (no C++ op built at run time):
    the optimizer side of eagle3.training.train_step, like PlainOptimizer."""

    TAG = "deepspeed"

    def __init__(self, draft, train, world: int, device: torch.device):
        import deepspeed

        # DeepSpeed would JIT-build its shared-memory all-reduce for CPU workers (minutes,
        # and a compiler on every node); gloo does the job. Pinned DeepSpeed: 0.19.8.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        ds_config = {
            "train_micro_batch_size_per_gpu": train.batch_size,
            "gradient_accumulation_steps": train.grad_accum,
            "train_batch_size": train.batch_size * train.grad_accum * world,
            "gradient_clipping": train.optim.grad_clip,
            "zero_optimization": {"stage": train.zero_stage},
            "bf16": {"enabled": train.compute_dtype == "bfloat16"},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        optimizer = make_optimizer(draft, train.optim)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            args=deepspeed_args(device), model=draft, optimizer=optimizer, config=ds_config, dist_init_required=False
        )
        self.base_optimizer = optimizer
        self.module = self.engine.module

    # The four calls of eagle3.training.train_step's optimizer (see PlainOptimizer there).
    def begin(self, lr: float) -> None:
        for group in self.base_optimizer.param_groups:
            group["lr"] = lr
        self.engine.train()  # DeepSpeed freed the gradients at the last accumulation boundary

    def backward(self, loss, micro_batches: int) -> None:
        self.engine.backward(loss)  # DeepSpeed scales by its gradient_accumulation_steps itself
        self.engine.step()  # and steps the optimizer at the accumulation boundary only

    def finish(self) -> float:
        grad_norm = self.engine.get_global_grad_norm()
        return float(grad_norm) if grad_norm is not None else float("nan")

    def save(self, folder: Path) -> None:
        self.engine.save_checkpoint(str(folder), tag=self.TAG)
        if elastic.partitioned(self.module):  # a copy another world size can resume from
            elastic.save_full_optimizer(self.module, self.base_optimizer, folder, self.engine.global_rank)

    def load(self, folder: Path, resized: bool = False) -> None:
        """`resized`: the checkpoint was saved by another number of workers (workflows.train.elastic)."""
        if resized and elastic.partitioned(self.module):
            self.engine.load_checkpoint(str(folder), tag=self.TAG, load_module_only=True)
            elastic.load_full_optimizer(self.engine, self.base_optimizer, folder)
            return
        self.engine.load_checkpoint(
            str(folder), tag=self.TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )


def deepspeed_args(device: torch.device):
    """DeepSpeed's `args`, naming the GPU the trainer chose. Left to itself, DeepSpeed 0.19.8
    places the module on cuda:LOCAL_RANK (`DeepSpeedEngine._set_distributed_vars`), which is
    the GPU Ray gave the worker only when every worker holds exactly one GPU of its node in
    order; `device_rank` overrides it, so the module and the batches share one device."""
    from types import SimpleNamespace

    if device.type != "cuda":
        return None
    # A bare "cuda" (index None) means the current device; DeepSpeed compares the rank with 0.
    return SimpleNamespace(device_rank=torch.cuda.current_device() if device.index is None else device.index)


def job_source(job: TrainJob, on_corrupt: str):
    """The job's batch source on this worker: the store's shards, or the stream."""
    if job.source == "stream":
        from workflows.train.stream_source import StreamSource

        return StreamSource(job)
    reader = StoreReader(
        job.store_url, job.storage_options, expect=job.expect, on_corrupt=on_corrupt, aux_layers=job.aux_layers
    )
    return ShardSource(reader, job.train_shards, job.heldout_shards, ledger=trained_ledger(job.config))


def trained_ledger(cfg: FullConfig) -> Path:
    """Where the store path's ranks record what they train (workflows.train.sources.ShardSource)."""
    return Path(cfg.run_dir) / "train" / "trained"


def sequence_parallel_group(rank: int, world: int, size: int) -> SequenceParallel:
    """This rank's group of `size` consecutive ranks. torch.distributed.new_group is
    collective: every rank creates every group, in the same order."""
    import torch.distributed as dist

    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return SequenceParallel(mine, rank % size, size)


class Trainer:
    def __init__(self, job: TrainJob, rank: int = 0, world: int = 1, device: torch.device | None = None, source=None):
        """`source`: where the batches come from (workflows.train.sources); None: the job's
        (the store's shards, or the stream of engine actors on a Ray Train worker)."""
        self.job, self.rank, self.world = job, rank, world
        self.cfg = cfg = job.config
        # Sequence parallel: groups of `sp` consecutive ranks share one stream of batches
        # (data rank rank // sp of world // sp) and split each sample (eagle3.sequence_parallel).
        size = cfg.train.sequence_parallel if job.backend == "deepspeed" else 1
        self.sp = sequence_parallel_group(rank, world, size) if size > 1 else None
        self.data_rank, self.data_world = rank // size, world // size
        self.loop_cfg = cfg.train
        self.device = device or torch.device(cfg.train.device if job.backend == "plain" else "cpu")
        self.layout = RunLayout.of(cfg)
        vocab, _ = self.layout.read_vocab()
        draft = build_draft(
            cfg.draft, cfg.target, job.target_path, vocab, seed=cfg.seed, init_from=cfg.train.init_from
        ).to(self.device)
        head_dtype = torch.bfloat16 if cfg.train.compute_dtype == "bfloat16" else torch.float32
        self.head = read_target_head(Path(job.target_path), job.final_is_normed).to(self.device, head_dtype)
        self.source = source if source is not None else job_source(job, cfg.train.on_corrupt_shard)
        if rank % size and getattr(self.source, "ledger", None) is not None:
            self.source.ledger = None  # a sequence-parallel group trains one stream: its first rank records it
        self.opt = (
            DeepSpeedStep(draft, cfg.train, world, self.device)
            if job.backend == "deepspeed"
            else PlainStep(draft, cfg.train.optim)
        )
        self.draft = self.opt.module
        # The model evaluated and saved, with train.ema_decay: the raw weights' moving average
        self.average = WeightAverage(self.draft, cfg.train.ema_decay) if cfg.train.ema_decay else None
        # The noise is drawn on the whole sample: the ranks of a group draw the same values.
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed + self.data_rank)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict:
        train = self.loop_cfg
        batches = self.source.heldout_batches(
            train.batch_size, train.max_seq_len, self.job.pad_id, train.eval_max_samples
        )
        return evaluate_heldout(self.draft, self.head, batches, train, self.cfg.evaluate.length_buckets, self.device)

    # ------------------------------------------------------------------ the loop
    def fit(self, restore_from: Path | None, report=None) -> dict | None:
        """Train to `train.steps` (from the checkpoint in `restore_from`, if any). `report`
        (Ray's) is called with each checkpoint folder; without it checkpoints go to the
        plain checkpoint folder. Returns the final evaluation on rank 0."""
        train = self.loop_cfg
        start, position, best = 0, None, None
        if restore_from is not None:
            saved_world = ckpt.check_resumable(restore_from, self.job.resume_fields).get("world_size", self.world)
            if saved_world == self.world:
                state = ckpt.read_loop_state(restore_from, self.rank, self.job.resume_fields)
                self.opt.load(restore_from)
                self.generator.set_state(state["generator"])
                position = state["position"]
            else:  # elastic: the optimizer consolidated, the epoch's rest dealt anew
                states = [ckpt.read_loop_state(restore_from, r, self.job.resume_fields) for r in range(saved_world)]
                state = states[0]
                self.opt.load(restore_from, resized=True)
                if self.rank < saved_world:  # a new rank's noise starts from its seed
                    self.generator.set_state(states[self.rank]["generator"])
                # one position per data rank: the ranks of a sequence-parallel group share theirs
                group = self.world // self.data_world
                position = self.source.elastic_position([s["position"] for s in states[::group]], self.cfg.seed)
            if self.job.backend == "plain":  # DeepSpeed's files hold the module's weights
                raw = restore_from / ckpt.TRAINING_WEIGHTS if self.average else None
                load_draft_weights(restore_from / ckpt.DRAFT, self.draft, file=raw)
            if self.average is not None:
                ckpt.load_average(restore_from, self.average)
            start, best = state["step"], state.get("best")
            if self.rank == 0 and saved_world != self.world:
                left = sum(len(v) for e, v in position["excluded"].items() if int(e) == position["epoch"])
                log(
                    f"train: resuming at step {start} on {self.world} worker(s) from a checkpoint of {saved_world}: "
                    f"epoch {position['epoch']} goes on without its {left} sample(s) already trained"
                )
            elif self.rank == 0:
                log(f"train: resuming at step {start} (epoch {position['epoch']}, batch {position['batches']})")
        stream = self.source
        stream.open(
            batch_settings(train, self.job.pad_id),
            self.cfg.seed,
            self.data_rank,
            self.data_world,
            position,
            prefetch=train.prefetch_batches,
            pin=self.device.type == "cuda",
        )
        tracker = Tracker(self.cfg, self.layout.stage_dir("train"), resume_step=start) if self.rank == 0 else None

        def next_batches() -> list[dict]:
            # int8 states cross as stored and are dequantised on the device (data.to_device)
            return [to_device(stream.next_batch(), self.device, non_blocking=True) for _ in range(train.grad_accum)]

        hooks = LoopHooks(
            evaluate=self._evaluate_on_rank0,
            log=None if tracker is None else (lambda record: tracker({**record, "epoch": stream.epoch})),
            checkpoint=lambda done, best, last: self._checkpoint(done, stream.state(), best, last, report),
            reduce=self._mean_over_workers if self.world > 1 else None,
        )
        try:
            state = fit(
                self.opt,
                self.head,
                next_batches,
                train,
                self.generator,
                hooks,
                start=start,
                best=best,
                average=self.average,
                sp=self.sp,
            )
        finally:
            stream.close()
        last_eval, best = state.last_eval, state.best
        if self.average is not None:  # the trained draft is the average
            self.average.copy_to_module()
        final = self._evaluate_on_rank0() if last_eval is None else last_eval
        if self.rank == 0:
            final = {
                **final,
                "best": best,
                "stream": stream.counts(),
                "skipped_shards": dict(stream.skipped),
            }
            with atomic_dir(self.layout.draft_dir) as tmp:
                save_draft(tmp, self.draft, self.job.provenance)
            write_json_atomic(self.layout.metrics_file, final)
            tracker.close(final)
            return final
        return None

    def _mean_over_workers(self, loss: float, tokens: int) -> tuple[float, int]:
        import torch.distributed as dist

        t = torch.tensor([loss, float(tokens)], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t)
        # The ranks of a sequence-parallel group hold the same batch (and its whole loss).
        return float(t[0]) / self.world, int(t[1]) // (self.world // self.data_world)

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _evaluate_on_rank0(self) -> dict | None:
        """Rank 0 evaluates; the others wait for its acceptance (one broadcast)."""
        result = self.evaluate() if self.rank == 0 else None
        if self.world > 1:
            import torch.distributed as dist

            box = [result]
            dist.broadcast_object_list(box, src=0)
            result = box[0]
        return result

    def _checkpoint(self, step: int, position: dict, best, last_eval, report) -> None:
        state = {
            "step": step,
            "position": position,
            "best": best,
            "generator": ckpt.encode_state(self.generator.get_state()),
            "resume_fields": self.job.resume_fields,
            "world_size": self.world,
        }
        if report is None:  # the plain backend: one folder, replaced whole
            with atomic_dir(self.layout.checkpoint_dir) as tmp:
                self.opt.save(tmp)
                self._save_model(tmp)
                ckpt.write_loop_state(tmp, self.rank, state)
            return
        import tempfile

        with tempfile.TemporaryDirectory(prefix="eagle3-ckpt-") as tmp:
            folder = Path(tmp)
            self.opt.save(folder)  # collective: every rank writes its own partition
            if self.rank == 0:
                self._save_model(folder)
            ckpt.write_loop_state(folder, self.rank, state)
            walk = last_eval["acceptance_walk"] if last_eval else float("nan")
            report({"step": step, "acceptance_walk": walk}, folder)

    def _save_model(self, folder: Path) -> None:
        """A checkpoint's draft/ (the model its walk scored) and, with a weight average, the
        average itself and the plain loop's raw weights, which training goes on from."""
        if self.average is None:
            save_draft(folder / ckpt.DRAFT, self.draft, self.job.provenance)
            return
        if self.job.backend == "plain":
            save_file(draft_state(self.draft), str(folder / ckpt.TRAINING_WEIGHTS), metadata={"format": "pt"})
        ckpt.save_average(folder, self.average)
        with self.average.applied():
            save_draft(folder / ckpt.DRAFT, self.draft, self.job.provenance)
