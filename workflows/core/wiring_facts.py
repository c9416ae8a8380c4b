"""The wiring doctor's record of one artefact (`Side`), the facts checked inside it, and
`check`, which compares each fact across the sides that state it (workflows.core.wiring
reads each artefact into a side)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from eagle3.layer_ids import CONVENTION, from_sglang_layer_inputs
from eagle3.schema import ConfigError
from eagle3.vocab import target_ids_of

INPUT_CONVENTION = "input_of_layer"  # SGLang's layers_to_capture
# The facts `check` compares across sides, in the order its errors name them.
FIELDS = (
    "draft_family",
    "capture_layer_ids",
    "target_num_layers",
    "target_hidden_size",
    "target_vocab_size",
    "draft_vocab_size",
    "vocab_map_sha256",
    "mask_token_id",
    "feature_norms",
    "tokenizer_sha256",
    "chat_template_sha256",
    "target_path",
)


def feature_norms(norm_before_fc, fc_norm) -> str:
    return f"norm_before_fc={bool(norm_before_fc)}, fc_norm={bool(fc_norm)}"


def check_feature_norm_weights(side: Side, names, norm_before_fc: bool, fc_norm: bool, num_aux: int) -> None:
    """The weights must match the flags both ways: SGLang leaves a missing norm weight at
    ones and silently drops a weight its config does not ask for, serving another draft."""
    names = set(names)
    want = ({"input_norm.weight"} if norm_before_fc else set()) | (
        {f"fc_norm.{i}.weight" for i in range(num_aux)} if fc_norm else set()
    )
    have = {n for n in names if n == "input_norm.weight" or n.startswith("fc_norm.")}
    if want - have:
        side.errors.append(
            f"{side.name}: {feature_norms(norm_before_fc, fc_norm)} but the weights lack {sorted(want - have)}"
        )
    if have - want:
        side.errors.append(
            f"{side.name}: weights {sorted(have - want)} are not used by "
            f"{feature_norms(norm_before_fc, fc_norm)} (SGLang would drop them silently)"
        )


@dataclass
class Side:
    name: str
    facts: dict = field(default_factory=dict)
    stated: dict = field(default_factory=dict)  # how a fact was written, when converted
    errors: list[str] = field(default_factory=list)  # problems inside this one artefact


def set_capture_ids(side: Side, ids, convention: str | None) -> None:
    if ids is None:
        return
    ids = [int(i) for i in ids]
    if convention == CONVENTION:
        side.facts["capture_layer_ids"] = ids
    elif convention == INPUT_CONVENTION:
        side.facts["capture_layer_ids"] = from_sglang_layer_inputs(ids)
        side.stated["capture_layer_ids"] = f"inputs of layers {ids}"
    else:
        side.errors.append(
            f"{side.name}: capture ids {ids} have no known layer-id convention "
            f"({convention!r}; expected {CONVENTION!r} or {INPUT_CONVENTION!r})"
        )


def vocab_map_sha256(d2t, t2d) -> str:
    import numpy as np

    h = hashlib.sha256(np.asarray(d2t, dtype=np.int64).tobytes())
    h.update(np.asarray(t2d, dtype=np.bool_).tobytes())
    return h.hexdigest()[:16]


def check_vocab_map(side: Side, d2t, t2d) -> None:
    """d2t and t2d must describe the same draft->target map (target = i + d2t[i])."""
    import torch

    d2t, t2d = torch.as_tensor(d2t).long(), torch.as_tensor(t2d).bool()
    side.facts["draft_vocab_size"] = int(d2t.numel())
    side.facts["vocab_map_sha256"] = vocab_map_sha256(d2t.numpy(), t2d.numpy())
    if not torch.equal(target_ids_of(d2t), t2d.nonzero().flatten()):
        side.errors.append(f"{side.name}: d2t and t2d disagree (arange + d2t lists other target ids than t2d marks)")


def check(sides: list[Side]) -> list[str]:
    errors = [e for s in sides for e in s.errors]
    for store in (s for s in sides if s.facts.get("stored_capture_ids") is not None):
        held = store.facts["stored_capture_ids"]
        for side in (s for s in sides if s.facts.get("capture_layer_ids") is not None):
            missing = [i for i in side.facts["capture_layer_ids"] if i not in held]
            if missing:
                errors.append(
                    f"capture_layer_ids: {side.name} says {_show(side, 'capture_layer_ids')} but {store.name} holds "
                    f"{_show(store, 'stored_capture_ids')}: {missing} are not captured"
                )
    for f in FIELDS:
        stating = [s for s in sides if s.facts.get(f) is not None]
        for other in stating[1:]:
            first = stating[0]
            if other.facts[f] != first.facts[f]:
                errors.append(f"{f}: {first.name} says {_show(first, f)} but {other.name} says {_show(other, f)}")
    return errors


def _show(side: Side, f: str) -> str:
    v = side.facts[f]
    return f"{v} ({side.stated[f]})" if f in side.stated else json.dumps(v) if not isinstance(v, str) else v


def raise_on_errors(errors: list[str]) -> None:
    if errors:
        raise ConfigError("wiring doctor found disagreements:\n  - " + "\n  - ".join(errors))
