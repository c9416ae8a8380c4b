"""Stage `train`: the EAGLE-3 draft trained with training-time test (see `stage`).

    python -m workflows.train [hydra overrides]

`store_data` reads training batches from the capture store, `checkpoint` holds resume
state, `tracking` logs to stdout, metrics.jsonl and W&B.
"""
