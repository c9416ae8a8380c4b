"""Stage `train`: the EAGLE-3 draft trained with training-time test (see `stage`).

    python -m workflows.train [hydra overrides]

`stage` decides what to run and marks it done; `trainer` is the one flat loop every worker
runs (DeepSpeed on Ray Train, or the plain reference in this process); `ray_job` starts the
Ray Train workers; `data` streams each worker's batches from the store; `evaluation` the
held-out figures; `checkpoint` the resume state; `tracking` logs to stdout, metrics.jsonl,
W&B and Ray metrics.
"""
