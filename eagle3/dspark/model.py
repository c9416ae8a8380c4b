"""The DSpark draft: DFlash's block backbone (eagle3.dflash.model) with the paper's two heads.

    block  = [anchor, mask, ..., mask]  at positions a .. a+S-1      (S = block_size)
    h      = norm(backbone(block | context))                         # one parallel forward
    logits_i     = lm_head(h_i) + markov_w2(markov_w1[prev_i])       # slot i guesses x_{a+1+i}
    confidence_i = sigmoid(proj([h_i, markov_w1[prev_i]]))           # chance that guess is accepted
    prev_0 = the anchor;  prev_i = the token guessed at slot i-1 (drafting) or the text's (training)

Every slot guesses, the anchor's too: a block of S drafts S tokens (DFlash's block of S
drafts S - 1 from its mask slots). The mask slots embed through the target's own row of
`mask_token_id` (vLLM's DSpark reads no separate mask embedding), so the only trained
embedding is the Markov head's. Names follow vLLM's `Qwen3DSparkForCausalLM` checkpoint
(`markov_head.markov_w1`, `markov_head.markov_w2`, `confidence_head.proj`), so export is a
save, as for DFlash.
"""

from __future__ import annotations

import torch
from torch import nn

from eagle3.dflash.model import DFlashDraft
from eagle3.dspark.config import DSparkConfig
from eagle3.modeling import TargetWiredDraft


class MarkovHead(nn.Module):
    """A rank-r bias on the next token's logits from the previous token: the target-vocabulary
    id `prev` -> markov_w1[prev] [r] -> markov_w2 [draft vocabulary]."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        # Zero: training starts from the parallel drafter and learns the dependency on top.
        nn.init.zeros_(self.markov_w2.weight)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def bias(self, embedded: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(embedded)


class ConfidenceHead(nn.Module):
    """One logit per slot; its sigmoid estimates the chance the slot's guess is accepted."""

    def __init__(self, input_size: int):
        super().__init__()
        self.proj = nn.Linear(input_size, 1, bias=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDraft(DFlashDraft):
    family = "dspark"  # its record in eagle3.families
    first_guess_slot = 0  # the anchor's slot guesses step 0: a block of S guesses S tokens

    def __init__(self, cfg: DSparkConfig):
        super().__init__(cfg)
        del self.mask_embedding  # the mask slots embed through the target's row (see the module doc)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.draft_vocab_size, cfg.markov_rank)
        self.confidence_head = None
        if cfg.confidence_head:
            extra = cfg.markov_rank if cfg.confidence_with_markov else 0
            self.confidence_head = ConfidenceHead(cfg.hidden_size + extra)

    def load_target_embeddings(self, weight: torch.Tensor) -> None:
        TargetWiredDraft.load_target_embeddings(self, weight)

    def embed_block(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def heads(self, hidden: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pre-norm slot states hidden [..., H] and each slot's previous token prev [...]
        (target ids) -> (logits [..., Vd] with the Markov bias, confidence logits [...] or
        None without a confidence head)."""
        normed = self.norm(hidden)
        embedded = self.markov_head.embed(prev)
        logits = self.lm_head(normed) + self.markov_head.bias(embedded).to(normed.dtype)
        if self.confidence_head is None:
            return logits, None
        features = torch.cat([normed, embedded.to(normed.dtype)], -1) if self.cfg.confidence_with_markov else normed
        return logits, self.confidence_head(features.to(self.confidence_head.proj.weight.dtype))
