"""Acceptance length of greedy chain speculation, estimated from teacher-forced TTT steps.

`correct[t, j]`: the draft's step-j guess at row t (of token x_{t+2+j}) equals the
target's greedy choice. With k draft tokens per target pass:

* **walk** (what decoding sees): start at the first token of each assistant turn, as the
  target's prefill produced it; at x_p the draft chain starts at row p-1; accept the m
  leading correct guesses (m <= k), gain m + 1 tokens (the target adds its own), jump to
  x_{p+m+1} and repeat. Acceptance = tokens gained / target passes. On a real SmolLM2
  draft this said 1.87 where a decoder measured 1.85.
* **per-position average**: mean of 1 + leading correct over *every* row. It counts rows
  the decoder never starts a chain at, and overestimates (2.14 on the same draft). It is
  reported for comparison, never as the prediction.

A packed row holds several samples (`segment_ids`, see eagle3.ttt): each is walked as its
own sequence, so a walk never continues into the next sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def leading_correct(correct: torch.Tensor, k: int) -> torch.Tensor:
    """[..., L] bool -> [...] number of leading True among the first k steps."""
    run = torch.cumprod(correct[..., :k].long(), dim=-1)
    return run.sum(-1)


def assistant_spans(loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs [s, e) of set entries in a 1-D mask."""
    m = loss_mask.bool().tolist()
    spans, start = [], None
    for i, v in enumerate(m + [False]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            spans.append((start, i))
            start = None
    return spans


@dataclass
class SlotCounts:
    """Per draft slot i: target passes whose chain reached slot i, and those that accepted it.
    The offline walk and the reference decoder count alike, so their rates compare."""

    reached: list[int]
    accepted: list[int]

    @classmethod
    def zeros(cls, k: int) -> "SlotCounts":
        return cls([0] * k, [0] * k)

    def record(self, m: int, remaining: int) -> None:
        """One pass that accepted `m` leading drafts with `remaining` tokens left to produce:
        slots past the end of the text are neither reached nor scored."""
        for i in range(min(m + 1, len(self.reached), remaining)):
            self.reached[i] += 1
            self.accepted[i] += int(i < m)

    def merge(self, other: "SlotCounts") -> "SlotCounts":
        return SlotCounts(
            [a + b for a, b in zip(self.reached, other.reached)], [a + b for a, b in zip(self.accepted, other.accepted)]
        )

    @property
    def rate(self) -> list[float]:
        """P(slot i accepted | slot i reached): the conditional acceptance by draft position."""
        return [a / r if r else float("nan") for a, r in zip(self.accepted, self.reached)]


@dataclass
class Acceptance:
    k: int
    tokens: int = 0  # tokens produced by the walk (bonus tokens included)
    passes: int = 0  # target passes in the walk
    position_sum: int = 0  # sum of 1 + leading correct over every scored row
    positions: int = 0
    slots: SlotCounts | None = None  # per draft slot, over the walk's passes

    def __post_init__(self):
        self.slots = self.slots or SlotCounts.zeros(self.k)

    @property
    def walk(self) -> float:
        return self.tokens / self.passes if self.passes else float("nan")

    @property
    def per_position_average(self) -> float:
        return self.position_sum / self.positions if self.positions else float("nan")

    @property
    def per_slot_rate(self) -> list[float]:
        return self.slots.rate

    def merge(self, other: "Acceptance") -> "Acceptance":
        return Acceptance(
            k=self.k,
            tokens=self.tokens + other.tokens,
            passes=self.passes + other.passes,
            position_sum=self.position_sum + other.position_sum,
            positions=self.positions + other.positions,
            slots=self.slots.merge(other.slots),
        )

    def as_dict(self) -> dict:
        return {
            "k": self.k,
            "acceptance_walk": self.walk,
            "acceptance_per_position_average": self.per_position_average,
            "walk_tokens": self.tokens,
            "walk_passes": self.passes,
            "per_slot_rate": self.per_slot_rate,
        }


def acceptance_one(correct: torch.Tensor, loss_mask: torch.Tensor, length: int, k: int) -> Acceptance:
    """One sequence: correct [T, L] bool, loss_mask [T], `length` real tokens."""
    if k > correct.shape[-1]:
        raise ValueError(f"k={k} draft tokens needs at least k TTT steps, have {correct.shape[-1]}")
    lead = leading_correct(correct, k).tolist()
    acc = Acceptance(k=k)
    mask = loss_mask[:length]
    # Per-position average: every row whose first guess (x_{t+2}) is scored. Guesses past
    # the end of the sample (x_{t+2+j}, t+2+j >= length) have no label: they are not counted,
    # so the figure does not depend on what follows the sample (padding or a packed sample).
    for t in range(max(0, length - 2)):
        if mask[t + 2]:
            acc.position_sum += 1 + min(lead[t], length - 2 - t)
            acc.positions += 1
    for s, e in assistant_spans(mask):
        p = max(s, 1)  # x_p is the target's own token; the chain starts at row p-1
        while p < e - 1:
            remaining = e - 1 - p  # tokens of this turn still to produce
            # Guesses past the end of the text have no label (their `correct` is padding): not scored.
            m = min(lead[p - 1], k, remaining)
            acc.slots.record(m, remaining)
            gain = min(m + 1, remaining)
            acc.tokens += gain
            acc.passes += 1
            p += gain
    return acc


def segment_runs(segment_ids: list[int]) -> list[tuple[int, int]]:
    """Maximal runs [s, e) of one segment id >= 0 in a row (padding, -1, is skipped)."""
    runs, start = [], 0
    for i in range(1, len(segment_ids) + 1):
        if i == len(segment_ids) or segment_ids[i] != segment_ids[start]:
            if segment_ids[start] >= 0:
                runs.append((start, i))
            start = i
    return runs


def acceptance(
    correct: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    k: int,
    segment_ids: torch.Tensor | None = None,
) -> Acceptance:
    """Batch version: correct [B, T, L], masks [B, T]; `segment_ids` [B, T] for packed rows
    (each sample walked on its own), else one sample per row of attention_mask's length."""
    total = Acceptance(k=k)
    correct, loss_mask = correct.cpu(), loss_mask.cpu()  # one transfer, then per-row walks
    if segment_ids is None:
        runs = [[(0, n)] for n in attention_mask.long().sum(-1).tolist()]
    else:
        runs = [segment_runs(row) for row in segment_ids.tolist()]
    for b, row_runs in enumerate(runs):
        for s, e in row_runs:
            total = total.merge(acceptance_one(correct[b, s:e], loss_mask[b, s:e], e - s, k))
    return total


def expected_acceptance_length(rates: list[float]) -> float:
    """Tokens per verify pass of a chain of len(rates) drafts, each accepted with its step's
    rate given that the ones before it were: 1 (the target's own token) + sum over n of
    the chance that the first n drafts are all accepted. All rates 1 gives k + 1; at
    temperature 0 the rates are accuracies, and this approximates the chain's mean run of
    leading correct drafts (exactly, where each step's accuracy is measured given the
    earlier steps were right)."""
    total, alive = 1.0, 1.0
    for a in rates:
        alive *= a
        total += alive
    return total


def ratio_interval(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """(sum y / sum x, its standard error) over runs (y, x), e.g. (tokens, verify passes) per
    prompt and seed: the ratio estimator's normal approximation (delta method), so that a
    pooled acceptance figure gets an interval over the runs it pools."""
    n = len(pairs)
    sx, sy = sum(x for _, x in pairs), sum(y for y, _ in pairs)
    ratio = sy / sx if sx else float("nan")
    if n < 2 or not sx:
        return ratio, 0.0
    residual = sum((y - ratio * x) ** 2 for y, x in pairs) / (n - 1)
    return ratio, (residual / n) ** 0.5 / (sx / n)
