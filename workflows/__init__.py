"""The pipeline around the maths: `core` (what stages share), one package or module per
stage (generate, capture, vocab, train, export, evaluate), `tools`, and `full` (all stages)."""
