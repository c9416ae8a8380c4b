"""The evaluate stage's key is made of the settings that change its report
(eagle3.schema.output_dict): a raised served_timeout_s reuses a finished report, unless an
engine ran out of a shorter limit in it; num_steps or the vLLM interpreter evaluate again."""

import dataclasses
import json

import pytest

from workflows.core.config import compose
from workflows.core.errors import ServingError
from workflows.core.layout import RunLayout
from workflows.core.markers import mark_done
from workflows.core.serving import ServeJob, serve_prompts
from workflows.evaluate import stage


def with_evaluate(cfg, **changes):
    return dataclasses.replace(cfg, evaluate=dataclasses.replace(cfg.evaluate, **changes))


@pytest.fixture
def evaluated(tmp_path, monkeypatch):
    """A run folder with a finished train stage, and the evaluate stage's work replaced by
    one that writes the report `served` says and counts its calls."""
    cfg = compose(["target=tiny", f"run_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"])
    layout = RunLayout.of(cfg)
    mark_done(layout.stage_dir("train"), {"trained": 1}, {})
    monkeypatch.setattr(stage, "target_identity", lambda path, cache: {"target": str(path)})
    calls = {"n": 0, "served": {}}

    def evaluate_into(cfg, layout, target_path, out):
        calls["n"] += 1
        (out / "report.json").write_text(json.dumps({"served": calls["served"]}))
        return {}

    monkeypatch.setattr(stage, "evaluate_into", evaluate_into)
    return cfg, layout, calls


def test_a_not_output_setting_reuses_the_finished_report_and_an_output_one_does_not(evaluated, tmp_path):
    cfg, _, calls = evaluated
    target = tmp_path / "target"
    stage.run(cfg, target)
    assert calls["n"] == 1
    stage.run(with_evaluate(cfg, served_timeout_s=7200.0), target)
    assert calls["n"] == 1  # reused
    stage.run(with_evaluate(cfg, num_steps=cfg.evaluate.num_steps + 1), target)
    assert calls["n"] == 2
    stage.run(with_evaluate(cfg, vllm_python="/opt/other-vllm/bin/python"), target)  # another vLLM's figures
    assert calls["n"] == 3


def test_a_report_whose_engine_ran_out_of_time_is_evaluated_again_under_a_longer_limit(evaluated, tmp_path):
    cfg, layout, calls = evaluated
    target = tmp_path / "target"
    # The message the served check records for an engine out of time (served=auto records it).
    job = ServeJob(
        engine="vllm", target_path=str(target), draft_path=str(target), num_steps=3, topk=1, num_draft_tokens=4
    )
    job.prompts, job.max_new_tokens, job.timeout_s = [[1, 2]], [4], 0.5
    with pytest.raises(ServingError) as timed:
        serve_prompts(job, log=lambda _m: None)
    calls["served"] = {"vllm": {"engine_name": "vllm", "error": str(timed.value)}, "sglang": {"skipped": "x"}}
    short = with_evaluate(cfg, served_timeout_s=0.5)
    stage.run(short, target)
    assert stage.timed_out(layout.report_file) == [("vllm", 0.5)]
    assert calls["n"] == 1
    stage.run(short, target)  # the same limit: the same report
    assert calls["n"] == 1
    calls["served"] = {"vllm": {"engine_name": "vllm", "accept_length": 3.9}}
    stage.run(with_evaluate(cfg, served_timeout_s=600.0), target)  # a longer one: served again
    assert calls["n"] == 2 and stage.timed_out(layout.report_file) == []
    stage.run(with_evaluate(cfg, served_timeout_s=900.0), target)  # nothing ran out: reused
    assert calls["n"] == 2
