"""Drafting with a DFlash block draft in the reference decoder (eagle3.spec_decode).

The drafter keeps, per draft layer, the keys and values of every verified row's context
(`DFlashDraft.context_kv` of the fused target states), as vLLM keeps them in its KV cache.
After each verify pass the decoder commits the accepted rows' target states and the
tokens that follow them; the last of those tokens, the target's own next token, anchors the
next block: [anchor, mask x K] at positions n..n+K over the n verified rows, one forward,
and the K mask slots' argmaxes are the chain proposed. Rows of rejected guesses never
enter the cache (the decoder commits accepted rows only).
"""

from __future__ import annotations

import torch

from eagle3.dflash.model import BlockVisibility
from eagle3.spec_decode import DraftTree


class DFlashDrafter:
    def __init__(self, draft):
        self.draft = draft.eval()
        self.reset()

    def reset(self) -> None:
        self.keys: list[torch.Tensor] | None = None  # per layer [1, Hkv, rows, D]
        self.values: list[torch.Tensor] | None = None
        self.rows = 0
        self.anchor: int | None = None

    @torch.no_grad()
    def commit(self, tokens: list[int], aux: torch.Tensor) -> None:
        """Verified rows aux [n, n_aux * H_t]; tokens[i] follows row i, so tokens[-1] is the
        next block's anchor."""
        n = len(tokens)
        ctx = self.draft.context(aux.reshape(1, n, -1))
        pos = torch.arange(self.rows, self.rows + n, device=ctx.device)[None]
        kv = self.draft.context_kv(ctx, pos)
        if self.keys is None:
            self.keys, self.values = [k for k, _ in kv], [v for _, v in kv]
        else:
            self.keys = [torch.cat([old, k], dim=-2) for old, (k, _) in zip(self.keys, kv)]
            self.values = [torch.cat([old, v], dim=-2) for old, (_, v) in zip(self.values, kv)]
        self.rows += n
        self.anchor = tokens[-1]

    @torch.no_grad()
    def block(self, slots: int, topk: int = 1) -> torch.Tensor:
        """Pre-norm states [slots, H] of the block [anchor, mask x (slots - 1)] at positions
        rows..rows+slots-1 over every committed row."""
        if topk != 1:
            raise ValueError(f"a block draft proposes one chain per pass (topk=1), not topk={topk}")
        d = self.draft
        device = self.keys[0].device
        ids = torch.full((1, 1, slots), d.cfg.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0, 0] = self.anchor
        pos = torch.arange(self.rows, self.rows + slots, device=device)[None, None]
        # Every committed row is context: the block's last verified row is row rows - 1.
        visible = BlockVisibility(
            torch.full((1, 1), self.rows - 1, device=device), torch.zeros(1, self.rows, dtype=torch.long, device=device)
        )
        return d.blocks(ids, pos, list(zip(self.keys, self.values)), visible)[0, 0]

    @torch.no_grad()
    def propose(self, num_steps: int, topk: int, num_draft_tokens: int) -> DraftTree:
        hidden = self.block(num_steps + 1, topk)  # the anchor's slot guesses nothing
        guesses = self.draft.draft_to_target(self.draft.logits(hidden[1:]).argmax(-1)).tolist()
        return DraftTree(tokens=guesses, parents=list(range(-1, num_steps - 1)), depths=list(range(1, num_steps + 1)))
