"""Draft families: one record per family names its parts, so that the loop, the
evaluation, the reference decoder and the served check read every family alike.

    family    config (draft_config.json)   model          training pass            drafting
    eagle3    eagle3.draft_config          eagle3.modeling TTT unroll (eagle3.ttt)  chains and trees
    dflash    eagle3.dflash.config         eagle3.dflash   blocks (eagle3.dflash)   one block a pass
    dspark    eagle3.dspark.config         eagle3.dspark   blocks + DSpark's loss   one block, token by token heads

Every family scores the same rows: row t's step j is the draft's guess of x_{t+2+j} when
the target has verified up to x_{t+1} (eagle3.ttt, eagle3.dflash.blocks). The per-step
figures, the offline walk (eagle3.metrics) and the held-out breakdowns are therefore one
code for all. A new family is a folder of its own (config, model, training pass, drafter)
plus one `register` call here, and its export in workflows/export.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from eagle3.dflash.blocks import score_blocks, slot_decay
from eagle3.dflash.config import DFlashConfig
from eagle3.dflash.drafter import DFlashDrafter
from eagle3.dflash.model import DFlashDraft
from eagle3.draft_config import DraftConfig
from eagle3.dspark.blocks import dspark_slot_scores
from eagle3.dspark.config import DSparkConfig
from eagle3.dspark.drafter import DSparkDrafter
from eagle3.dspark.model import DSparkDraft
from eagle3.modeling import Eagle3Draft
from eagle3.objectives import ObjectiveConfig
from eagle3.schema import ConfigError, from_dict
from eagle3.spec_decode import Eagle3Drafter
from eagle3.ttt import StepScores, TTTConfig, score_steps, unroll

# Blocks scored at a time in evaluation (every row anchors one): bounds the [blocks, slots,
# context] scores of a long held-out sample.
EVAL_BLOCKS = 64

# score(draft, probs, best, weights, batch, aux, ttt, objective, train, generator) -> StepScores
Score = Callable[..., StepScores]


@dataclass(frozen=True)
class DraftFamily:
    name: str
    config_class: type  # the architecture, saved as draft_config.json
    model_class: type  # built from it; its `family` attribute names the record
    # The training pass over a batch: loss and per-step figures of `weights.shape[-1]` steps.
    score: Score
    # Draft tokens one pass of the trained draft scores (TTT steps, or block slots).
    trained_steps: Callable[[Any, TTTConfig], int]
    drafter: Callable[[torch.nn.Module, bool], Any]  # (draft, SGLang's tree attention) -> eagle3.spec_decode.Drafter
    # Engine -> its speculative method for this family; an engine missing here cannot serve it.
    served_methods: dict[str, str] = field(default_factory=dict)
    trees: bool = False  # drafts trees (topk > 1) as well as chains
    # The engine whose export holds the draft's own tensors under its own names: the weights
    # the evaluate stage scores, as served.
    weights_export: str = "sglang"
    # `score` takes `sp` (eagle3.sequence_parallel): one sample's rows split over ranks.
    sequence_parallel: bool = False


FAMILIES: dict[str, DraftFamily] = {}


def register(family: DraftFamily) -> DraftFamily:
    FAMILIES[family.name] = family
    return family


def family_named(name: str, where: str = "draft.family") -> DraftFamily:
    if name not in FAMILIES:
        raise ConfigError(f"{where}={name!r} is not a draft family; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_of(draft: torch.nn.Module) -> DraftFamily:
    return family_named(getattr(draft, "family", "eagle3"), f"{type(draft).__name__}.family")


def config_from_dict(data: dict, where: str = "draft_config") -> Any:
    """A draft_config.json's dataclass, by its `family` (none: EAGLE-3, which predates families)."""
    family = family_named(data.get("family", "eagle3"), f"{where}.family")
    return from_dict(family.config_class, data, where)


def build_model(cfg: Any) -> torch.nn.Module:
    return family_named(cfg.family, "draft_config.family").model_class(cfg)


# ---------------------------------------------------------------------------- EAGLE-3
def _score_eagle3(
    draft, probs, best, weights, batch, aux, ttt: TTTConfig, objective: ObjectiveConfig, train, generator, sp=None
):
    # sp (eagle3.sequence_parallel): this rank's rows of the unroll, scored against the
    # window of targets they read (`probs`, `best`) with their `weights`; the whole batch in.
    hiddens = unroll(
        draft,
        batch["input_ids"],
        aux,
        batch["attention_mask"],
        weights.shape[-1],
        position_ids=batch.get("position_ids"),
        segment_ids=batch.get("segment_ids"),
        attention=ttt.attention,
        shift_positions=ttt.positions == "shifted",
        sp=sp,
    )
    return score_steps(
        draft, hiddens, probs, best, weights, ttt.decay, objective, real_positions=batch["attention_mask"].sum(), sp=sp
    )


EAGLE3 = register(
    DraftFamily(
        name="eagle3",
        config_class=DraftConfig,
        model_class=Eagle3Draft,
        score=_score_eagle3,
        trained_steps=lambda cfg, ttt: ttt.length,
        drafter=lambda draft, sglang_compatible: Eagle3Drafter(draft, sglang_compatible),
        served_methods={"sglang": "EAGLE3", "vllm": "eagle3"},
        trees=True,
        sequence_parallel=True,
    )
)


# ---------------------------------------------------------------------------- DFlash
def _score_dflash(draft, probs, best, weights, batch, aux, ttt, objective, train, generator, slot_scores=None):
    return score_blocks(
        draft,
        probs,
        best,
        weights,
        batch,
        aux,
        decay=slot_decay(draft.cfg.loss_gamma),
        objective=objective,
        anchors=draft.cfg.num_anchors if train else None,
        generator=generator,
        chunk=None if train else EVAL_BLOCKS,
        attention=ttt.attention,
        slot_scores=slot_scores,
    )


DFLASH = register(
    DraftFamily(
        name="dflash",
        config_class=DFlashConfig,
        model_class=DFlashDraft,
        score=_score_dflash,
        trained_steps=lambda cfg, ttt: cfg.block_size - 1,
        drafter=lambda draft, sglang_compatible: DFlashDrafter(draft),
        served_methods={"vllm": "dflash"},
        weights_export="vllm",
    )
)


# ---------------------------------------------------------------------------- DSpark
def _score_dspark(draft, probs, best, weights, batch, aux, ttt, objective, train, generator):
    return _score_dflash(
        draft, probs, best, weights, batch, aux, ttt, objective, train, generator, slot_scores=dspark_slot_scores
    )


DSPARK = register(
    DraftFamily(
        name="dspark",
        config_class=DSparkConfig,
        model_class=DSparkDraft,
        score=_score_dspark,
        trained_steps=lambda cfg, ttt: cfg.block_size,
        drafter=lambda draft, sglang_compatible: DSparkDrafter(draft),
        served_methods={"vllm": "dspark"},
        weights_export="vllm",
    )
)
