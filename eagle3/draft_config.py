"""Architecture of the EAGLE-3 draft: one Llama decoder layer over the target's features."""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle3.layer_ids import validate_capture_ids
from eagle3.schema import ConfigError
from eagle3.target_spec import TargetSpec


def validate_attention_shape(cfg, where: str) -> None:
    """Grouped heads that divide evenly, and an even head size for rotary embeddings: any
    family's draft attention (`cfg` has num_attention_heads, num_key_value_heads, head_dim)."""
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(
            f"{where}.num_attention_heads={cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )
    if cfg.head_dim % 2:
        raise ConfigError(f"{where}.head_dim={cfg.head_dim} must be even for rotary embeddings")


@dataclass
class DraftConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (embeddings are the target's)
    draft_vocab_size: int  # the draft's lm_head rows (most frequent target tokens)
    target_hidden_size: int  # width of each captured target state
    target_num_layers: int
    capture_layer_ids: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    # Normalisation of the captured target states before `fc`, as SGLang's
    # LlamaForCausalLMEagle3 serves it from config.json: `norm_before_fc` = one RMSNorm over
    # the concatenation (n*H_t, weight `input_norm.weight`), then `fc_norm` = one RMSNorm per
    # captured state (H_t each, `fc_norm.<i>.weight`). Captured layers differ in scale by
    # orders of magnitude (deep residual streams grow); without a norm `fc` sees mostly the
    # loudest layer until it has learnt per-layer scales.
    norm_before_fc: bool = False
    fc_norm: bool = False
    family: str = "eagle3"  # read back from draft_config.json: which family's model this is (eagle3.families)

    def validate(self, where: str = "draft") -> None:
        validate_attention_shape(self, where)
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ConfigError(
                f"{where}.draft_vocab_size={self.draft_vocab_size} must lie in 1..{self.vocab_size} "
                "(the target's vocab size)"
            )
        validate_capture_ids(self.capture_layer_ids, self.target_num_layers, f"{where}.capture_layer_ids")
        if self.family != "eagle3":
            raise ConfigError(f"{where}.family={self.family!r}: a DraftConfig is family 'eagle3'")

    @property
    def num_aux(self) -> int:
        return len(self.capture_layer_ids)

    @classmethod
    def for_target(
        cls,
        target: TargetSpec,
        draft_vocab_size: int,
        intermediate_size: int | None = None,
        norm_before_fc: bool = False,
        fc_norm: bool = False,
        rope_theta: float | None = None,
    ) -> "DraftConfig":
        """The usual EAGLE-3 draft: the target's width, heads and rotary settings (the
        RoPE base may be chosen apart: `rope_theta`, null for the target's)."""
        shape = target.layer_shape()
        cfg = cls(
            **{**shape, "intermediate_size": intermediate_size or shape["intermediate_size"]},
            draft_vocab_size=draft_vocab_size,  # validate() refuses one above the target vocab
            target_hidden_size=target.hidden_size,
            target_num_layers=target.num_layers,
            capture_layer_ids=target.capture_ids,
            rope_theta=target.rope_theta if rope_theta is None else float(rope_theta),
            norm_before_fc=norm_before_fc,
            fc_norm=fc_norm,
        )
        cfg.validate()
        return cfg
