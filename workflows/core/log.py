"""The one progress line format of every stage and tool: `[HH:MM:SS] message`, flushed.

A leaf (the standard library only), so any module of the project can log without importing
the entry points of workflows.core.cli, which import the targets.
"""

from __future__ import annotations

import time


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
