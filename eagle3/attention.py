"""Attention visibility for the two ways the draft runs.

* `TTTAttention` (training-time test). The draft is unrolled `L` steps over a whole
  sequence at once. Row `t` at step `j` stands for the draft's `j`-th guess after the
  target has verified up to row `t`. What such a query may see is exactly what the
  inference KV cache holds at that moment: the step-0 keys of rows `<= t` (written from
  the target's states) and its own keys from steps `1..j` (one per earlier guess of the
  same chain). Other rows' later-step keys are other chains and stay invisible. The
  step-0 part is an ordinary causal mask; the later steps add a diagonal, kept as dot
  products so memory grows with `L * T`, not `L * T^2`.

* `KVCache` (inference). Keys are appended as they are computed; a new block of queries
  sees every cached key and causally the keys of its own block. `truncate` drops keys of
  rejected drafts.

Both return `[B, heads, T, head_dim]`; scores and softmax are computed in fp32.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch

NEG_INF = float("-inf")


class AttentionState(Protocol):
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 -> fp32 for reductions; fp32/fp64 stay as they are (tests run in fp64)."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def _softmax_fp32(scores: torch.Tensor) -> torch.Tensor:
    return torch.softmax(upcast(scores), dim=-1)


class TTTAttention:
    def __init__(self, key_valid: torch.Tensor):
        """key_valid: [B, T] bool, False on right padding."""
        self.key_valid = key_valid.bool()
        self.k0 = self.v0 = None
        self.k_steps: list[torch.Tensor] = []
        self.v_steps: list[torch.Tensor] = []

    def step0_mask(self, t: int, device) -> torch.Tensor:
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        return causal[None, None] & self.key_valid[:, None, None, :]  # [B, 1, T, T]

    def attend(self, q, k, v):
        scale = 1.0 / math.sqrt(q.shape[-1])
        t = q.shape[-2]
        mask = self.step0_mask(t, q.device)
        if self.k0 is None:
            self.k0, self.v0 = k, v
            scores = upcast(q @ k.transpose(-1, -2)) * scale
            probs = _softmax_fp32(scores.masked_fill(~mask, NEG_INF))
            return (probs.to(v.dtype) @ v)
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
