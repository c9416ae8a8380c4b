from workflows.capture.stage import capture_main
from workflows.core.cli import hydra_entry

hydra_entry(capture_main, lock=lambda cfg: not cfg.capture.estimate_only)()
