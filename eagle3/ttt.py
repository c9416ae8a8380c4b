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

Packed rows (several samples in one row, see eagle3.target_features.pack_samples) carry
`position_ids` (restarting at 0 per sample) and `segment_ids` (0, 1, .. per sample, -1 on
padding); a padded batch derives them from its attention mask. Positions above read
`position_ids[t] + j`; attention never crosses a segment; a step whose token x_{t+1+j} or
label x_{t+2+j} lies in another sample is not scored (its weight is 0). Such a step's own
output feeds only the later steps of the same row, which are unscored as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from eagle3.attention import ATTENTION_BACKENDS, make_ttt_attention, segments_from_mask
from eagle3.chunked_loss import chunked_soft_ce
from eagle3.modeling import Eagle3Draft
from eagle3.objectives import ObjectiveConfig, chain_weights, position_loss
from eagle3.schema import ConfigError, check_ranges
from eagle3.sequence_parallel import SequenceParallel, SequenceParallelAttention, pad_segments


@dataclass
class NoiseConfig:
    kind: Literal["none", "gaussian", "uniform"] = "gaussian"  # uniform: U(-a, a) with the same std
    std: float = 0.05  # absolute, on the captured target states (the seed pipeline's value)

    def validate(self, where: str = "noise") -> None:
        check_ranges(self, where, std=">=0")


@dataclass
class TTTConfig:
    length: int = 7  # draft steps unrolled on the draft's own outputs per training position
    decay: float = 0.8  # step j's loss weighs decay**j (objective.weighting=decay)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    # TTT attention: flex (linear memory, compiled; needs CUDA to train, torch has no CPU
    # flex backward), dense (explicit T x T scores), auto (flex on CUDA, dense elsewhere).
    attention: Literal["auto", "dense", "flex"] = "auto"
    # RoPE position of step j at row t: "shifted" = t + j, where inference puts that draft
    # token; "fixed" = t at every step (SpecForge 0.2.0's SDPA path). Only relative offsets
    # reach attention, so "fixed" trains the draft on offsets that serving never shows it
    # (prefix keys j closer, its own earlier steps at offset 0): kept to compare trainers.
    positions: Literal["shifted", "fixed"] = "shifted"

    def validate(self, where: str = "ttt") -> None:
        check_ranges(self, where, length=">=1", decay="(0,1]")
        if self.positions not in ("shifted", "fixed"):
            raise ConfigError(f"{where}.positions={self.positions!r} is not 'shifted' or 'fixed'")
        if self.attention not in ATTENTION_BACKENDS:
            raise ConfigError(f"{where}.attention={self.attention!r} is not one of {list(ATTENTION_BACKENDS)}")
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


def packing_ids(
    attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids, segment_ids) of a batch; a padded batch (neither given) is one sample
    per row: positions 0..T-1, segment 0 on real tokens and -1 on padding."""
    if segment_ids is None:
        segment_ids = segments_from_mask(attention_mask)
    if position_ids is None:
        t = attention_mask.shape[1]
        position_ids = torch.arange(t, device=attention_mask.device)[None].expand(attention_mask.shape[0], t)
    return position_ids, segment_ids


def unroll(
    draft: Eagle3Draft,
    input_ids,
    aux,
    attention_mask,
    length: int,
    *,
    position_ids: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    attention: str = "auto",
    shift_positions: bool = True,
    sp: SequenceParallel | None = None,
) -> list[torch.Tensor]:
    """The TTT forward: pre-norm draft hidden states of steps 0..length-1, each [B, T, H].

    `attention` picks the TTT attention backend (see eagle3.attention.make_ttt_attention);
    `shift_positions=False` keeps every step at its row's position (TTTConfig.positions).
    `sp`: this rank's rows only, [B, T/size, H] (eagle3.sequence_parallel). The shifts of the
    tokens cross the shards, so they are taken on the whole sequence (every rank of the
    group holds the whole batch) before this rank's rows are cut out."""
    positions, segments = packing_ids(attention_mask, position_ids, segment_ids)
    positions = positions.to(input_ids.device)
    segments = segments.to(input_ids.device)
    if sp is None:
        state, local = make_ttt_attention(segments, attention), (lambda x: x)
    else:
        inner = make_ttt_attention(pad_segments(segments, sp), attention)
        state, local = SequenceParallelAttention(inner, sp, draft.cfg.num_key_value_heads), sp.local
    hidden = draft.fuse(local(aux))
    outs = []
    for j in range(length):
        ids, pos = shift_left(input_ids, 1 + j), positions + j if shift_positions else positions
        out = draft.step(local(ids), hidden, local(pos), state)
        outs.append(out)
        hidden = out
    return outs


def step_weights(
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    length: int,
    segment_ids: torch.Tensor | None = None,
    rows: str = "label",
) -> torch.Tensor:
    """[B, T, L] float: 1 where row t's step-j prediction (of x_{t+2+j}) is scored.

    rows="label" (training and our figures): that predicted token is real, under the loss
    mask, and in row t's own sample (segments are contiguous, so x_{t+1+j} then is too).
    rows="input" (SpecForge 0.2.0's scored rows, to compare accuracies with it): the row's
    token x_{t+j} is under the loss mask and the label position t+1+j is in the same sample.
    The two sets differ by two rows at each end of an answer: ours include the rows that
    predict the first two answer tokens from the prompt, SpecForge's the two after the answer."""
    m = loss_mask.bool() & attention_mask.bool()
    if segment_ids is None:
        segment_ids = segments_from_mask(attention_mask)
    trained, label = (2, 2) if rows == "label" else (0, 1)  # shifts of the masked token and of the label
    steps = []
    for j in range(length):
        same_sample = (shift_left(segment_ids, label + j, fill=-1) == segment_ids) & (segment_ids >= 0)
        steps.append(shift_left(m, trained + j) & same_sample)
    return torch.stack(steps, dim=-1).float()


@dataclass
class StepScores:
    loss: torch.Tensor  # scalar, decay-weighted sum over steps
    step_loss_t: torch.Tensor  # [L] per-step mean loss (detached, on the batch's device)
    step_acc_t: torch.Tensor  # [L] per-step accuracy
    step_alpha_t: torch.Tensor  # [L] per-step mean acceptance rate sum_v min(p, q) (eagle3.objectives)
    correct: torch.Tensor  # [B, T, L] bool: draft argmax == target argmax
    weights: torch.Tensor  # [B, T, L]
    guesses: torch.Tensor | None = None  # [B, T, L] the draft's argmax as target ids (0 where not scored)

    # Python floats on demand: one device sync when read, none inside the step.
    @property
    def step_loss(self) -> list[float]:
        return self.step_loss_t.tolist()

    @property
    def step_acc(self) -> list[float]:
        return self.step_acc_t.tolist()

    @property
    def step_alpha(self) -> list[float]:
        return self.step_alpha_t.tolist()


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """-sum_v p(v) log q(v) per position; logits [..., V], probs [..., V] -> [...]."""
    return -(target_probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


def score_steps(
    draft: Eagle3Draft,
    hiddens,
    target_probs,
    target_argmax,
    weights,
    decay: float,
    objective: ObjectiveConfig | None = None,
    real_positions: torch.Tensor | None = None,
    sp: SequenceParallel | None = None,
) -> StepScores:
    """Loss and accuracy of each unrolled step against the target, as defined above.

    The label of row t at step j is read at t+1+j; where that is another sample's (packed
    rows) or padding, `weights` is 0, so it is never scored. `objective` picks the loss per
    position and its averaging (eagle3.objectives; `real_positions`, the batch's count of
    real tokens, is the denominator of `normalise="positions"`) and how the steps are
    weighed (`decay**j`, or per position by `objective.weighting="chain"`; the reported
    per-step loss is unweighted either way). Accuracy and acceptance rate are always
    averaged over the scored positions.

    Sequence parallel (`sp`): `hiddens` and `weights` hold this rank's rows only and
    `target_probs`/`target_argmax` the window of targets they read (from its first row,
    eagle3.sequence_parallel.target_window); the denominators are the whole sequence's
    (summed over the group), so each figure is this rank's share and the group's sum is
    the figure of the whole sequence."""
    objective = objective or ObjectiveConfig()
    chain = objective.weighting == "chain"
    total = 0.0
    step_loss, step_acc, step_alpha, correct, guesses = [], [], [], [], []
    weighed, hit_chance = [], []  # chain: each step's (masked per-position loss, denominator), and c_j
    length, t = target_probs.shape[1], weights.shape[1]  # targets read; rows scored (equal unless sp)
    group_sum = sp.sum if sp is not None else (lambda x: x)
    for j, hidden in enumerate(hiddens):
        # Rows t < T-1-j only: the later ones have no label (weight 0). Slicing, not a
        # shifted copy, keeps the target's [T, Vd] distribution one shared tensor for every
        # step (autograd saves views of it, not a copy per step), and scores fewer rows.
        rows = min(t, max(length - 1 - j, 0))
        w = weights[:, :rows, j]
        probs = target_probs[:, 1 + j : 1 + j + rows]
        best = target_argmax[:, 1 + j : 1 + j + rows]
        denom = group_sum(w.sum()).clamp_min(1.0)
        w_loss = w * draft.t2d[best].to(w.dtype) if objective.skip_unreachable else w
        loss_denom = (
            real_positions.to(w.dtype)
            if objective.normalise == "positions" and real_positions is not None
            else group_sum(w_loss.sum())
        ).clamp_min(1.0)
        if objective.loss_block_rows:  # soft_ce without keeping [rows, Vd] (eagle3.chunked_loss)
            per_position, guess, alpha = chunked_soft_ce(
                draft.norm(hidden[:, :rows]), draft.lm_head.weight, probs, objective.loss_block_rows
            )
        else:
            logits = draft.logits(hidden[:, :rows])
            log_q = torch.log_softmax(logits.float(), dim=-1)
            per_position, alpha = position_loss(objective.kind, log_q, probs)
            guess = logits.argmax(-1)
            if chain:  # c_j: the draft's chance of the target's token; 0 where it cannot hit
                with torch.no_grad():
                    c = log_q.gather(-1, probs.argmax(-1, keepdim=True)).squeeze(-1).exp()
                    c = c * draft.t2d[best] * (w > 0)
                hit_chance.append(torch.nn.functional.pad(c, (0, t - rows)))
        loss_j = (per_position * w_loss).sum() / loss_denom
        if chain:
            weighed.append((per_position * w_loss, loss_denom))
        else:
            total = total + (decay**j) * loss_j
        guess = draft.draft_to_target(guess)
        hit = guess == best
        correct.append(torch.nn.functional.pad(hit, (0, t - rows), value=False))
        guesses.append(torch.nn.functional.pad(guess, (0, t - rows)))
        step_loss.append(loss_j.detach())
        step_acc.append((hit.float() * w).sum() / denom)
        step_alpha.append((alpha.detach() * w).sum() / denom)
    if chain:  # each position's step j by its share of the expected accepted length
        g = chain_weights(torch.stack(hit_chance, dim=-1))
        for j, (scored_loss, loss_denom) in enumerate(weighed):
            total = total + (scored_loss * g[:, : scored_loss.shape[1], j]).sum() / loss_denom
    return StepScores(
        loss=total,
        step_loss_t=torch.stack(step_loss),
        step_acc_t=torch.stack(step_acc),
        step_alpha_t=torch.stack(step_alpha),
        correct=torch.stack(correct, dim=-1),
        weights=weights,
        guesses=torch.stack(guesses, dim=-1),
    )
