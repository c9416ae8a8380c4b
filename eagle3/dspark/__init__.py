"""DSpark: the DFlash block draft plus a low-rank Markov head and a confidence head (arXiv 2607.05147)."""
