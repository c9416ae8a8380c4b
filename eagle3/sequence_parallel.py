"""Sequence parallelism (Ulysses) for the TTT unroll: one sample split over `size` ranks.

Each rank of a sequence-parallel group holds the rows `[start, start + rows)` of the
sequence, padded to `size * rows` (a length that does not divide evenly gets padding rows,
segment -1: never scored, never visible as keys). Everything in the EAGLE-3 draft is
token-local (fc fusion, norms, MLP, head, loss) except the attention, so only the attention
sees the other ranks: an all-to-all turns the sequence-sharded q/k/v [B, H, T/size, D] into
head-sharded [B, H/size, T, D], the unchanged TTT attention state (dense or flex, with the
global segment ids and its per-step key cache) attends over the whole sequence for its
heads, and a second all-to-all turns the output back. The backward of each all-to-all is
the reverse one, so gradients flow to the ranks that own the rows.

Ulysses rather than ring attention: after the exchange every rank sees the whole sequence,
so the TTT attention's shifted structure (step-0 keys under the segment mask, each row's
own later-step keys) needs no re-derivation per block of keys, and the two all-to-alls
move 4 [T/size, H] tensors per step whatever the length. Its limit: the query heads must
divide by `size` (k/v are repeated to the query heads first where their count does not).

Comms only here, no orchestration: the caller passes the process group (one per group of
`size` ranks holding the same batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from eagle3.schema import ConfigError


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in its sequence-parallel group (`group`: a torch.distributed group)."""

    group: Any
    rank: int  # within the group
    size: int

    def rows(self, t: int) -> int:
        """Rows per rank for a sequence of `t`: ceil(t / size)."""
        return -(-t // self.size)

    def start(self, t: int) -> int:
        return self.rank * self.rows(t)

    def pad(self, x: torch.Tensor, t: int, fill=0) -> torch.Tensor:
        """x [B, t, ...] right-padded along dim 1 to size * rows(t) with `fill`."""
        extra = self.size * self.rows(t) - t
        if extra == 0:
            return x
        pad = torch.full((x.shape[0], extra, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
        return torch.cat([x, pad], dim=1)

    def local(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """This rank's rows of x [B, T, ...] (padded with `fill`), a tensor of its own: a view
        would keep the whole sequence's storage alive wherever autograd saves it."""
        t = x.shape[1]
        start, rows = self.start(t), self.rows(t)
        return self.pad(x, t, fill)[:, start : start + rows].clone()

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group (no gradient: denominators and figures)."""
        import torch.distributed as dist

        x = x.detach().clone()
        dist.all_reduce(x, group=self.group)
        return x


def check_heads(num_attention_heads: int, size: int, where: str = "train.sequence_parallel") -> None:
    """Ulysses shards the query heads over the group: they must divide evenly."""
    if num_attention_heads % size:
        raise ConfigError(
            f"{where}={size} does not divide the draft's num_attention_heads={num_attention_heads}: "
            "Ulysses gives each rank num_attention_heads / sequence_parallel whole heads; pick a divisor"
        )


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single along dim 0 (chunk i goes to rank i, chunk i received from rank i)."""
    import torch.distributed as dist

    x = x.contiguous()
    out = torch.empty_like(x)  # of x made contiguous: empty_like keeps a view's strides
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[B, H, T/n, D] (this rank's rows, all heads) -> [B, H/n, T, D] (all rows, its heads)."""
    b, h, rows, d = x.shape
    n = sp.size
    chunks = x.reshape(b, n, h // n, rows, d).transpose(0, 1)  # [n (head group), B, H/n, rows, D]
    got = _all_to_all(chunks, sp.group)  # [n (row shard), B, H/n, rows, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * rows, d)


def _heads_to_seq(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[B, H/n, T, D] -> [B, H, T/n, D]: the inverse of `_seq_to_heads`."""
    b, hn, t, d = x.shape
    n = sp.size
    chunks = x.reshape(b, hn, n, t // n, d).permute(2, 0, 1, 3, 4)  # [n (row shard), B, H/n, rows, D]
    got = _all_to_all(chunks, sp.group)  # [n (head group), B, H/n, rows, D]
    return got.transpose(0, 1).reshape(b, n * hn, t // n, d)


class _Exchange(torch.autograd.Function):
    """The all-to-all of one direction (`to_heads`) whose backward is the other one."""

    @staticmethod
    def forward(ctx, x, sp, to_heads: bool):
        ctx.sp, ctx.to_heads = sp, to_heads
        return _seq_to_heads(x, sp) if to_heads else _heads_to_seq(x, sp)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq(grad, ctx.sp) if ctx.to_heads else _seq_to_heads(grad, ctx.sp)), None, None


def seq_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    return _Exchange.apply(x, sp, True)


def heads_to_seq(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    return _Exchange.apply(x, sp, False)


class SequenceParallelAttention:
    """An AttentionState over sequence-sharded q/k/v: all-to-all to head shards, the
    whole-sequence `inner` state (built on the padded sequence's segment ids) on this
    rank's heads, all-to-all back."""

    def __init__(self, inner, sp: SequenceParallel, num_key_value_heads: int):
        self.inner, self.sp = inner, sp
        # Grouped k/v heads travel as they are only when they, too, divide over the group
        # (query head group i then reads exactly kv head group i); else modeling repeats them.
        self.native_gqa = getattr(inner, "native_gqa", False) and num_key_value_heads % sp.size == 0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (seq_to_heads(x, self.sp) for x in (q, k, v))
        return heads_to_seq(self.inner.attend(q, k, v), self.sp)


def pad_segments(segment_ids: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """Whole-sequence segment ids padded to the group's length: padding is segment -1."""
    return sp.pad(segment_ids.long(), segment_ids.shape[1], fill=-1)


def target_window(final: torch.Tensor, sp: SequenceParallel, steps: int) -> torch.Tensor:
    """The target states this rank's rows are scored against: row t's step j reads the
    target at t+1+j, so rows [start, start + rows + steps) of the sequence (fewer at its end)."""
    t = final.shape[1]
    start = sp.start(t)
    return final[:, start : min(start + sp.rows(t) + steps, t)]
