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

SGLang 0.5.23's DSPARK (sglang/srt/models/dspark.py) reads the same config.json keys (its
own parser, `parse_dspark_draft_config`, gives the same ids, mask, rank and 7 drafts a
block) but another head: it skips any `lm_head` in the checkpoint and computes the logits
with the target's own lm_head over the whole vocabulary, and its Markov head's `markov_w2`
has a row per target token, in the target's order. So SGLang serves only a draft whose head
*is* the target's (`draft.dspark.head=target` with `draft.draft_vocab_size` = the target's
vocabulary, whose draft ids are then the target's ids in order): `sglang_tensors` leaves out
the head and the vocabulary map, and `sglang_refusal` says why any other draft cannot be
served there (SGLang's loader fails on the shape of `markov_w2`, or, worse, would
read a trained head's hidden states through the target's head).
"""

from __future__ import annotations

from typing import Callable

import torch

from eagle3.dflash import export as dflash_export
from eagle3.dspark.config import DSparkConfig
from eagle3.vocab import target_ids_of

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


# What SGLang's DSpark takes from the target, or does not read: not in its folder.
SGLANG_LEFT_OUT = ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight", "mask_embedding")


def sglang_refusal(
    cfg: DSparkConfig, state: dict[str, torch.Tensor], target_lm_head: Callable[[], torch.Tensor]
) -> str | None:
    """Why SGLang's DSpark cannot serve this draft as trained (None: it can): its logits come
    from the target's lm_head over the whole vocabulary, so the draft's head must be exactly
    that one (see the module doc). `target_lm_head` reads it, only for a draft over the whole
    vocabulary (a 1T target's head is gigabytes)."""
    how = f"train with draft.dspark.head=target draft.draft_vocab_size={cfg.vocab_size} for an SGLang export"
    if cfg.draft_vocab_size != cfg.vocab_size:
        return (
            f"SGLang's DSpark drafts over the target's whole vocabulary with the target's lm_head; this draft "
            f"has its own head over {cfg.draft_vocab_size} of {cfg.vocab_size} tokens: {how}"
        )
    if not torch.equal(target_ids_of(state["d2t"]), torch.arange(cfg.vocab_size)):
        return f"the draft's vocabulary map is not the target's ids in order (d2t is not all 0): {how}"
    if not torch.equal(state["lm_head.weight"], target_lm_head().to(state["lm_head.weight"].dtype)):
        return f"SGLang's DSpark reads the target's lm_head, and this draft trained a head of its own: {how}"
    return None


def sglang_tensors(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights as SGLang's DSpark loads them (a draft `sglang_refusal` passes, whose draft
    ids are the target's, in order): the head and the vocabulary map left out."""
    return {k: v.to(dtype).contiguous() for k, v in state.items() if k not in SGLANG_LEFT_OUT}
