"""The run folder: where every artefact of a run lives, and the readers of the shared ones.

    <run_dir>/
      generate/   prompts.parquet, shards/<k>.parquet + <k>.done.json, accounting.{json,txt}, DONE.json
      capture/    summary.json, DONE.json            (the store itself: `store_url`, default <run_dir>/store)
      vocab/      vocab.safetensors (d2t, t2d), vocab.json, DONE.json
      train/      checkpoint/, draft/, metrics.jsonl, metrics.json, DONE.json
      export/     sglang/, vllm/, DONE.json
      report/     report.json, report.md, *.png, DONE.json     (the evaluate stage)
      benchmark/  benchmark.json                    (a served benchmark, when one was recorded)

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

from workflows.core.errors import MissingArtefact
from workflows.core.markers import folder_lock, marker_key, read_json

STAGE_DIRS = {"generate": "generate", "capture": "capture", "vocab": "vocab", "train": "train",
              "export": "export", "evaluate": "report"}


@dataclass(frozen=True)
class RunLayout:
    root: Path
    store_url: str
    storage_options: dict = field(default_factory=dict)

    @classmethod
    def of(cls, cfg) -> "RunLayout":
        root = cfg.run_path
        return cls(root, cfg.capture.store or str(root / "store"), dict(cfg.capture.storage_options))

    # ------------------------------------------------------------------- stage folders
    def stage_dir(self, stage: str) -> Path:
        return self.root / STAGE_DIRS[stage]

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
    def checkpoint_dir(self) -> Path:
        return self.stage_dir("train") / "checkpoint"

    @property
    def draft_dir(self) -> Path:
        """The trained draft (weights in SGLang's names, config, provenance)."""
        return self.stage_dir("train") / "draft"

    @property
    def sglang_export(self) -> Path:
        return self.stage_dir("export") / "sglang"

    @property
    def vllm_export(self) -> Path:
        return self.stage_dir("export") / "vllm"

    @property
    def benchmark_file(self) -> Path:
        return self.root / "benchmark" / "benchmark.json"

    # ------------------------------------------------------------------ stage markers
    def done_key(self, stage: str) -> str | None:
        return marker_key(self.stage_dir(stage))

    def require_done(self, stage: str) -> str:
        key = self.done_key(stage)
        if key is None:
            raise MissingArtefact(f"{self.stage_dir(stage)}: the {stage} stage has not finished in this run "
                                  f"folder; run it first (stages=[{stage}])")
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
        """(DraftVocab, summary) of the finished vocab stage."""
        from safetensors.torch import load_file

        from eagle3.vocab import DraftVocab

        self.require_done("vocab")
        t = load_file(str(self.vocab_file))
        summary = read_json(self.stage_dir("vocab") / "vocab.json")
        return DraftVocab(d2t=t["d2t"], t2d=t["t2d"], covered_fraction=summary["covered_fraction"],
                          filled=summary["filled"]), summary

    def require_draft(self) -> Path:
        """The trained draft's folder (train stage finished)."""
        self.require_done("train")
        return self.draft_dir

    def open_store(self, expect: dict | None = None):
        """A reader of the committed shards of the store, refusing provenance other than `expect`."""
        from storage.reader import StoreReader

        return StoreReader(self.store_url, self.storage_options, expect=expect)
