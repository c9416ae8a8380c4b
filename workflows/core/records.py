"""Typed records of the artefacts one stage writes and other modules read.

A reader outside the writing stage reads through the record, never by string key: a field
renamed or dropped by the writer then fails at the one place that reads the file, naming
the file and the field, instead of as a `KeyError` in whatever module happened to look.

`ReportHeadline`: the part of the evaluate stage's `report.json` that the full run's
headline (workflows.full) and the serve tool (workflows.tools.serve) rely on. The report
holds more (per-prompt rows, buckets, the served checks' details); those are read only by
the evaluate stage's own report writer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from workflows.core.errors import MissingArtefact
from workflows.core.markers import read_json


@dataclass(frozen=True)
class ReportHeadline:
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
    divergences: list[dict] = field(default_factory=list)  # prompts whose answer left greedy's
    served: dict = field(default_factory=dict)  # engine -> its served check (workflows.core.serving)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, report: dict, where: str = "report") -> "ReportHeadline":
        """The headline of a report dict: the writer builds it before writing (so it cannot
        write a report its readers refuse), the readers on reading."""
        fields = dataclasses.fields(cls)
        missing = [
            f.name
            for f in fields
            if f.name not in report and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise MissingArtefact(
                f"{where}: the report has no field {missing[0]!r}; it was written by another version of the "
                "evaluate stage: rerun it (stages=[evaluate])"
            )
        return cls(**{f.name: report[f.name] for f in fields if f.name in report})

    @classmethod
    def read(cls, path: Path) -> "ReportHeadline":
        return cls.of(read_json(path), str(path))
