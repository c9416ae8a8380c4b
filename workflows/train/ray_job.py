"""Training on Ray Train: `train.num_workers` workers, each a DeepSpeed engine over the draft.

Ray Train (V2 `TorchTrainer`) starts the workers with their process group (gloo on CPU,
NCCL with `train.gpus_per_worker > 0`), and owns the checkpoints: each worker hands its
part to `ray.train.report`, and a rerun of the same run folder finds them in
`train/ray/draft/` and gives each worker the latest through `ray.train.get_checkpoint()`.
"""

from __future__ import annotations

from pathlib import Path

from workflows.core.cluster import ensure_ray
from workflows.core.config import ClusterSection, TrainSection
from workflows.core.errors import USER_ERRORS, StageFailure
from workflows.core.log import log
from workflows.train import checkpoint as ckpt
from workflows.train.trainer import Trainer, TrainJob


def train_worker(loop_config: dict) -> None:
    """What every Ray Train worker runs."""
    import ray.train
    import torch

    job: TrainJob = loop_config["job"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    threads = loop_config.get("threads")
    if threads:
        torch.set_num_threads(threads)
    # One device, chosen once: the batches, the head and (through deepspeed_args) the module.
    device = torch.device("cpu")
    if loop_config.get("use_gpu"):
        device = ray.train.torch.get_device()
        torch.cuda.set_device(device)
    trainer = Trainer(job, rank, world, device)
    checkpoint = ray.train.get_checkpoint()

    def report(metrics: dict, folder: Path) -> None:
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(folder)))

    if checkpoint is None:
        trainer.fit(None, report)
        return
    with checkpoint.as_directory() as folder:
        restore = Path(folder)
        trainer.fit(restore, report)


def trainer_class():
    """Ray's TorchTrainer without its placement-group cleaner.

    Ray 2.60's V2 trainer starts a detached `PlacementGroupCleaner` that polls the state API
    for the controller and removes the workers' placement group when the controller looks
    dead. The state API lives in the dashboard: without one (`cluster.dashboard=false`) or
    on a loaded machine the poll can come back empty, and the cleaner then killed a healthy
    run mid-step ("Destroying worker since its placement group was removed", seen here on a
    busy 2-core machine). The controller removes its placement group itself when a run ends
    or fails, and our driver owns the controller (its death takes the run down), so the
    cleaner only covers a controller dying alone; we do without it. Ray is pinned exactly.
    """
    from ray.train.torch import TorchTrainer

    class TorchTrainerWithoutCleaner(TorchTrainer):
        def _create_default_callbacks(self):
            return [
                c for c in super()._create_default_callbacks() if type(c).__name__ != "PlacementGroupCleanerCallback"
            ]

    return TorchTrainerWithoutCleaner


def run_with_ray(
    train: TrainSection, cluster: ClusterSection, job: TrainJob, train_dir: Path, datasets=None, data_config=None
) -> None:
    """The job on Ray Train: `train.num_workers` workers on the `cluster` (started or joined);
    `datasets` and `data_config`: Ray Data datasets the workers read through
    `ray.train.get_dataset_shard` (the streaming source, workflows.train.streaming)."""
    import ray.train
    from ray.train.torch import TorchConfig

    TorchTrainer = trainer_class()
    ensure_ray(cluster)
    use_gpu = train.gpus_per_worker > 0
    resources = {"CPU": train.cpus_per_worker, **({"GPU": train.gpus_per_worker} if use_gpu else {})}
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"job": job, "use_gpu": use_gpu, "threads": max(1, int(train.cpus_per_worker))},
        scaling_config=ray.train.ScalingConfig(
            num_workers=(train.min_workers, train.num_workers) if train.elastic else train.num_workers,
            use_gpu=use_gpu,
            resources_per_worker=resources,
            elastic_resize_monitor_interval_s=train.elastic_resize_s,
        ),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        **({"datasets": datasets, "dataset_config": data_config} if datasets else {}),
        run_config=ray.train.RunConfig(
            name=ckpt.RAY_RUN_NAME,
            storage_path=str(ckpt.ray_run_dir(train_dir).parent),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=train.keep_checkpoints,
                checkpoint_score_attribute="acceptance_walk",
                checkpoint_score_order="max",
            ),
            # A restart begins from the latest checkpoint (ray.train.get_checkpoint), on as many
            # workers as the cluster holds when elastic: the Trainer resumes on that world size.
            failure_config=ray.train.FailureConfig(max_failures=train.max_failures),
        ),
    )
    size = f"{train.min_workers}-{train.num_workers} (elastic)" if train.elastic else str(train.num_workers)
    sp = train.sequence_parallel
    split = f", each sample split over {sp} (data parallel {train.num_workers // sp})" if sp > 1 else ""
    log(f"train: Ray Train, {size} worker(s) x {resources}{split}, DeepSpeed ZeRO stage {train.zero_stage}")
    try:
        trainer.fit()
    except Exception as exc:  # a worker's own error reads better than Ray's wrapper
        cause = root_cause(exc)
        if isinstance(cause, USER_ERRORS):
            raise cause from None
        dead = dead_ranks(exc)
        if dead:  # a worker process gone (killed, OOM, a lost node): nothing of its own to say
            latest = ckpt.latest_ray_checkpoint(train_dir)
            since = f"its checkpoint {latest.name}" if latest else "the start (no checkpoint was complete)"
            raise StageFailure(
                f"train: the training worker(s) of rank {dead} died ({type(cause).__name__}); "
                f"rerun the same command to resume from {since}"
            ) from None
        raise


def dead_ranks(exc: BaseException) -> list[int]:
    """The ranks whose worker process died (rather than raised) in a failed Ray Train run."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, WorkerCrashedError

    failures = getattr(exc, "worker_failures", None) or {}
    gone = (ActorDiedError, ActorUnavailableError, WorkerCrashedError)
    # Ray Train's controller finds a dead worker by its health check, whose error holds
    # the actor's (WorkerHealthCheckFailedError.health_check_failure)
    found = {rank: getattr(failure, "health_check_failure", failure) for rank, failure in failures.items()}
    return sorted(rank for rank, failure in found.items() if isinstance(root_cause(failure), gone))


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception a worker raised, through Ray's wrappers."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "worker_failures", None)
        if isinstance(inner, dict) and inner:
            exc = next(iter(inner.values()))
            continue
        inner = getattr(exc, "cause", None) or exc.__cause__
        if inner is None:
            break
        exc = inner
    return exc
