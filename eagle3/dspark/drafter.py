"""Drafting with a DSpark draft in the reference decoder (eagle3.spec_decode).

The context cache and the commit are DFlash's (eagle3.dflash.drafter). A pass: the block
[anchor, mask x (K-1)] at positions n..n+K-1 over the n verified rows, one forward, then the
K guesses token by token, each slot's logits biased by the Markov head on the token chosen
before it (the anchor for the first), as vLLM's DSpark speculator samples them.

Adaptive verification (`verify_threshold` > 0, with a confidence head): the chain sent to the
target stops before the first guess where the product of the confidences so far falls below
the threshold (at least one guess is always sent). vLLM's own adaptive verification picks a
token budget for a whole batch from measured draft and verify costs; this per-sequence cut is
the reference decoder's, so that acceptance and tokens verified per pass are predicted for a
stated rule."""

from __future__ import annotations

import torch

from eagle3.dflash.drafter import DFlashDrafter
from eagle3.spec_decode import DraftTree


class DSparkDrafter(DFlashDrafter):
    def __init__(self, draft, verify_threshold: float | None = None):
        super().__init__(draft)
        self.verify_threshold = draft.cfg.verify_threshold if verify_threshold is None else verify_threshold
        self.confidences: list[list[float]] = []  # per pass, each guess's confidence (with a confidence head)

    def reset(self) -> None:
        super().reset()
        self.confidences = []

    @torch.no_grad()
    def propose(self, num_steps: int, topk: int, num_draft_tokens: int) -> DraftTree:
        d = self.draft
        hidden = self.block(num_steps, topk)  # [K, H]: every slot guesses, the anchor's first
        guesses, confidence = [], []
        prev = torch.tensor([self.anchor], device=hidden.device)
        for i in range(num_steps):
            logits, conf = d.heads(hidden[i : i + 1], prev)
            prev = d.draft_to_target(logits.argmax(-1))
            guesses.append(int(prev))
            if conf is not None:
                confidence.append(float(torch.sigmoid(conf.float())))
        keep = num_steps
        if confidence:
            self.confidences.append(confidence)
            if self.verify_threshold > 0:
                survival = torch.tensor(confidence).cumprod(0)
                keep = max(1, int((survival >= self.verify_threshold).sum()))
        return DraftTree(tokens=guesses[:keep], parents=list(range(-1, keep - 1)), depths=list(range(1, keep + 1)))
