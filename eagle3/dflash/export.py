"""The block draft in vLLM's DFlash layout (`method: "dflash"`, `DFlashDraftModel`).

What vLLM 0.32 reads (vllm/model_executor/models/qwen3_dflash.py, config/speculative.py):
a Qwen3-style config whose `dflash_config` names `mask_token_id` (the id of the mask slots;
it must lie inside the target's vocabulary, since vLLM embeds those slots through the
target's embedding table) and `target_layer_ids`. Those ids count decoder layers from 0,
id i being the output of layer i (vLLM adds the 1 itself when it captures): the project's
own numbering, written as it is. Weights under the draft's names; without `embed_tokens`
and `lm_head` vLLM shares the target's, so the draft ships its own `lm_head` over its
draft vocabulary with `d2t` (vLLM maps the draft's ids back with it) and no embeddings.
The mask slots' trained embedding goes in `mask_embedding.pt` beside the weights, which
vLLM substitutes for the target's row of `mask_token_id`; a `mask_hidden` weight it refuses.

vLLM does not read a block size for DFlash: `num_speculative_tokens = K` runs one anchor
and K mask slots. The draft's layers attend non-causally inside the block (no
`layer_types`, so every layer is full attention, which vLLM's CPU backend serves).
"""

from __future__ import annotations

import torch

from eagle3.dflash.config import DFlashConfig

ARCHITECTURE = "DFlashDraftModel"
MASK_EMBEDDING_FILE = "mask_embedding.pt"  # vLLM's name for the mask slots' embedding
NOT_EXPORTED = ("embed_tokens.weight", "t2d", "mask_embedding")  # shared, unused, or shipped apart


def vllm_config(cfg: DFlashConfig, dtype: str, target_layer_ids: list[int] | None = None) -> dict:
    """config.json of the export. `target_layer_ids` overrides the draft's own ids (tests
    write a mis-wired export with it; nothing else should)."""
    ids = list(cfg.capture_layer_ids if target_layer_ids is None else target_layer_ids)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": dtype,
        "block_size": cfg.block_size,  # the block trained (not read by vLLM; for the doctor and readers)
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": ids},
    }


def export_tensors(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The draft's weights as vLLM loads them: floating ones in the serving dtype, `d2t` as
    is; the frozen embeddings, `t2d` and the mask embedding left out (see the module doc).
    A draft over the whole target vocabulary ships no `d2t` either: its map is the identity,
    and vLLM builds no map for it and refuses one (`no parameter named draft_id_to_target_id`)."""
    left_out = NOT_EXPORTED + (("d2t",) if state["d2t"].numel() == state["t2d"].numel() else ())
    return {
        k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items() if k not in left_out
    }


def mask_embedding_file(state: dict[str, torch.Tensor], cfg: DFlashConfig, dtype: torch.dtype) -> dict:
    """What `mask_embedding.pt` holds: the id it replaces and its embedding (vLLM checks
    the id against dflash_config.mask_token_id)."""
    return {"mask_token_id": cfg.mask_token_id, "embedding": state["mask_embedding"].to(dtype).contiguous()}
