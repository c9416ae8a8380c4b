"""python -m workflows.evaluate [overrides]: the evaluate stage alone."""
from workflows.evaluate.stage import main

main()
