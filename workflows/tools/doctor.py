"""The wiring doctor: do config, target, store, draft and exports agree?

    python -m workflows.tools.doctor target=tiny run_dir=runs/tiny     # exit 1 on any disagreement

Each artefact is read into a side (workflows.core.wiring) and every fact is compared
across the sides that state it; each disagreement is one line naming both sides.
"""

from __future__ import annotations

from workflows.core.cli import hydra_entry
from workflows.core.log import log
from workflows.core.targets import prepare_for
from workflows.core.wiring import FIELDS, check, sides_for_run


def doctor(cfg) -> None:
    sides = sides_for_run(cfg, prepare_for(cfg, log=log))
    for s in sides:
        log(f"doctor: read {s.name}")
    errors = check(sides)
    if errors:
        for e in errors:
            log(f"doctor: ERROR {e}")
        raise SystemExit(1)
    log(f"doctor: {len(sides)} sides agree on {', '.join(FIELDS)}")


if __name__ == "__main__":  # built only when run: importing this module registers nothing with Hydra
    hydra_entry(doctor, lock=lambda cfg: False)()
