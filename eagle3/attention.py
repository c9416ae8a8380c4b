"""Attention visibility for the two ways the draft runs.

* TTT (training-time test). The draft is unrolled `L` steps over a whole sequence at
  once. Row `t` at step `j` stands for the draft's `j`-th guess after the target has
  verified up to row `t`. What such a query may see is exactly what the inference KV
  cache holds at that moment: the step-0 keys of rows `<= t` of its own sample (written
  from the target's states) and its own keys from steps `1..j` (one per earlier guess of
  the same chain). Other rows' later-step keys are other chains and stay invisible.

  Rows may hold several packed samples: `segment_ids [B, T]` numbers them 0, 1, .. within
  a row (contiguous, -1 on the right padding), and a step-0 key is visible only inside
  its own segment. A padded query row (segment -1) sees every valid earlier key, as it
  did before packing existed: its output is never scored, only kept finite.

  Two interchangeable implementations (`make_ttt_attention` picks one):
  - `DenseTTTAttention`: scores of every (row, key) pair, [B, heads, T, T] per step. The
    plain CPU path and the reference the other is tested against.
  - `FlexTTTAttention`: `flex_attention` over the keys of all steps laid side by side,
    [step-0 keys | step-1 keys | ...], with a block-sparse mask built from the segments
    (never an element-wise T x T mask). Compiled on CUDA, it never materialises T x T
    scores, so memory grows with `L * T`.

* `KVCache` (inference). Keys are appended as they are computed; a new block of queries
  sees every cached key and causally the keys of its own block. `truncate` drops keys of
  rejected drafts.

All return `[B, heads, T, head_dim]`; scores and softmax are computed in fp32 (or fp64).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


class AttentionState(Protocol):
    """q [B, Hq, T, D]; k, v [B, Hkv, T, D]. Hkv is Hq (k/v repeated by the caller) unless the
    state sets `native_gqa = True`, in which case it receives the grouped heads as they are."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 -> fp32 for reductions; fp32/fp64 stay as they are (tests run in fp64)."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def _softmax_fp32(scores: torch.Tensor) -> torch.Tensor:
    return torch.softmax(upcast(scores), dim=-1)


def segments_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """A padded batch as segments: 0 on real tokens, -1 on padding (one sample per row)."""
    return attention_mask.bool().long() - 1


def step0_visible(seg_q: torch.Tensor, seg_k: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
    """The step-0 rule on broadcastable operands: causal, key valid, same segment (a padded
    query, segment -1, sees every valid earlier key). Shared by both backends."""
    return (k_idx <= q_idx) & (seg_k >= 0) & ((seg_q == seg_k) | (seg_q < 0))


class DenseTTTAttention:
    """TTT attention with explicit [B, heads, T, T + j] scores: plain and exact (the reference)."""

    native_gqa = False  # wants k/v repeated to the query heads (modeling does it)

    def __init__(self, key_valid: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None):
        """key_valid: [B, T] bool, False on right padding; or segment_ids [B, T] (see above)."""
        if segment_ids is None:
            if key_valid is None:
                raise ValueError("DenseTTTAttention needs key_valid or segment_ids")
            segment_ids = segments_from_mask(key_valid)
        seg = segment_ids.long()
        idx = torch.arange(seg.shape[1], device=seg.device)
        # [B, 1, T, T], built once for all steps.
        self.mask0 = step0_visible(seg[:, :, None], seg[:, None, :], idx[:, None], idx[None, :])[:, None]
        self.k0 = self.v0 = None
        self.k_steps: list[torch.Tensor] = []
        self.v_steps: list[torch.Tensor] = []

    def attend(self, q, k, v):
        scale = 1.0 / math.sqrt(q.shape[-1])
        t = q.shape[-2]
        mask = self.mask0
        if self.k0 is None:
            self.k0, self.v0 = k, v
            scores = upcast(q @ k.transpose(-1, -2)) * scale
            probs = _softmax_fp32(scores.masked_fill(~mask, NEG_INF))
            return probs.to(v.dtype) @ v
        self.k_steps.append(k)
        self.v_steps.append(v)
        scores0 = (upcast(q @ self.k0.transpose(-1, -2)) * scale).masked_fill(~mask, NEG_INF)
        # Row t's own keys from steps 1..j: one dot product per step, [B, H, T, j].
        diag = torch.stack([upcast((q * ks).sum(-1)) * scale for ks in self.k_steps], dim=-1)
        probs = _softmax_fp32(torch.cat([scores0, diag], dim=-1))
        p0, pd = probs[..., :t].to(v.dtype), probs[..., t:].to(v.dtype)
        out = p0 @ self.v0
        for i, vs in enumerate(self.v_steps):
            out = out + pd[..., i : i + 1] * vs
        return out


# The former name of the dense implementation (tests and callers use it as the reference).
TTTAttention = DenseTTTAttention

FLEX_BLOCK = 128  # flex_attention's default sparse block size; the kernels tile within it
_compiled_flex = None  # torch.compile(flex_attention), created on first CUDA use


def _flex_kernel(device: torch.device):
    """Compiled flex on CUDA (the fused kernel: no T x T in memory); eager elsewhere, which
    computes the same maths densely and is what the CPU tests check."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, nq, nkv] bool block table -> (count [B, 1, nq], column indices [B, 1, nq, nkv]) int32,
    the set columns first in ascending order: BlockMask's per-row block lists."""
    count = blocks.sum(-1, dtype=torch.int32)
    cols = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count[:, None].contiguous(), cols[:, None].contiguous()


class FlexTTTAttention:
    """TTT attention with `flex_attention` over [step-0 keys | step-1 keys | ... | step-j keys].

    The sequence is right-padded to a multiple of the block size `bs` (padding is segment
    -1), so that key `i * Tp + s` is row `s`'s step-i key and every block of keys belongs
    to one step. Element rule (`mask_mod`): a step-0 key follows `step0_visible`; a later
    key is visible only to its own row. Block table, from per-block segment ranges:
    step-0 blocks above the diagonal or sharing no segment are skipped, blocks wholly
    inside one segment below the diagonal are "full" (no mask_mod evaluated), the rest
    partial; each later step adds exactly its diagonal block.
    """

    native_gqa = True  # flex reads grouped k/v heads itself (enable_gqa); no repeat

    def __init__(self, segment_ids: torch.Tensor, block_size: int = FLEX_BLOCK):
        b, t = segment_ids.shape
        self.t, self.bs = t, block_size
        self.tp = -(-t // block_size) * block_size
        nb = self.tp // block_size
        seg = F.pad(segment_ids.long(), (0, self.tp - t), value=-1)
        self.seg = seg
        # Per block of rows: segment range over its valid rows, and whether it has any/only valid rows.
        blocks = seg.view(b, nb, block_size)
        valid = blocks >= 0
        big = torch.iinfo(torch.long).max
        smin = torch.where(valid, blocks, torch.full_like(blocks, big)).amin(-1)  # big: no valid row
        smax = torch.where(valid, blocks, torch.full_like(blocks, -1)).amax(-1)  # -1: no valid row
        any_valid, all_valid = valid.any(-1), valid.all(-1)
        qa = torch.arange(nb, device=seg.device)
        below = (qa[None, :] <= qa[:, None])[None]  # [1, q block, kv block] causal
        strictly = (qa[None, :] < qa[:, None])[None]
        overlap = (smin[:, :, None] <= smax[:, None, :]) & (smin[:, None, :] <= smax[:, :, None])
        # Visible somewhere: causal, the key block holds a valid key, and a query shares its
        # segment or is padding (padding queries see every valid earlier key).
        some = below & any_valid[:, None, :] & (overlap | ~all_valid[:, :, None])
        one_segment = all_valid & (smin == smax)
        full = strictly & (
            (one_segment[:, :, None] & one_segment[:, None, :] & (smin[:, :, None] == smin[:, None, :]))
            | (~any_valid[:, :, None] & all_valid[:, None, :])  # all-padding queries, all-valid keys
        )
        self.partial0, self.full0 = some & ~full, full
        self.diag = torch.eye(nb, dtype=torch.bool, device=seg.device)[None].expand(b, nb, nb)
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp == self.t else F.pad(x, (0, 0, 0, self.tp - self.t))

    def mask_mod(self):
        seg = self.seg

        def visible(b, h, q_idx, kv_idx):
            # The padded length read off the tensor, not captured as a Python int: under
            # torch.compile a captured int is a guarded constant (one recompile per length).
            tp = seg.shape[-1]
            k_row = kv_idx % tp  # the row whose key this is (kv_idx // tp is its step)
            step0 = step0_visible(seg[b, q_idx], seg[b, k_row], q_idx, k_row)
            return torch.where(kv_idx < tp, step0, k_row == q_idx)

        return visible

    def block_mask(self, steps: int):
        """The BlockMask over the keys of `steps` steps (step 0 included)."""
        from torch.nn.attention.flex_attention import BlockMask

        zeros = torch.zeros_like(self.diag)
        partial = torch.cat([self.partial0] + [self.diag] * (steps - 1), dim=-1)
        full = torch.cat([self.full0] + [zeros] * (steps - 1), dim=-1)
        count, cols = _ordered(partial)
        full_count, full_cols = _ordered(full)
        return BlockMask.from_kv_blocks(
            count,
            cols,
            full_count,
            full_cols,
            BLOCK_SIZE=self.bs,
            mask_mod=self.mask_mod(),
            seq_lengths=(self.tp, steps * self.tp),
        )

    def attend(self, q, k, v):
        """q [B, Hq, T, D]; k, v [B, Hkv, T, D] with Hkv dividing Hq (grouped as repeat_interleave)."""
        self.ks.append(self._pad(k))
        self.vs.append(self._pad(v))
        keys = torch.cat(self.ks, dim=-2) if len(self.ks) > 1 else self.ks[0]
        values = torch.cat(self.vs, dim=-2) if len(self.vs) > 1 else self.vs[0]
        kernel = _flex_kernel(q.device)
        out = kernel(
            self._pad(q), keys, values, block_mask=self.block_mask(len(self.ks)), enable_gqa=q.shape[1] != k.shape[1]
        )
        return out[..., : self.t, :]


ATTENTION_BACKENDS = ("auto", "dense", "flex")


def make_ttt_attention(segment_ids: torch.Tensor, backend: str = "auto"):
    """The TTT attention state for one unroll. auto: flex on CUDA (linear memory), dense elsewhere."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"TTT attention backend {backend!r} is not one of {list(ATTENTION_BACKENDS)}")
    if backend == "auto":
        backend = "flex" if segment_ids.device.type == "cuda" else "dense"
    if backend == "flex":
        return FlexTTTAttention(segment_ids)
    return DenseTTTAttention(segment_ids=segment_ids)


class KVCache:
    """A plain per-batch KV cache (all rows of a batch share the cached length)."""

    def __init__(self):
        self.k = self.v = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def attend(self, q, k, v, mask: torch.Tensor | None = None):
        """Append k/v, then attend. `mask` ([Tq, Tq] bool) replaces the causal mask inside
        the new block (tree drafting passes its tree mask here)."""
        past = len(self)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=-2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=-2)
        tq = q.shape[-2]
        block = mask if mask is not None else torch.ones(tq, tq, dtype=torch.bool, device=q.device).tril()
        full = torch.cat([torch.ones(tq, past, dtype=torch.bool, device=q.device), block.to(q.device)], dim=-1)
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = (upcast(q @ self.k.transpose(-1, -2)) * scale).masked_fill(~full, NEG_INF)
        return _softmax_fp32(scores).to(self.v.dtype) @ self.v

    def truncate(self, length: int) -> None:
        if self.k is not None:
            self.k = self.k[..., :length, :]
            self.v = self.v[..., :length, :]
