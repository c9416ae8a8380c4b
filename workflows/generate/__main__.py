"""python -m workflows.generate [overrides]: the generate stage alone."""

from workflows.core.cli import stage_main
from workflows.generate.stage import run

if __name__ == "__main__":
    stage_main("generate", run)()
