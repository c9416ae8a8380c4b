"""Atomic artefacts, done-markers and the run-folder lock: how a stage commits its work.

Each stage writes into a temporary sibling and renames it into place, then writes its
`DONE.json` last: a crash leaves no half-written artefact that looks finished. A marker
holds the hash of the stage's *key*, i.e. its config, the identity of its inputs and the
keys of the upstream stages it read (`chain`): a changed target or corpus therefore
invalidates every stage built from it, and a rerun skips exactly the stages whose key is
unchanged.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from eagle3.schema import ConfigError
from workflows.core.log import log

DONE = "DONE.json"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temp sibling, fsync, rename: readers see the old file or the new one."""
    write_bytes_atomic(Path(path), (json.dumps(data, indent=2, sort_keys=True, default=str) + "\n").encode())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temp path beside `path` to write (by any writer: Parquet, JSON, ...); it is
    renamed onto `path` when the block succeeds and removed when it fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing") from None
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None


def replace_dir(tmp: Path, final: Path) -> None:
    """Put folder `tmp` at `final`; an existing `final` is moved aside first and removed
    after (a rename needs a free name), so `final` is never half old, half new."""
    old = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{time.time_ns()}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
    replace_dir(tmp, final)


def config_hash(data: Mapping) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_marker(folder: Path) -> dict | None:
    """A finished stage folder's marker (key hash, summary, time), None when it has not finished."""
    try:
        return json.loads((Path(folder) / DONE).read_text())
    except (OSError, ValueError):
        return None


def marker_key(folder: Path) -> str | None:
    """The key hash a finished stage folder was built with."""
    return (read_marker(folder) or {}).get("key")


def stage_is_done(folder: Path, key: Mapping) -> bool:
    return marker_key(folder) == config_hash(key)


def mark_done(folder: Path, key: Mapping, summary: Mapping | None = None) -> str:
    digest = config_hash(key)
    write_json_atomic(
        Path(folder) / DONE,
        {"key": digest, "summary": dict(summary or {}), "finished": time.strftime("%Y-%m-%dT%H:%M:%S")},
    )
    return digest


def clear_done(folder: Path) -> None:
    """A stage about to rewrite its folder withdraws its marker first."""
    (Path(folder) / DONE).unlink(missing_ok=True)


def run_stage(name: str, folder: Path, key: Mapping, build: Callable[[], Mapping | None], shown: str = "") -> Path:
    """The one way a stage runs: reuse `folder` when its marker holds `key`, else build it.

    The marker is withdrawn before `build` starts, so a build killed half-way never looks
    finished (a resumable stage keeps its own committed parts and picks them up), and written
    after it returns, with the summary it returned. `shown` names what is reused in the log
    line when that is not the folder itself (the capture stage's store URL).
    """
    folder = Path(folder)
    if stage_is_done(folder, key):
        log(f"{name}: reusing {shown or folder}")
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    clear_done(folder)
    mark_done(folder, key, build())
    return folder


@contextlib.contextmanager
def folder_lock(folder: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on `folder` (its `.lock` file) while writing it; a second
    writer is refused at once, naming the holder, instead of interleaving its files."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise ConfigError(
                f"{what} {folder} is being written by {holder}; wait for it to finish or choose another run_dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} since {time.strftime('%H:%M:%S')}")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def exclusive_lock(lock_file: Path) -> Iterator[None]:
    """Wait for an exclusive lock (several workers preparing one cached target)."""
    with open(lock_file, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
