from workflows.core.cli import stage_main
from workflows.train.stage import run

stage_main(run)()
