"""python -m workflows.evaluate [overrides]: the evaluate stage alone."""

from workflows.core.cli import stage_main
from workflows.evaluate.stage import run

if __name__ == "__main__":
    stage_main("evaluate", run)()
