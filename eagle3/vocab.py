"""The draft vocabulary: the most frequent target tokens under the loss mask.

`d2t[i]` is the offset with `target_id = i + d2t[i]` (SGLang's and SpecForge's
convention); `t2d` is a boolean mask over the target vocabulary. Draft id `i` is the
`i`-th selected target id in ascending order, so `t2d.nonzero()` lists the same ids as
`arange(n) + d2t`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # [draft_vocab] int64
    t2d: torch.Tensor  # [target_vocab] bool
    covered_fraction: float  # share of counted (loss-masked) tokens the draft vocab covers
    filled: int  # ids added without any count, because too few distinct tokens were seen

    @property
    def target_ids(self) -> torch.Tensor:
        return target_ids_of(self.d2t)


def target_ids_of(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of every draft id, `arange(n) + d2t`, on d2t's device."""
    d2t = torch.as_tensor(d2t).long()
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def count_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counts of each target token id where the loss mask is set."""
    ids = input_ids[loss_mask.bool()].long()
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids outside 0..{vocab_size - 1} (the target's vocab) in the counted data")
    return torch.bincount(ids, minlength=vocab_size)


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int, warn=print) -> DraftVocab:
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must lie in 1..{vocab_size}")
    counts = counts.long()
    c = counts.tolist()  # Python ints: per-element tensor indexing is slow at vocab 150k
    # Most frequent first; ties broken by smaller token id, so the choice is deterministic.
    order = sorted(range(vocab_size), key=lambda i: (-c[i], i))
    seen = [i for i in order if c[i] > 0][:draft_vocab_size]
    filled = draft_vocab_size - len(seen)
    chosen = set(seen)
    if filled:
        # Too few distinct tokens: pad with the smallest unused ids (deterministic) and say so.
        extra = [i for i in range(vocab_size) if i not in chosen][:filled]
        chosen.update(extra)
        warn(
            f"draft vocab: only {len(seen)} distinct tokens were seen for draft_vocab_size="
            f"{draft_vocab_size}; filled {filled} ids deterministically (lowest unused ids)"
        )
    # On the counts' device, so the mapping lands where it was counted.
    ids = torch.tensor(sorted(chosen), dtype=torch.long, device=counts.device)
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=counts.device)
    t2d[ids] = True
    d2t = ids - torch.arange(draft_vocab_size, device=counts.device)
    return DraftVocab(d2t=d2t, t2d=t2d, covered_fraction=covered_fraction(t2d, counts) or 0.0, filled=filled)


def covered_fraction(t2d: torch.Tensor, counts: torch.Tensor) -> float | None:
    """The share of the counted tokens whose id the draft vocab (`t2d`) holds; None if none
    were counted."""
    total = int(counts.sum())
    return int(counts[t2d.to(counts.device).bool()].sum()) / total if total else None


def target_to_draft(target_ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Draft ids of target ids (-1 where the draft vocab lacks the token)."""
    target_ids = target_ids.to(t2d.device)  # an index from elsewhere follows the mapping
    rank = torch.cumsum(t2d.long(), 0) - 1
    return torch.where(t2d[target_ids], rank[target_ids], torch.full_like(target_ids, -1))
