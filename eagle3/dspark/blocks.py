"""DSpark's loss per guess, over DFlash's training pass (eagle3.dflash.blocks.score_blocks:
the same anchors, visibility and rows; the anchor's slot guesses step 0).

Per guess, with q the draft's distribution (Markov bias included, the previous token being
the text's: teacher forcing, as the paper trains) and p the target's:

    loss = ce_weight * CE(q; p)                      (the train.objective's kind; soft CE by default)
         + l1_weight * sum_v |q_v - p_v|             (twice the total variation)
         + confidence_weight * BCE(c, 1 - TV(q, p))  (c: the confidence head's logit;
                                                      1 - TV = sum_v min(p_v, q_v), held fixed)

1 - TV is the chance a token drawn from q survives speculative sampling against p, which is
what adaptive verification multiplies along the block; the guesses' weights (slot decay,
which rows are scored) are DFlash's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3.attention import upcast
from eagle3.objectives import ObjectiveConfig, acceptance_rate, position_loss


def dspark_slot_scores(draft, hidden, prev, p, objective: ObjectiveConfig):
    """(logits, loss per guess, acceptance per guess) of DSpark's guesses (see above)."""
    cfg = draft.cfg
    logits, confidence = draft.heads(hidden, prev)
    logits = upcast(logits)
    log_q = torch.log_softmax(logits, dim=-1)
    ce, _ = position_loss(objective.kind, log_q, p)
    alpha = acceptance_rate(log_q, p)  # with its graph: the L1 term below is 1 + sum p - 2 alpha
    loss = cfg.ce_weight * ce
    if cfg.l1_weight:
        loss = loss + cfg.l1_weight * (log_q.exp() - p).abs().sum(-1)
    if confidence is not None and cfg.confidence_weight:
        target = alpha.detach().clamp(0.0, 1.0)
        loss = loss + cfg.confidence_weight * F.binary_cross_entropy_with_logits(
            upcast(confidence), target, reduction="none"
        )
    return logits, loss, alpha.detach()
