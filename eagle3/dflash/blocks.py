"""Training and scoring the block draft over whole sequences: anchors, visibility, loss.

Alignment (a sequence x_0..x_{T-1} with target states h_0..h_{T-1}), in the same row
indexing as EAGLE-3's training-time test (eagle3.ttt), so that every figure downstream
(per-step accuracy, the walk of eagle3.metrics) reads both families alike:

    row t      : the block anchored at a = t + 1: anchor x_a at position a, then S-1 mask slots
    context    : the rows j <= t of the same sample (the target has verified x_0..x_a)
    slot j + 1 : the draft's guess of x_{t+2+j}, scored against the target's distribution
                 at t+1+j, where x_{t+2+j} is real, scored and in row t's sample;
                 weighed decay**j (DFlash's exp(-j / gamma))

This is what decoding does: after a verify pass the target's own next token (the bonus
token) is the anchor, every verified row is context, and the mask slots are the block's
guesses, all from one forward.

Training draws up to `num_anchors` anchors per row at random (the paper's sampling: many
blocks per sequence, each a separate question), among the rows whose first guess is scored;
evaluation anchors a block at every such row, in chunks, so that the walk of
eagle3.metrics can follow decoding from any position.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from eagle3.attention import upcast
from eagle3.dflash.model import BlockVisibility
from eagle3.objectives import ObjectiveConfig, position_loss
from eagle3.ttt import StepScores, packing_ids


def slot_decay(gamma: float) -> float:
    """DFlash weighs block slot k (k = 1..S-1) by exp(-(k-1) / gamma): a per-slot factor."""
    return math.exp(-1.0 / gamma)


def choose_anchors(
    eligible: torch.Tensor, limit: int | None, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """eligible [B, T] bool -> (rows [B, N] long, valid [B, N] bool): every eligible row
    (`limit` None), or up to `limit` of them per batch row drawn without replacement from
    `generator`, in ascending order; short rows padded with row 0, not valid."""
    picks = []
    for row in eligible:
        idx = row.nonzero().flatten()
        if limit is not None and idx.numel() > limit:
            order = torch.randperm(idx.numel(), generator=generator, device=generator.device if generator else "cpu")
            idx = idx[order[:limit].to(idx.device)].sort().values
        picks.append(idx)
    n = max([p.numel() for p in picks] + [1])
    rows = torch.zeros(len(picks), n, dtype=torch.long, device=eligible.device)
    valid = torch.zeros(len(picks), n, dtype=torch.bool, device=eligible.device)
    for b, p in enumerate(picks):
        rows[b, : p.numel()], valid[b, : p.numel()] = p, True
    return rows, valid


def context_visibility(rows: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """rows [B, N] (block n anchored at rows[b, n] + 1), segments [B, T] -> [B, N, T] bool:
    the context rows j <= rows[b, n] of the same sample (the step-0 rule of the TTT
    attention, eagle3.attention.step0_visible, read at the anchor's last verified row)."""
    return BlockVisibility(rows, segments).dense


def block_inputs(draft, input_ids, positions, rows, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, N, S], positions [B, N, S]) of the blocks anchored at rows + 1: the anchor
    token then `size - 1` mask slots, at consecutive positions from the anchor's."""
    t = input_ids.shape[1]
    anchor = (rows + 1).clamp_max(t - 1)
    ids = torch.full((*rows.shape, size), draft.cfg.mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[..., 0] = input_ids.gather(1, anchor)
    pos = positions.gather(1, anchor)[..., None] + torch.arange(size, device=positions.device)
    return ids, pos


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] at rows [B, N] (clamped into range) -> [B, N, ...]."""
    rows = rows.clamp(0, x.shape[1] - 1)
    index = rows.view(*rows.shape, *([1] * (x.dim() - 2))).expand(*rows.shape, *x.shape[2:])
    return x.gather(1, index)


# (draft, hidden [B, n, L, H] of the guessing slots, prev [B, n, L] the token before each
# guess, p [B, n, L, Vd] the target's distributions, objective) -> (logits [B, n, L, Vd] fp32,
# loss per guess [B, n, L], acceptance per guess [B, n, L])
SlotScores = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def dflash_slot_scores(draft, hidden, prev, p, objective: ObjectiveConfig):
    """DFlash's guesses: the mask slots' logits, scored by the training objective."""
    logits = upcast(draft.logits(hidden))
    per_position, alpha = position_loss(objective.kind, torch.log_softmax(logits, dim=-1), p)
    return logits, per_position, alpha


def score_blocks(
    draft,
    probs: torch.Tensor,
    best: torch.Tensor,
    weights: torch.Tensor,
    batch: dict,
    aux: torch.Tensor,
    *,
    decay: float,
    objective: ObjectiveConfig | None = None,
    anchors: int | None = None,
    generator: torch.Generator | None = None,
    chunk: int | None = None,
    attention: str = "auto",
    slot_scores: "SlotScores | None" = None,
) -> StepScores:
    """Loss and accuracy of the blocks anchored at the rows `weights` scores (see above).

    probs [B, T, Vd], best [B, T]: the target's distribution over the draft vocabulary and
    its argmax per row (eagle3.target_head); weights [B, T, L] (eagle3.ttt.step_weights for
    L = S - 1 slots): which guesses are scored. `anchors`: blocks per row drawn at random
    (training), None: one at every scored row (evaluation), `chunk` blocks at a time.
    `attention`: "dense", "flex" or "auto" (flex on CUDA; eagle3.dflash.model.BlockVisibility).
    `slot_scores`: the family's loss per guess (DFlash's, `dflash_slot_scores`, by default);
    the draft's `first_guess_slot` says which slot guesses step 0."""
    objective = objective or ObjectiveConfig()
    slot_scores = slot_scores or dflash_slot_scores
    if objective.weighting != "decay" or objective.loss_block_rows:
        raise ValueError("the block draft scores its slots with the decay weighting and whole logits only")
    length = weights.shape[-1]
    positions, segments = packing_ids(batch["attention_mask"], batch.get("position_ids"), batch.get("segment_ids"))
    positions, segments = positions.to(aux.device), segments.to(aux.device)
    rows, valid = choose_anchors(weights[..., 0] > 0, anchors, generator)
    backend = ("flex" if aux.is_cuda else "dense") if attention == "auto" else attention
    slot_w = gather_rows(weights, rows) * valid[..., None]  # [B, N, L]
    reachable = slot_w
    if objective.skip_unreachable:  # leave out guesses whose target token the draft vocab lacks
        reachable = torch.stack(
            [slot_w[..., j] * draft.t2d[gather_rows(best, rows + 1 + j)] for j in range(length)], -1
        )
    denom = slot_w.sum((0, 1)).clamp_min(1.0)  # [L]
    if objective.normalise == "positions":
        loss_denom = batch["attention_mask"].sum().to(slot_w.dtype).clamp_min(1.0).expand(length)
    else:
        loss_denom = reachable.sum((0, 1)).clamp_min(1.0)
    context_kv = draft.context_kv(draft.context(aux), positions)
    step = max(1, rows.shape[1] if chunk is None else chunk)
    loss_sum = acc_sum = alpha_sum = 0.0
    hits, guesses = [], []
    for s in range(0, rows.shape[1], step):
        r, w, w_loss = rows[:, s : s + step], slot_w[:, s : s + step], reachable[:, s : s + step]
        first = draft.first_guess_slot
        ids, pos = block_inputs(draft, batch["input_ids"], positions, r, length + first)
        hidden = draft.blocks(ids, pos, context_kv, BlockVisibility(r, segments, backend))[:, :, first:]
        labels = torch.stack([gather_rows(best, r + 1 + j) for j in range(length)], dim=-1)  # [B, n, L]
        p = torch.stack([gather_rows(probs, r + 1 + j) for j in range(length)], dim=2)  # [B, n, L, Vd]
        # The token before each guess: the anchor x_{t+1}, then the text's x_{t+2}, ..
        prev = torch.stack([gather_rows(batch["input_ids"], r + 1 + j) for j in range(length)], dim=-1)
        logits, per_position, alpha = slot_scores(draft, hidden, prev, p, objective)
        guess = draft.draft_to_target(logits.argmax(-1))
        hit = guess == labels
        hits.append(hit)
        guesses.append(guess)
        loss_sum = loss_sum + (per_position * w_loss).sum((0, 1))
        acc_sum = acc_sum + (hit.float() * w).sum((0, 1)).detach()
        alpha_sum = alpha_sum + (alpha.detach() * w).sum((0, 1))
    step_loss = loss_sum / loss_denom
    decays = torch.tensor([decay**j for j in range(length)], device=step_loss.device, dtype=step_loss.dtype)
    # Back to rows: the block anchored at row t + 1 is row t's, as in the TTT unroll.
    correct = torch.zeros_like(weights, dtype=torch.bool)
    guessed = torch.zeros_like(weights, dtype=torch.long)
    scored = torch.zeros_like(weights)
    b_idx = torch.arange(rows.shape[0], device=rows.device)[:, None].expand_as(rows)
    correct[b_idx[valid], rows[valid]] = torch.cat(hits, dim=1)[valid]
    guessed[b_idx[valid], rows[valid]] = torch.cat(guesses, dim=1)[valid]
    scored[b_idx[valid], rows[valid]] = slot_w[valid]
    return StepScores(
        loss=(decays * step_loss).sum(),
        step_loss_t=step_loss.detach(),
        step_acc_t=acc_sum / denom,
        step_alpha_t=alpha_sum / denom,
        correct=correct,
        weights=scored,
        guesses=guessed,
    )
