"""The DSpark draft in vLLM's layout (`method: "dspark"`, `Qwen3DSparkModel`).

What vLLM 0.32 reads (vllm/model_executor/models/qwen3_dspark.py on the DFlash Qwen3
backbone, qwen3_dflash.py; the speculator vllm/v1/worker/gpu/spec_decode/dspark/): DFlash's
config (eagle3.dflash.export: `dflash_config.mask_token_id` and `target_layer_ids`, ours as
they are), plus `markov_rank`, `markov_head_type` ("vanilla"), `enable_confidence_head` and
`confidence_head_with_markov`, and a top-level `sample_from_anchor: true`: every one of the
block's `num_speculative_tokens` slots is a guess, the anchor's slot guessing the token after
it (the paper's layout; false would be DFlash's anchor-plus-K fill-in block). Not inside
`dflash_config`: vLLM's DFlash speculator, which DSpark's extends, refuses it there. The weights go under the
draft's own names (`markov_head.markov_w1` over the target vocabulary, `markov_head.markov_w2`
and `lm_head` over the draft vocabulary with `d2t`, `confidence_head.proj`). vLLM's DSpark
reads no mask-embedding file: the mask slots embed through the target's row of the mask id,
as the draft trains them. Without `embed_tokens` vLLM shares the target's.
"""

from __future__ import annotations

from eagle3.dflash import export as dflash_export
from eagle3.dspark.config import DSparkConfig

ARCHITECTURE = "Qwen3DSparkModel"
export_tensors = dflash_export.export_tensors  # the same tensors policy: frozen embeddings and t2d left out


def vllm_config(cfg: DSparkConfig, dtype: str, target_layer_ids: list[int] | None = None) -> dict:
    """config.json of the export (`target_layer_ids` overrides the draft's own: tests only)."""
    out = dflash_export.vllm_config(cfg, dtype, target_layer_ids)
    out["architectures"] = [ARCHITECTURE]
    out.update(
        {
            "sample_from_anchor": True,
            "markov_rank": cfg.markov_rank,
            "markov_head_type": "vanilla",
            "enable_confidence_head": cfg.confidence_head,
            "confidence_head_with_markov": cfg.confidence_with_markov,
        }
    )
    return out
