"""Stage `capture`: the target's hidden states for every sample, into the Zarr store (see `stage`).

    python -m workflows.capture [hydra overrides]

`writer` is the pipelined capture-then-write loop of one engine actor; `stage` plans the
shards, runs the actor pool, commits and verifies.
"""
