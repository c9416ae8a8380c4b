"""Typed records of the artefacts one stage writes and other modules read.

A reader outside the writing stage reads through the record, never by string key: a field
renamed or dropped by the writer then fails at the one place that reads the file, naming
the file and the field, instead of as a `KeyError` in whatever module happened to look.

`ReportHeadline`: the part of the evaluate stage's `report.json` that the full run's
headline (workflows.full) and the serve tool (workflows.tools.serve) rely on. The report
holds more (per-prompt rows, buckets, the served checks' details); those are read only by
the evaluate stage's own report writer.

`VocabSummary`: the vocab stage's `summary.json`, read with the vocab map by the train
stage (RunLayout.read_vocab) and carried whole into the draft's provenance.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from workflows.core.errors import MissingArtefact
from workflows.core.markers import read_json


class Record:
    """A typed record read from a JSON artefact: `of` keeps the fields it declares (the
    artefact may hold more) and refuses one that lacks a field without a default."""

    STAGE = ""  # the stage that writes the artefact: the message says which one to rerun

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, data: dict, where: str = "the artefact"):
        fields = dataclasses.fields(cls)
        missing = [
            f.name
            for f in fields
            if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise MissingArtefact(
                f"{where}: no field {missing[0]!r}; it was written by another version of the {cls.STAGE} "
                f"stage: rerun it (stages=[{cls.STAGE}])"
            )
        return cls(**{f.name: data[f.name] for f in fields if f.name in data})

    @classmethod
    def read(cls, path: Path):
        return cls.of(read_json(path), str(path))


@dataclass(frozen=True)
class ReportHeadline(Record):
    acceptance_offline: float  # the walk's prediction (eagle3.metrics)
    acceptance_decoded: float  # the reference decoder's
    acceptance_decoded_sglang_definition: float
    parity_ratio: float  # offline / decoded
    lossless: bool  # every decoded answer identical to greedy decoding
    speedup_decoded: float
    dtype: str  # what the reference decoder computed in
    # The drafting evaluated, which the serve tool serves unless told otherwise.
    num_steps: int
    topk: int
    num_draft_tokens: int
    serve_args: list[str]
    draft_family: str = "eagle3"  # eagle3.families; reports written before families are EAGLE-3's
    serve_engine: str = "sglang"  # the engine workflows.tools.serve launches with serve_args
    # The reference decoder's figure in vLLM's definition (the served check's vLLM prediction).
    acceptance_decoded_vllm_definition: float | None = None
    device: str | None = None  # where it was evaluated ("cpu", "cuda"); None: not said (older reports)
    divergences: list[dict] = field(default_factory=list)  # prompts whose answer left greedy's
    served: dict = field(default_factory=dict)  # engine -> its served check (workflows.core.serving)

    STAGE = "evaluate"


@dataclass(frozen=True)
class VocabSummary(Record):
    draft_vocab_size: int  # the slots of the draft's vocabulary
    chosen: str  # "config" (draft.draft_vocab_size) or "auto" (sized from the distinct tokens seen)
    target_vocab_size: int
    distinct_tokens_seen: int  # in the train answers the vocab was counted over
    counted_tokens: int
    covered_fraction: float  # of the counted tokens, the part the draft vocab holds
    filled: int  # slots filled with the lowest unused ids (fewer distinct tokens than slots)
    # Of the held-out split's answer tokens, the part the draft vocab holds: the rest can never
    # be drafted, a ceiling on acceptance that no training lifts. None: no held-out split.
    heldout_covered_fraction: float | None = None

    STAGE = "vocab"
