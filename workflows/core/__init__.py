"""What the stages share: the config schema, the run-folder layout, provenance, markers and
locks, entry points, the Ray start-up, target engines, targets, and the wiring checks.
Nothing here imports a stage or a tool (tests/test_architecture.py)."""
