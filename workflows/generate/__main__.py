from workflows.core.cli import stage_main
from workflows.generate.stage import run

stage_main(run)()
