"""Stage `generate`: the target regenerates the answers of a prompt mixture (see `stage`).

    python -m workflows.generate [hydra overrides]

`ingest` normalises the datasets, `offline_sources` builds the offline ones, `regenerate`
is the Ray Data callable, `stage` runs and commits the stage.
"""
