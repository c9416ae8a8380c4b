"""Pipeline stages: one entry module per stage (generate, capture, vocab, train, export, ...)."""
