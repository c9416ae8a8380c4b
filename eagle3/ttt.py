"""Training-time test: unroll the draft on its own hidden states and score every step.

Alignment (row `t` of a sequence `x_0..x_{T-1}` with target states `h_0..h_{T-1}`):

    step 0: reads fc(h_t)               and token x_{t+1}, at position t
    step j: reads its own step-(j-1) out and token x_{t+1+j}, at position t + j
    label : the target's distribution at position t+1+j (its guess for x_{t+2+j})
    weight: decay**j where x_{t+2+j} exists and is under the loss mask

This is what inference does: after the target verified up to x_{t+1} (x_{t+1} being the
target's own "bonus" token), the draft proposes x_{t+2}, then feeds that guess back. The
tokens are teacher-forced (the text's, not the draft's own guesses); for the leading run
of correct guesses the two coincide, which is all an acceptance count needs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from eagle3.attention import TTTAttention
from eagle3.modeling import Eagle3Draft
from eagle3.schema import check_ranges


@dataclass
class NoiseConfig:
    kind: Literal["none", "gaussian", "uniform"] = "gaussian"
    std: float = 0.05  # absolute, on the captured target states (the seed pipeline's value)

    def validate(self, where: str = "noise") -> None:
        check_ranges(self, where, std=">=0")


@dataclass
class TTTConfig:
    length: int = 7
    decay: float = 0.8
    noise: NoiseConfig = field(default_factory=NoiseConfig)

    def validate(self, where: str = "ttt") -> None:
        check_ranges(self, where, length=">=1", decay="(0,1]")
        self.noise.validate(f"{where}.noise")


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, n:] padded at the end with `fill` (same shape as x)."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def add_noise(aux: torch.Tensor, cfg: NoiseConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """Robustness noise on the target states (train only): serving features drift."""
    if cfg.kind == "none" or cfg.std == 0:
        return aux
    if cfg.kind == "gaussian":
        noise = torch.randn(aux.shape, generator=generator, dtype=torch.float32, device=aux.device) * cfg.std
    else:  # uniform with the same standard deviation: U(-a, a) has std a / sqrt(3)
        a = cfg.std * 3**0.5
        noise = (torch.rand(aux.shape, generator=generator, dtype=torch.float32, device=aux.device) * 2 - 1) * a
    return aux + noise.to(aux.dtype)


def unroll(draft: Eagle3Draft, input_ids, aux, attention_mask, length: int) -> list[torch.Tensor]:
    """The TTT forward: pre-norm draft hidden states of steps 0..length-1, each [B, T, H]."""
    _, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device)[None].expand_as(input_ids)
    state = TTTAttention(attention_mask)
    hidden = draft.fuse(aux)
    outs = []
    for j in range(length):
        out = draft.step(shift_left(input_ids, 1 + j), hidden, positions + j, state)
        outs.append(out)
        hidden = out
    return outs


def step_weights(loss_mask: torch.Tensor, attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """[B, T, L] float: 1 where row t's step-j prediction (of x_{t+2+j}) is scored."""
    m = (loss_mask.bool() & attention_mask.bool()).float()
    return torch.stack([shift_left(m, 2 + j) for j in range(length)], dim=-1)


@dataclass
class StepScores:
    loss: torch.Tensor  # scalar, decay-weighted sum over steps
    step_loss: list[float]
    step_acc: list[float]
    correct: torch.Tensor  # [B, T, L] bool: draft argmax == target argmax
    weights: torch.Tensor  # [B, T, L]


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """-sum_v p(v) log q(v) per position; logits [..., V], probs [..., V] -> [...]."""
    return -(target_probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


def score_steps(draft: Eagle3Draft, hiddens, target_probs, target_argmax, weights, decay: float) -> StepScores:
    """Loss and accuracy of each unrolled step against the target, as defined above."""
    total = 0.0
    step_loss, step_acc, correct = [], [], []
    for j, hidden in enumerate(hiddens):
        logits = draft.logits(hidden)
        w = weights[..., j]
        probs = shift_left(target_probs, 1 + j)
        best = shift_left(target_argmax, 1 + j)
        denom = w.sum().clamp_min(1.0)
        loss_j = (soft_cross_entropy(logits, probs) * w).sum() / denom
        total = total + (decay**j) * loss_j
        hit = draft.draft_to_target(logits.argmax(-1)) == best
        correct.append(hit)
        step_loss.append(float(loss_j.detach()))
        step_acc.append(float((hit.float() * w).sum() / denom))
    return StepScores(
        loss=total, step_loss=step_loss, step_acc=step_acc,
        correct=torch.stack(correct, dim=-1), weights=weights,
    )
