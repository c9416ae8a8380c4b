"""Target distributions recomputed at train time from the stored final hidden state.

Target logits are never stored (at vocab 164k they are ~23x the final state): the
target's frozen lm_head (and final norm, when the store says `final` is pre-norm) turns
the final hidden state back into logits, in chunks so that the full-vocab logits of a
long batch never sit in memory at once.
"""

from __future__ import annotations

import torch
from torch import nn


class TargetHead(nn.Module):
    def __init__(self, lm_head_weight: torch.Tensor, final_norm: nn.Module | None = None):
        super().__init__()
        # [target_vocab, H_target], frozen.
        self.register_buffer("weight", lm_head_weight.detach().clone())
        self.final_norm = final_norm
        if final_norm is not None:
            final_norm.requires_grad_(False)

    @classmethod
    def from_hf(cls, model, final_is_normed: bool = True) -> "TargetHead":
        """From an HF causal LM; `final_is_normed` says whether `final` is post-norm."""
        norm = None if final_is_normed else model.model.norm
        return cls(model.get_output_embeddings().weight, norm)

    @torch.no_grad()
    def forward(self, final: torch.Tensor, draft_target_ids: torch.Tensor, chunk: int = 2048):
        """final [B, T, H] -> (probs over the draft vocab [B, T, Vd] fp32, target argmax [B, T]).

        `probs` is the target's distribution restricted to the draft vocabulary and
        renormalised there: the soft label of the draft's cross-entropy.
        """
        b, t, h = final.shape
        flat = final.reshape(-1, h)
        probs, argmax = [], []
        w = self.weight
        w_draft = w[draft_target_ids]
        for s in range(0, flat.shape[0], chunk):
            x = flat[s : s + chunk]
            if self.final_norm is not None:
                x = self.final_norm(x)
            x = x.to(w.dtype)
            argmax.append((x @ w.T).argmax(-1))
            probs.append(torch.softmax((x @ w_draft.T).float(), dim=-1))
        return torch.cat(probs).view(b, t, -1), torch.cat(argmax).view(b, t)

    @torch.no_grad()
    def token_probs(
        self, final: torch.Tensor, tokens: torch.Tensor, temperature: float, chunk: int = 2048
    ) -> torch.Tensor:
        """The target's probability of `tokens` [B, T] (target ids) under softmax(logits /
        temperature) over its whole vocabulary, from the final state at the same positions
        -> [B, T] fp32. Chunked like forward()."""
        b, t, h = final.shape
        flat, ids = final.reshape(-1, h), tokens.reshape(-1)
        out = []
        for s in range(0, flat.shape[0], chunk):
            x = flat[s : s + chunk]
            if self.final_norm is not None:
                x = self.final_norm(x)
            logp = torch.log_softmax((x.to(self.weight.dtype) @ self.weight.T).float() / temperature, dim=-1)
            out.append(logp.gather(-1, ids[s : s + chunk, None].long()).squeeze(-1).exp())
        return torch.cat(out).view(b, t)
