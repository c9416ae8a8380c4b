"""Plumbing shared by the stages: atomic artefacts, done-markers, provenance, logging.

Each stage writes into a temporary sibling and renames it into place, then writes its
`DONE.json` last: a crash leaves no half-written artefact that looks finished, and a
rerun skips stages whose marker matches the config that would produce them.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

DONE = "DONE.json"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_json_atomic(path: Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp folder; on success it replaces `final` whole, on error it is removed."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def config_hash(data: Mapping) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stage_is_done(folder: Path, key: Mapping) -> bool:
    marker = Path(folder) / DONE
    if not marker.exists():
        return False
    try:
        return read_json(marker).get("key") == config_hash(key)
    except (OSError, ValueError):
        return False


def mark_done(folder: Path, key: Mapping, summary: Mapping | None = None) -> None:
    write_json_atomic(Path(folder) / DONE, {"key": config_hash(key), "summary": dict(summary or {}),
                                             "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})


def code_version() -> str:
    """The package version plus the git commit when run from a checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("eagle3-pipeline")
    except PackageNotFoundError:
        v = "unknown"
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{v}+{sha}" if sha else v


def python_command() -> str:
    return " ".join([Path(sys.executable).name, *sys.argv])


def stage_main(run_stage):
    """The `python -m workflows.<stage>` entry point of a stage `run_stage(cfg, target_path)`:
    Hydra composes conf/full.yaml with the command-line overrides, the target is prepared,
    the stage runs."""
    import hydra

    conf = Path(__file__).resolve().parents[1] / "conf"  # absolute: this module is not the caller

    @hydra.main(config_path=str(conf), config_name="full", version_base="1.3")
    def main(hydra_cfg) -> None:
        from workflows.config import load_config
        from workflows.target import prepare_for

        cfg = load_config(hydra_cfg)
        run_stage(cfg, prepare_for(cfg, log=log))

    return main
