"""Capture faults for the failure tests, injected from the tests' side.

The capture actors are Ray processes, so patching a function in the test process does not
reach them. The stage hands Ray Data its actor class (`workflows.capture.stage.CaptureActor`)
and Ray pickles that class into each actor process; `capture_faults` swaps it, for the block,
for a subclass built inside a function. cloudpickle ships such a class by value, its fault
settings included, so the product needs no hook, setting or environment variable for them.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from workflows.capture import stage


def faulty_capture_actor(
    fail_after_shards: int | None = None,
    fail_shards: tuple[str, ...] = (),
    die_in_shards: tuple[str, ...] = (),
    marker_dir: Path | None = None,
) -> type:
    """A CaptureActor whose shards fail as the tests ask.

    fail_after_shards=N: every shard after an actor's first N fails, each attempt.
    fail_shards: shards whose name starts with one of these fail, each attempt.
    die_in_shards: the actor process exits (as a killed one does) the first time any actor meets
    one of these; `marker_dir/died-in-<shard>` records that once, naming the dead actor."""
    fail_shards, die_in_shards = tuple(fail_shards), tuple(die_in_shards)

    class FaultyCaptureActor(stage.CaptureActor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.started, load = 0, self.corpus.load

            # Every attempt at a shard, its retry included, loads the shard first: a fault
            # raised there is retried and reported as a real failure would be.
            def load_with_faults(ref):
                self.fault(ref)
                return load(ref)

            self.corpus.load = load_with_faults

        def fault(self, ref) -> None:
            if ref.name.startswith(die_in_shards):  # () matches none
                marker = Path(marker_dir) / f"died-in-{ref.name}"
                if not marker.exists():  # once per shard: the restarted actor gets through
                    marker.write_text(self.name)
                    os._exit(17)  # the process dies mid-batch, as a killed actor does
            if ref.name.startswith(fail_shards):
                raise RuntimeError(f"test fault fail_shards: simulated failure of shard {ref.name}")
            if fail_after_shards is not None:
                if self.started >= fail_after_shards:
                    raise RuntimeError(f"test fault fail_after_shards={fail_after_shards}: simulated crash")
                self.started += 1

    return FaultyCaptureActor


@contextmanager
def capture_faults(**faults) -> Iterator[None]:
    """Inside the block the capture stage runs FaultyCaptureActor (see faulty_capture_actor)."""
    if faults.get("marker_dir") is not None:
        Path(faults["marker_dir"]).mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stage, "CaptureActor", faulty_capture_actor(**faults))
        yield
