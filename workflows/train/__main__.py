"""python -m workflows.train [overrides]: the train stage alone."""

from workflows.core.cli import stage_main
from workflows.train.stage import run

if __name__ == "__main__":
    stage_main("train", run)()
