"""Architecture of a DFlash block draft: a few Qwen3-style decoder layers over the target's
states from k layers, drafting a block of tokens in one forward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from eagle3.draft_config import validate_attention_shape
from eagle3.layer_ids import validate_capture_ids
from eagle3.schema import ConfigError, check_ranges
from eagle3.target_spec import TargetSpec


def evenly_spaced_layer_ids(num_layers: int, count: int) -> list[int]:
    """`count` capture ids spread evenly from 1 to N-3 (DFlash's recipe: Qwen3-8B, 36
    layers, reads [1, 9, 17, 25, 33]); fewer where the target has too few layers for
    `count` distinct ids. N-3 keeps the ids servable by every engine (SGLang cannot read
    the last layer's output)."""
    if num_layers < 4:
        raise ConfigError(f"a block draft needs a target of at least 4 layers, got {num_layers}")
    low, high = 1, num_layers - 3
    if count == 1:
        return [low]
    ids = [int(low + k * (high - low) / (count - 1) + 0.5) for k in range(count)]
    return sorted(set(ids))


@dataclass
class DFlashConfig:
    hidden_size: int  # the target's: its embeddings feed the block and its width is shared
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int  # draft decoder layers
    vocab_size: int  # the target's vocabulary (the block's embeddings are the target's)
    draft_vocab_size: int  # rows of the draft's own lm_head (most frequent target tokens)
    target_hidden_size: int  # width of each captured target state
    target_num_layers: int
    capture_layer_ids: list[int] = field(default_factory=list)  # the target layers fused into the context
    block_size: int = 8  # the anchor plus block_size - 1 mask slots drafted in one forward
    mask_token_id: int = 0  # the id of the mask slots (its embedding is the draft's own, mask_embedding)
    # Training only (kept here, with the architecture, so a draft folder says how it was
    # trained): blocks drawn per training row, and slot k's loss weight exp(-(k-1) / gamma).
    num_anchors: int = 64
    loss_gamma: float = 4.0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    family: str = "dflash"  # read back from draft_config.json: which family's model this is

    def validate(self, where: str = "draft") -> None:
        check_ranges(
            self,
            where,
            num_layers=">=1",
            block_size=">=2",
            head_dim=">=2",
            draft_vocab_size=">=1",
            hidden_size=">=1",
            num_anchors=">=1",
            loss_gamma=">0",
        )
        validate_attention_shape(self, where)
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"{where}.draft_vocab_size={self.draft_vocab_size} exceeds the target's vocab_size={self.vocab_size}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"{where}.mask_token_id={self.mask_token_id} must lie in 0..{self.vocab_size - 1}: vLLM embeds "
                "the mask slots through the target's embedding table at that id"
            )
        validate_capture_ids(self.capture_layer_ids, self.target_num_layers, f"{where}.capture_layer_ids")
        family = type(self).__dataclass_fields__["family"].default  # "dflash", or a subclass's family
        if self.family != family:
            raise ConfigError(f"{where}.family={self.family!r}: a {type(self).__name__} is family {family!r}")

    @property
    def num_aux(self) -> int:
        return len(self.capture_layer_ids)

    @property
    def draft_tokens(self) -> int:
        """Tokens one block drafts: its mask slots."""
        return self.block_size - 1

    @classmethod
    def for_target(
        cls,
        target: TargetSpec,
        draft_vocab_size: int,
        capture_layer_ids: list[int],
        *,
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        num_anchors: int = 64,
        loss_gamma: float = 4.0,
        intermediate_size: int | None = None,
        rope_theta: float | None = None,
        **family_fields,
    ) -> "DFlashConfig":
        """The target's width, heads and rotary settings (the block's embeddings are the
        target's, so the width is shared), `num_layers` decoder layers."""
        shape = target.layer_shape()
        cfg = cls(
            **{**shape, "intermediate_size": intermediate_size or shape["intermediate_size"]},
            num_layers=num_layers,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=target.hidden_size,
            target_num_layers=target.num_layers,
            capture_layer_ids=list(capture_layer_ids),
            block_size=block_size,
            mask_token_id=mask_token_id,
            num_anchors=num_anchors,
            loss_gamma=loss_gamma,
            rope_theta=target.rope_theta if rope_theta is None else float(rope_theta),
            **family_fields,
        )
        cfg.validate()
        return cfg


@dataclass
class DFlashSettings:
    """The block draft's settings (`draft.dflash.*`, with `draft.family=dflash`)."""

    config_class = DFlashConfig  # the architecture `build` makes (a class attribute, not a setting)

    num_layers: int = 5  # draft decoder layers (DFlash's Qwen3-8B recipe: 5)
    # The anchor plus block_size - 1 mask slots: the draft tokens one forward proposes and the
    # most a served pass can verify (evaluate.num_steps <= block_size - 1). DFlash: 16;
    # ModelOpt's recipe: 8.
    block_size: int = 8
    # Target layers fused into the context (capture ids: id i = output of layer i); empty:
    # `num_target_layers` spread evenly from 1 to N-3 (DFlash's recipe: [1, 9, 17, 25, 33] of 36).
    target_layer_ids: list[int] = field(default_factory=list)
    num_target_layers: int = 5  # how many target layers are spread evenly when target_layer_ids is empty
    # Blocks drawn at random per training row (DFlash samples 512 anchors per sequence of a
    # few thousand tokens; each block is an independent question about the row's text).
    num_anchors: int = 64
    # Slot k of a block weighs exp(-(k-1) / loss_gamma) in the loss: DFlash's decay (gamma 7
    # for blocks of 16; ModelOpt uses 4 for blocks of 8).
    loss_gamma: float = 4.0
    # The id of the mask slots. It must be an id of the target's vocabulary (vLLM embeds the
    # slots there; the draft's own trained embedding replaces that row when served). null:
    # the highest id outside the draft vocabulary (a token the draft never proposes).
    mask_token_id: int | None = None
    # The draft's head: "trained" (its own lm_head over the draft vocabulary, from a random
    # start) or "target" (the target's lm_head rows for the draft vocabulary, frozen, as
    # DFlash shares the target's head; the final norm starts at the target's and trains).
    head: Literal["trained", "target"] = "trained"

    def validate(self, where: str = "dflash") -> None:
        check_ranges(
            self,
            where,
            num_layers=">=1",
            block_size=">=2",
            num_target_layers=">=1",
            num_anchors=">=1",
            loss_gamma=">0",
            mask_token_id=">=0",
        )

    @property
    def draft_tokens(self) -> int:
        """Tokens one block drafts: its mask slots."""
        return self.block_size - 1

    def layer_ids(self, target: TargetSpec, where: str = "draft.dflash.target_layer_ids") -> list[int]:
        if self.target_layer_ids:
            return validate_capture_ids(self.target_layer_ids, target.num_layers, where)
        return evenly_spaced_layer_ids(target.num_layers, self.num_target_layers)

    def mask_id(self, t2d) -> int:
        """`mask_token_id`, or for null the highest target id the draft vocabulary (t2d) lacks
        (the target's last id when the draft vocabulary is the whole of it)."""
        if self.mask_token_id is not None:
            return self.mask_token_id
        outside = (~t2d.bool()).nonzero()
        return int(outside.max()) if outside.numel() else t2d.numel() - 1

    def build(
        self,
        target: TargetSpec,
        draft_vocab_size: int,
        t2d,
        intermediate_size: int | None = None,
        rope_theta: float | None = None,
    ) -> DFlashConfig:
        return self.config_class.for_target(
            target,
            draft_vocab_size,
            self.layer_ids(target),
            num_layers=self.num_layers,
            block_size=self.block_size,
            mask_token_id=self.mask_id(t2d),
            num_anchors=self.num_anchors,
            loss_gamma=self.loss_gamma,
            intermediate_size=intermediate_size,
            rope_theta=rope_theta,
            **self.family_fields(),
        )

    def family_fields(self) -> dict:
        """A subclass family's own architecture fields, from its settings (DFlash: none)."""
        return {}
