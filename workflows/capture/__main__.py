"""python -m workflows.capture [overrides]: the capture stage alone (with capture.estimate_only, its size)."""

from workflows.capture.stage import capture_main
from workflows.core.cli import hydra_entry

if __name__ == "__main__":
    hydra_entry(capture_main, lock=lambda cfg: not cfg.capture.estimate_only)()
