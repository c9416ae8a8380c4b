"""`run_stage`, the one way every stage runs: reuse on an unchanged key, rebuild on a changed
one, and never a marker over a build that did not finish."""

from __future__ import annotations

import pytest

from workflows.core.markers import read_marker, run_stage, stage_is_done


def test_a_finished_stage_is_reused_and_a_changed_key_rebuilds(tmp_path):
    calls = []

    def build():
        calls.append(1)
        (tmp_path / "out" / "artefact.txt").write_text(str(len(calls)))
        return {"built": len(calls)}

    folder = tmp_path / "out"
    assert run_stage("demo", folder, {"a": 1}, build) == folder
    assert read_marker(folder)["summary"] == {"built": 1}
    run_stage("demo", folder, {"a": 1}, build)
    assert len(calls) == 1  # reused: the build did not run again
    run_stage("demo", folder, {"a": 2}, build)
    assert len(calls) == 2 and read_marker(folder)["summary"] == {"built": 2}
    assert stage_is_done(folder, {"a": 2}) and not stage_is_done(folder, {"a": 1})


def test_a_failed_build_withdraws_the_old_marker(tmp_path):
    folder = tmp_path / "out"
    run_stage("demo", folder, {"a": 1}, lambda: {})

    def broken():
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        run_stage("demo", folder, {"a": 2}, broken)
    # Neither the old key nor the new one reads as done: the folder holds a half-built stage.
    assert read_marker(folder) is None
    assert not stage_is_done(folder, {"a": 1})
