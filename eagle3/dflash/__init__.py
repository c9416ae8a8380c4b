"""DFlash, the block draft family: a few decoder layers that draft a block of tokens in one
forward over the target's fused states (`config`, `model`, `blocks`, `drafter`)."""
