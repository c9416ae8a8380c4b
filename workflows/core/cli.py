"""Entry points: Hydra composition, the run-folder lock, and one clear line per error.

Every `python -m workflows.<stage>` and `python -m workflows.full` goes through
`hydra_entry`: Hydra composes `conf/full.yaml` on the registered schema with the
command-line overrides, the config is loaded strictly, the run folder is locked for the
run, and the project's own errors (config, missing artefact, provenance, bad input) end
the process with one line naming what to do and exit status 2. `--debug` (or Hydra's
HYDRA_FULL_ERROR=1, or EAGLE3_DEBUG=1) shows the traceback instead.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any, Callable

from workflows.core.config import load_config, register_schema
from workflows.core.errors import USER_ERRORS
from workflows.core.layout import RunLayout
from workflows.core.log import log
from workflows.core.targets import prepare_for

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def _debug() -> bool:
    return any(os.environ.get(v) == "1" for v in ("EAGLE3_DEBUG", "HYDRA_FULL_ERROR"))


def _take_debug_flag() -> None:
    """`--debug` is ours, not Hydra's: take it out of argv before Hydra parses it."""
    if "--debug" in sys.argv:
        sys.argv.remove("--debug")
        os.environ["EAGLE3_DEBUG"] = "1"


def reporting_errors(main: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an entry point: the project's errors become one line on stderr and exit 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        _take_debug_flag()
        try:
            return main(*args, **kwargs)
        except USER_ERRORS as exc:
            if _debug():
                raise
            print(f"error: {exc}\n(--debug or HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    return wrapper


def hydra_entry(task: Callable[[Any], Any], lock: Callable[[Any], bool] = lambda cfg: True) -> Callable[[], Any]:
    """The `main()` of an entry point running `task(cfg)` on the composed FullConfig, with
    the run folder locked while it writes (when `lock(cfg)`; read-only runs do not lock).
    Building it registers the schema with Hydra: call it only when the entry point runs."""
    import hydra  # here: workflows.tools.benchmark takes `reporting_errors` alone, without Hydra

    register_schema()

    # Hydra reports exceptions of its task itself (with a traceback), so the project's
    # errors are turned into their one line inside the task.
    @hydra.main(config_path=str(CONF_DIR), config_name="full", version_base="1.3")
    @reporting_errors
    def compose(hydra_cfg) -> None:
        cfg = load_config(hydra_cfg)
        if not lock(cfg):
            return task(cfg)
        with RunLayout.of(cfg).locked():
            task(cfg)

    def main() -> None:
        _take_debug_flag()
        compose()

    return main


def stage_main(stage: str, run_stage: Callable[[Any, Path], Any]) -> Callable[[], Any]:
    """The entry point of the stage named `stage`, `run_stage(cfg, target_path)`: the target is
    prepared first. The name comes from the caller: run as a script, a stage's module is
    `__main__`, which names no stage."""

    # A stage whose output is shared between runs (multirun, sweeps) waits for that folder's
    # lock, as under workflows.full.
    def run(cfg):
        with RunLayout.of(cfg).shared_stage_lock(stage):
            return run_stage(cfg, prepare_for(cfg, log=log))

    return hydra_entry(run)
