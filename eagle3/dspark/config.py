"""Architecture and settings of a DSpark draft: a DFlash block backbone (eagle3.dflash) whose
block is the anchor and `block_size - 1` mask slots, every slot a guess (the anchor's slot
guesses the token after it), plus two small heads:

* the Markov head, a rank-r map from the previous token to a bias on the next one's logits
  (markov_w2(markov_w1[prev])): the one dependency inside the block that a parallel forward
  cannot see, added token by token when drafting;
* the confidence head, the chance each drafted token is accepted, from the slot's hidden
  state and the Markov embedding of its previous token: what adaptive verification cuts on.

The loss weights are the paper's (0.1 cross-entropy, 0.9 L1 distance to the target's
distribution, 1.0 binary cross-entropy of the confidence head against 1 - TV)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from eagle3.dflash.config import DFlashConfig, DFlashSettings
from eagle3.schema import ConfigError, check_ranges


@dataclass
class DSparkConfig(DFlashConfig):
    block_size: int = 7  # the anchor plus block_size - 1 mask slots; every slot guesses one token
    markov_rank: int = 256  # rank of the Markov head (the paper's: 256)
    confidence_head: bool = True  # a confidence head is trained (and shipped)
    confidence_with_markov: bool = True  # it reads the Markov embedding of the previous token too
    # Training only, kept with the architecture as DFlash's anchors and gamma are: the three
    # terms' weights (eagle3.dspark.blocks).
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0
    # Drafting only: the reference decoder verifies a block's tokens while the product of
    # their confidences stays at or above this (0: the whole block, as engines serve it
    # without adaptive verification).
    verify_threshold: float = 0.0
    family: str = "dspark"

    def validate(self, where: str = "draft") -> None:
        check_ranges(
            self,
            where,
            markov_rank=">=1",
            ce_weight=">=0",
            l1_weight=">=0",
            confidence_weight=">=0",
            verify_threshold=">=0",
        )
        if self.verify_threshold > 1:
            raise ConfigError(f"{where}.verify_threshold={self.verify_threshold} is a probability: 0..1")
        if self.ce_weight + self.l1_weight == 0:
            raise ConfigError(f"{where}.ce_weight and {where}.l1_weight are both 0: nothing trains the drafts")
        super().validate(where)

    @property
    def draft_tokens(self) -> int:
        """Tokens one block drafts: every slot, the anchor's included."""
        return self.block_size


@dataclass
class DSparkSettings(DFlashSettings):
    """The DSpark draft's settings (`draft.dspark.*`, with `draft.family=dspark`): DFlash's,
    plus its heads and loss weights. Defaults: the paper's Qwen3 recipe (blocks of 7, 5
    layers, rank 256, the confidence head reading the Markov embedding)."""

    # The anchor plus block_size - 1 mask slots, each slot a guess: the draft tokens one
    # forward proposes and the most a served pass verifies (evaluate.num_steps <= block_size).
    block_size: int = 7
    # The id of the mask slots, embedded as the target's own row of it, frozen (vLLM's DSpark
    # reads no separate mask embedding). null: the highest id outside the draft vocabulary.
    mask_token_id: int | None = None
    markov_rank: int = 256  # rank of the Markov head's previous-token embedding
    markov_head_type: Literal["vanilla"] = "vanilla"  # vLLM serves the vanilla head only
    confidence_head: bool = True  # train (and ship) the confidence head
    confidence_with_markov: bool = True  # the confidence head also reads the Markov embedding
    ce_weight: float = 0.1  # weight of the cross-entropy term (the train.objective's kind)
    l1_weight: float = 0.9  # weight of sum |p_draft - p_target| (twice the total variation)
    confidence_weight: float = 1.0  # weight of the confidence head's BCE against 1 - TV
    # The reference decoder's adaptive cut: verify a block's drafts while the product of their
    # confidences stays >= this (0: all of them, as served without adaptive verification).
    verify_threshold: float = 0.0
    config_class = DSparkConfig  # the architecture `build` makes

    @property
    def draft_tokens(self) -> int:
        """Tokens one block drafts: every slot, the anchor's included."""
        return self.block_size

    def validate(self, where: str = "dspark") -> None:
        super().validate(where)
        check_ranges(self, where, markov_rank=">=1", ce_weight=">=0", l1_weight=">=0", confidence_weight=">=0")
        if self.markov_head_type != "vanilla":
            raise ConfigError(f"{where}.markov_head_type={self.markov_head_type!r}: only 'vanilla' is served (vLLM)")
        if not 0 <= self.verify_threshold <= 1:
            raise ConfigError(f"{where}.verify_threshold={self.verify_threshold} is a probability: 0..1")

    def family_fields(self) -> dict:
        return {
            "markov_rank": self.markov_rank,
            "confidence_head": self.confidence_head,
            "confidence_with_markov": self.confidence_with_markov and self.confidence_head,
            "ce_weight": self.ce_weight,
            "l1_weight": self.l1_weight,
            "confidence_weight": self.confidence_weight,
            "verify_threshold": self.verify_threshold,
        }
