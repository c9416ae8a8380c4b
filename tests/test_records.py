"""The typed records shared by an artefact's writer and its readers, and the train job that
crosses Ray: a report missing a field is refused naming the file and the field, and no
secret rides along to the workers."""

from __future__ import annotations

import json

import pytest

from workflows.core.config import compose
from workflows.core.errors import MissingArtefact
from workflows.core.records import ReportHeadline, VocabSummary
from workflows.train.stage import job_config

HEADLINE = {
    "acceptance_offline": 1.5,
    "acceptance_decoded": 1.45,
    "acceptance_decoded_sglang_definition": 1.6,
    "parity_ratio": 1.5 / 1.45,
    "lossless": True,
    "speedup_decoded": 0.9,
    "dtype": "float32",
    "num_steps": 3,
    "topk": 1,
    "num_draft_tokens": 4,
    "serve_args": ["--speculative-num-steps", "3"],
    "per_prompt_decoded": [{"id": "a"}],  # a field only the evaluate stage's own writer reads
}


def test_the_headline_reads_its_fields_and_leaves_the_rest(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(HEADLINE))
    r = ReportHeadline.read(path)
    assert (r.acceptance_decoded, r.num_draft_tokens, r.lossless) == (1.45, 4, True)
    assert r.divergences == [] and r.served == {}  # optional: absent from a report without them
    assert "per_prompt_decoded" not in r.as_dict()


def test_a_report_without_a_field_is_refused_naming_file_and_field(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps({k: v for k, v in HEADLINE.items() if k != "num_steps"}))
    with pytest.raises(
        MissingArtefact,
        match=r"report\.json: no field 'num_steps'; .*another version of the evaluate stage.*stages=\[evaluate\]",
    ):
        ReportHeadline.read(path)


def test_the_vocab_summary_round_trips_and_an_old_one_names_the_vocab_stage(tmp_path):
    summary = VocabSummary(
        draft_vocab_size=8,
        chosen="config",
        target_vocab_size=64,
        distinct_tokens_seen=5,
        counted_tokens=40,
        covered_fraction=1.0,
        filled=3,
    )
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary.as_dict()))
    assert VocabSummary.read(path) == summary
    path.write_text(json.dumps({k: v for k, v in summary.as_dict().items() if k != "filled"}))
    with pytest.raises(MissingArtefact, match=r"summary\.json: no field 'filled'; .*vocab stage.*stages=\[vocab\]"):
        VocabSummary.read(path)


def test_the_job_carries_no_secret_to_the_workers():
    cfg = compose(["+target.env={HF_TOKEN:hf_secret}", "+capture.storage_options={key:s3_secret}"])
    assert cfg.target.env and cfg.capture.storage_options  # the overrides took
    job = job_config(cfg)
    assert job.target.env == {} and job.capture.storage_options == {}
    assert job.train == cfg.train and job.target.capture_ids == cfg.target.capture_ids
