"""Training objectives of one unrolled step, per position, over the draft vocabulary.

`p` is the target's distribution restricted to the draft vocabulary and renormalised
there (eagle3.target_head), `q` the draft's softmax. Per position:

    acceptance  a = sum_v min(p_v, q_v)       P(a token sampled from q is accepted by
                                               speculative sampling against p)
    soft_ce     -sum_v p_v log q_v            the usual EAGLE-3 loss (= KL(p||q) + H(p))
    log_acceptance   -log a                   maximises expected acceptance directly
    kl_acceptance    w KL(p||q) + (1 - a),    w = 1 - a, held constant (no gradient):
                                               KL leads while the draft is far off, the
                                               acceptance term takes over as a grows

KL and soft CE differ by the target's entropy, a constant: their gradients are equal.
The acceptance objectives have small gradients where the draft puts no mass on the
target's tokens (min(p, q) is flat in q_v when q_v > p_v and the draft is everywhere
above), which is why the mix keeps a KL term early on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from eagle3.schema import ConfigError, check_ranges

OBJECTIVES = ("soft_ce", "log_acceptance", "kl_acceptance")


@dataclass
class ObjectiveConfig:
    # soft_ce: cross-entropy against the target's distribution (EAGLE-3's); log_acceptance:
    # -log a, a = sum min(p_target, p_draft); kl_acceptance: (1 - a) KL + (1 - a).
    kind: Literal["soft_ce", "log_acceptance", "kl_acceptance"] = "soft_ce"
    # How a step's loss is averaged: over its scored positions ("scored"), or over every
    # real position of the batch, scored or not ("positions": SpecForge 0.2.0's mean over
    # B*T, which weighs a batch by the share of its tokens under the loss mask).
    normalise: Literal["scored", "positions"] = "scored"
    # Leave out positions whose target argmax lies outside the draft vocabulary: the draft
    # can never propose that token there (SpecForge masks them). Their accuracy still
    # counts as a miss.
    skip_unreachable: bool = False
    # Which positions training scores: "all" (every real token, the prompt's too, each
    # labelled with the target's own distribution there: more positions per sample from
    # the same data; the draft underfits, so this helps: docs/results.md, the ablations),
    # "answer" (the loss mask only, as SpecForge 0.2.0), or "fade": every position at first,
    # the prompt's weighed linearly down from 1 at step 0 to 0 at `fade_until` of the run's
    # learning-rate horizon, the answers only after (issue 26: the prompt's labels help
    # while the draft underfits, and may only take capacity from the answers once it has
    # seen them several times). Evaluation always scores the answers.
    tokens: Literal["answer", "all", "fade"] = "all"
    fade_until: float = 0.5  # tokens=fade: the fraction of the horizon where the prompt's weight reaches 0
    # soft_ce a block of this many rows at a time (eagle3.chunked_loss), the logits
    # recomputed in backward: per TTT step autograd keeps no [T, draft vocab] tensor (1 GiB
    # at T 8192, vocab 32000), for one more lm_head matmul. 0: all rows at once.
    loss_block_rows: int = 0
    # How the TTT steps' losses are weighed: "decay" (step j by ttt.decay**j at every
    # position, as EAGLE-3) or "chain" (each position's step j by how much it adds to that
    # position's expected accepted length in chain decoding, `chain_weights`; ttt.decay is
    # not used). A step only counts when every step before it was right: where the draft's
    # step 0 already misses, its later steps are never reached in serving, and "decay"
    # spends the same effort on them as on the steps that are.
    weighting: Literal["decay", "chain"] = "decay"

    def validate(self, where: str = "objective") -> None:
        if self.kind not in OBJECTIVES:
            raise ConfigError(f"{where}.kind={self.kind!r} is not one of {list(OBJECTIVES)}")
        if self.normalise not in ("scored", "positions"):
            raise ConfigError(f"{where}.normalise={self.normalise!r} is not 'scored' or 'positions'")
        if self.tokens not in ("answer", "all", "fade"):
            raise ConfigError(f"{where}.tokens={self.tokens!r} is not 'answer', 'all' or 'fade'")
        if self.weighting not in ("decay", "chain"):
            raise ConfigError(f"{where}.weighting={self.weighting!r} is not 'decay' or 'chain'")
        check_ranges(self, where, loss_block_rows=">=0", fade_until="(0,1]")
        if self.loss_block_rows and self.weighting == "chain":
            raise ConfigError(
                f"{where}.weighting='chain' reads each step's probability of the target's token, which "
                f"{where}.loss_block_rows={self.loss_block_rows} does not keep: set it to 0"
            )
        if self.loss_block_rows and self.kind != "soft_ce":
            raise ConfigError(
                f"{where}.loss_block_rows={self.loss_block_rows} computes soft_ce in blocks; "
                f"{where}.kind={self.kind!r} needs the whole distribution: set it to 0"
            )

    def prompt_weight(self, step: int, horizon: int) -> float:
        """The weight of the prompt's positions in training at `step` of a `horizon`-step run
        (the answers' weigh 1): 1 for "all", 0 for "answer", the fade's ramp for "fade"."""
        if self.tokens != "fade":
            return 1.0 if self.tokens == "all" else 0.0
        return max(0.0, 1.0 - step / (self.fade_until * horizon))


def acceptance_rate(log_q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """sum_v min(p_v, q_v): [..., V] -> [...] (fp32)."""
    return torch.minimum(p, log_q.exp()).sum(-1)


def position_loss(kind: str, log_q: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per position, acceptance per position) for log_q = log_softmax(draft logits).

    What autograd keeps per position is held to the [.., V] tensors the gradient needs
    (log_q, which log_softmax saves anyway, and p, the target's, shared by every TTT step):
    the acceptance figure is computed without a graph where the loss does not use it, and
    the KL's entropy term, a constant, without one too."""
    if kind == "soft_ce":
        with torch.no_grad():
            alpha = acceptance_rate(log_q, p)
        return -(p * log_q).sum(-1), alpha
    alpha = acceptance_rate(log_q, p)
    if kind == "log_acceptance":
        return -torch.log(alpha.clamp_min(1e-6)), alpha
    if kind == "kl_acceptance":
        with torch.no_grad():
            neg_entropy = (p * torch.log(p.clamp_min(1e-30))).sum(-1)
        kl = neg_entropy - (p * log_q).sum(-1)
        return (1 - alpha).detach() * kl + (1 - alpha), alpha
    raise ValueError(f"unknown objective {kind!r}; known: {list(OBJECTIVES)}")


def chain_weights(hit_chance: torch.Tensor) -> torch.Tensor:
    """[..., L] chance c_j that step j's guess is the target's token -> [..., L] weights g_j.

    In chain decoding a position yields E = sum_m prod_{i<=m} c_i accepted drafts (step m
    counts only if steps 0..m all hit). Its derivative in c_j is

        g_j = prod_{i<j} c_i  *  (1 + c_{j+1} + c_{j+1} c_{j+2} + ...)
              (step j reached)   (what step j's hit goes on to unlock)

    so a loss sum_j g_j loss_j, with g held constant and loss_j a surrogate for -c_j, climbs
    the expected accepted length. Computed backwards: tail_{L-1} = 1,
    tail_j = 1 + c_{j+1} tail_{j+1}; reach_0 = 1, reach_j = reach_{j-1} c_{j-1}."""
    c = hit_chance.float()
    length = c.shape[-1]
    ones = torch.ones_like(c[..., :1])
    reach = torch.cumprod(torch.cat([ones, c[..., :-1]], dim=-1), dim=-1)
    tails = [ones[..., 0]]
    for j in range(length - 2, -1, -1):
        tails.append(1 + c[..., j + 1] * tails[-1])
    return reach * torch.stack(tails[::-1], dim=-1)
