"""Entry points as a user meets them: one clear line per error, locks, multirun folders,
target identity, and secrets kept out of what is printed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.schema import ConfigError
from workflows.core import provenance
from workflows.core.layout import RunLayout
from workflows.core.markers import folder_lock
from workflows.tools.serve import printable_command

ROOT = Path(__file__).resolve().parents[1]


def run_module(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0", "EAGLE3_DEBUG": "0", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300
    )


def test_serve_before_export_says_what_to_do_without_a_traceback(tiny_target, tmp_path):
    args = [
        "target=tiny",
        f"cache_dir={tiny_target.parent.parent}",
        f"run_dir={tmp_path}",
        "serve.num_steps=1",
        "serve.topk=1",
        "serve.num_draft_tokens=16",
    ]
    proc = run_module("workflows.tools.serve", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "run the export stage first" in errors[0], proc.stderr
    # --debug shows where it came from.
    debug = run_module("workflows.tools.serve", *args, "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr + debug.stdout


def test_a_missing_checkpoint_is_one_line(tmp_path):
    proc = run_module(
        "workflows.full", "target=kimi_k25_int4", f"target.path={tmp_path / 'absent'}", f"run_dir={tmp_path / 'run'}"
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout
    assert f"error: target.path='{tmp_path / 'absent'}' does not exist" in proc.stderr


def test_a_value_out_of_range_is_refused_at_load(tmp_path):
    proc = run_module("workflows.full", "target=tiny", "train.log_every=0", f"run_dir={tmp_path}")
    assert proc.returncode == 2 and "error: train.log_every=0 is out of range: it must be >= 1" in proc.stderr
    assert not any(tmp_path.glob("*/DONE.json")) and not (tmp_path / "generate").exists()  # refused before any stage


def test_multirun_gives_each_job_its_own_run_folder(tiny_target, tmp_path):
    proc = run_module(
        "workflows.full",
        "-m",
        "target=tiny",
        f"cache_dir={tiny_target.parent.parent}",
        f"run_dir={tmp_path}",
        "stages=[target]",
        "train.steps=1,2",
        "+target.env.HF_TOKEN=hf_SECRET_9",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = sorted(p.name for p in (tmp_path / "multirun").iterdir() if p.name != "hydra")
    # Named by their overrides, less locations and secret-bearing values.
    assert jobs == ["stages=[target],target=tiny,train.steps=1", "stages=[target],target=tiny,train.steps=2"]
    # Our own log lines never show it (Hydra's launcher echoes the command line as typed).
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("[") and "HYDRA" not in line]
    assert ours and not any("hf_SECRET_9" in line for line in ours)
    assert not list(tmp_path.rglob(".hydra"))  # no unredacted copy of the config


def test_a_run_folder_has_one_writer_at_a_time(tmp_path):
    layout = RunLayout(tmp_path / "run", str(tmp_path / "run" / "store"))
    with layout.locked():
        with pytest.raises(ConfigError, match=r"run folder .*run is being written by pid \d+"):
            with folder_lock(layout.root, "run folder"):
                pass
    with layout.locked():  # released: the next run takes it
        pass


def test_target_identity_is_computed_once_and_follows_the_weights(tiny_target, tmp_path, monkeypatch):
    folder = tmp_path / "my_checkpoint"  # a user's own checkpoint: no PREPARED.json
    shutil.copytree(tiny_target, folder)
    (folder / provenance.PREPARED).unlink()
    first = provenance.target_identity(folder, tmp_path / "cache")
    assert first["weights_sha256"] and first["path"] == str(folder) and "prepared" not in first

    def no_rehash(_folder):
        raise AssertionError("weights hashed again")

    monkeypatch.setattr(provenance, "weights_sha256", no_rehash)
    assert provenance.target_identity(folder, tmp_path / "cache") == first  # cached
    monkeypatch.undo()
    with open(folder / "model.safetensors", "ab") as f:  # other weights, same name
        f.write(b"\0")
    assert provenance.target_identity(folder, tmp_path / "cache")["weights_sha256"] != first["weights_sha256"]


def test_printed_commands_mask_the_presets_environment():
    line = printable_command(
        ["python", "-m", "sglang.launch_server"], {"HF_TOKEN": "hf_abc", "PYTHONPATH": "/x"}, secret_keys={"HF_TOKEN"}
    )
    assert "hf_abc" not in line and "HF_TOKEN=<redacted>" in line and "PYTHONPATH=/x" in line
