"""The run folder: where every artefact of a run lives, and the readers of the shared ones.

    <run_dir>/
      generate/   prompts.parquet, shards/<k>.parquet + <k>.done.json, accounting.{json,txt}, DONE.json
      capture/    summary.json, DONE.json            (the store itself: `store_url`, default <run_dir>/store)
      vocab/      vocab.safetensors (d2t, t2d), vocab.json, DONE.json
      train/      checkpoint/, draft/, metrics.jsonl, metrics.json, DONE.json
      export/     sglang/, vllm/, DONE.json
      report/     report.json, report.md, *.png, DONE.json     (the evaluate stage)
      benchmark/  benchmark.json                    (a served benchmark, when one was recorded)

With sharing on (`shared_dir`, on by default under Hydra multirun and W&B sweeps) the
stages that build the corpus, the store and the vocabulary live outside the run folder,
content-addressed, so that runs agreeing on what determines them reuse one copy:

    <shared_dir>/generate/<g>/        as generate/ above; g = hash(target minus capture ids, mixture, data, seed)
    <shared_dir>/capture/<c>/         summary.json, DONE.json, store/   c = hash(g, target, capture settings)
    <shared_dir>/vocab/<v>/           as vocab/ above; v = hash(g, draft_vocab_size, vocab_size)

(an explicit `capture.store` URL then holds the store at `<capture.store>/<c>`). A shared
stage is run under a lock beside its folder (`shared_stage_lock`): a second run waits,
then finds it done and reuses it.

Stages ask this module for paths and for the artefacts of the stages before them
(`read_corpus`, `read_vocab`, `open_store`, the draft folder); none spells a path itself.
`require_done(stage)` is the check that an upstream stage has finished, with the
message that says how to run it.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from eagle3.schema import output_dict
from workflows.core.errors import MissingArtefact
from workflows.core.markers import config_hash, exclusive_lock, folder_lock, marker_key, read_json
from workflows.core.records import VocabSummary

STAGE_DIRS = {
    "generate": "generate",
    "capture": "capture",
    "vocab": "vocab",
    "train": "train",
    "export": "export",
    "evaluate": "report",
}
SHARED_STAGES = ("generate", "capture", "vocab")  # the stages runs can share (see shared_dirs)


def _section(cfg, name: str, *also_drop: str) -> dict:
    """A config section as the shared folders' hashes see it: its output settings only
    (eagle3.schema.NOT_OUTPUT marks the others; the stages' own done-keys are built alike)."""
    return {k: v for k, v in output_dict(getattr(cfg, name)).items() if k not in also_drop}


def shared_hashes(cfg) -> dict[str, str]:
    """Stage -> the hash naming its shared folder: the config that determines its output,
    chained with its upstream stage's hash (a new corpus means a new store and vocab)."""
    generate = config_hash(
        {
            "target": _section(cfg, "target", "capture_layer_ids"),
            "data": _section(cfg, "data"),
            "mixture": output_dict(dict(cfg.mixture)),
            "seed": cfg.seed,
        }
    )
    capture = config_hash(
        {
            "generate": generate,
            "target": _section(cfg, "target"),
            "capture_ids": cfg.store_capture_ids,
            "capture": _section(cfg, "capture"),
        }
    )
    vocab = config_hash(
        {"generate": generate, "draft_vocab_size": cfg.draft.draft_vocab_size, "vocab_size": cfg.target.vocab_size}
    )
    return {"generate": generate, "capture": capture, "vocab": vocab}


@dataclass(frozen=True)
class RunLayout:
    root: Path
    store_url: str
    storage_options: dict = field(default_factory=dict)
    shared: dict[str, Path] = field(default_factory=dict)  # stage -> its shared folder (sharing on)

    @classmethod
    def of(cls, cfg) -> "RunLayout":
        root, options = cfg.run_path, dict(cfg.capture.storage_options)
        if not cfg.shared_dir:
            return cls(root, cfg.capture.store or str(root / "store"), options)
        hashes = shared_hashes(cfg)
        shared = {stage: Path(cfg.shared_dir) / stage / hashes[stage] for stage in SHARED_STAGES}
        store = (
            f"{cfg.capture.store.rstrip('/')}/{hashes['capture']}"
            if cfg.capture.store
            else str(shared["capture"] / "store")
        )
        return cls(root, store, options, shared)

    # ------------------------------------------------------------------- stage folders
    def stage_dir(self, stage: str) -> Path:
        return self.shared.get(stage) or self.root / STAGE_DIRS[stage]

    @contextlib.contextmanager
    def shared_stage_lock(self, stage: str) -> Iterator[None]:
        """Wait for exclusive use of a shared stage's folder (nothing for a run's own stages).
        The lock file sits beside the folder: the vocab stage replaces its folder whole."""
        folder = self.shared.get(stage)
        if folder is None:
            yield
            return
        folder.parent.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(folder.with_name(f"{folder.name}.lock")):
            yield

    @property
    def prompts_file(self) -> Path:
        return self.stage_dir("generate") / "prompts.parquet"

    @property
    def corpus_shards(self) -> Path:
        return self.stage_dir("generate") / "shards"

    @property
    def vocab_file(self) -> Path:
        return self.stage_dir("vocab") / "vocab.safetensors"

    @property
    def vocab_summary_file(self) -> Path:
        return self.stage_dir("vocab") / "vocab.json"

    @property
    def checkpoint_dir(self) -> Path:
        return self.stage_dir("train") / "checkpoint"

    @property
    def draft_dir(self) -> Path:
        """The trained draft (weights in SGLang's names, config, provenance)."""
        return self.stage_dir("train") / "draft"

    def export_dir(self, engine: str) -> Path:
        """The export stage's folder for one serving engine ("sglang", "vllm")."""
        return self.stage_dir("export") / engine

    @property
    def sglang_export(self) -> Path:
        return self.export_dir("sglang")

    @property
    def vllm_export(self) -> Path:
        return self.export_dir("vllm")

    @property
    def report_file(self) -> Path:
        """The evaluate stage's report (read through workflows.core.records.ReportHeadline)."""
        return self.stage_dir("evaluate") / "report.json"

    @property
    def report_markdown(self) -> Path:
        return self.stage_dir("evaluate") / "report.md"

    @property
    def heldout_prompts_file(self) -> Path:
        """The held-out prompts as the evaluate stage served them (workflows.tools.benchmark --prompts)."""
        return self.stage_dir("evaluate") / "prompts.jsonl"

    @property
    def metrics_file(self) -> Path:
        """The train stage's final held-out figures."""
        return self.stage_dir("train") / "metrics.json"

    @property
    def capture_summary_file(self) -> Path:
        return self.stage_dir("capture") / "summary.json"

    @property
    def accounting_files(self) -> tuple[Path, Path]:
        """The generate stage's accounting (json, txt): every conversation in, kept or skipped by reason."""
        return self.stage_dir("generate") / "accounting.json", self.stage_dir("generate") / "accounting.txt"

    @property
    def benchmark_file(self) -> Path:
        return self.root / "benchmark" / "benchmark.json"

    # ------------------------------------------------------------------ stage markers
    def done_key(self, stage: str) -> str | None:
        return marker_key(self.stage_dir(stage))

    def require_done(self, stage: str) -> str:
        key = self.done_key(stage)
        if key is None:
            raise MissingArtefact(
                f"{self.stage_dir(stage)}: the {stage} stage has not finished in this run "
                f"folder; run it first (stages=[{stage}])"
            )
        return key

    def chain(self, *stages: str) -> dict:
        """The done-keys of upstream stages, for a stage key: a rebuilt upstream stage
        invalidates everything built from it."""
        return {stage: self.require_done(stage) for stage in stages}

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with folder_lock(self.root, "run folder"):
            yield

    # ------------------------------------------------------------------------ readers
    def committed_corpus_shards(self) -> dict[int, dict]:
        """Corpus shard index -> its commit record, for shards whose marker exists."""
        return {int(m.name.split(".")[0]): read_json(m) for m in sorted(self.corpus_shards.glob("*.done.json"))}

    def corpus_shard_file(self, index: int) -> Path:
        return self.corpus_shards / f"{index:05d}.parquet"

    def read_corpus(self) -> list[dict]:
        """Every committed conversation of the finished generate stage, shards in order: id,
        dataset, split, messages, prompt, answer, finish, input_ids, loss_mask, truncated."""
        import pyarrow.parquet as pq

        self.require_done("generate")
        rows = []
        for k in sorted(self.committed_corpus_shards()):
            for r in pq.read_table(self.corpus_shard_file(k)).to_pylist():
                messages = json.loads(r.pop("messages_json"))
                users = [m["content"] for m in messages if m["role"] == "user"]
                answers = [m["content"] for m in messages if m["role"] == "assistant"]
                r.update(messages=messages, prompt=users[0] if users else "", answer=answers[-1] if answers else "")
                for name in ("status", "error", "shard"):
                    r.pop(name)
                rows.append(r)
        return rows

    def read_vocab(self):
        """(DraftVocab, VocabSummary) of the finished vocab stage."""
        from safetensors.torch import load_file

        from eagle3.vocab import DraftVocab

        self.require_done("vocab")
        t = load_file(str(self.vocab_file))
        summary = VocabSummary.read(self.vocab_summary_file)
        return DraftVocab(
            d2t=t["d2t"], t2d=t["t2d"], covered_fraction=summary.covered_fraction, filled=summary.filled
        ), summary

    def require_draft(self) -> Path:
        """The trained draft's folder (train stage finished)."""
        self.require_done("train")
        return self.draft_dir

    def open_store(self, expect: dict | None = None, aux_layers: list[int] | None = None):
        """A reader of the committed shards of the store, refusing provenance other than
        `expect`; `aux_layers`: the capture ids it hands out (storage.reader.StoreReader)."""
        from storage.reader import StoreReader
        from storage.store import StoreError
        from workflows.core.provenance import engine_captured_mismatch

        reader = StoreReader(self.store_url, self.storage_options, expect=expect, aux_layers=aux_layers)
        mismatch = engine_captured_mismatch(reader.provenance, f"store {self.store_url}")
        if mismatch:  # the layers its engines really captured, not only the ids it names
            raise StoreError(mismatch)
        return reader
