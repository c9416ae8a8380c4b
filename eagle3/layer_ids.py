"""The one capture-layer-id convention used by every artefact of the pipeline.

Id `i` names the *output* of decoder layer `i` (0-based); id `-1` names the embedding
output. This is the serving engine's convention:

* HF transformers: id `i` is `hidden_states[i + 1]` of `output_hidden_states=True`,
  except for the last layer, whose HF entry has the final norm applied (the raw
  residual stream is not returned). We therefore capture with forward hooks on the
  layer outputs, never by indexing `hidden_states`.
* SGLang: it captures the *input* of layer `i + 1`, the same tensor. Its default
  layers `[2, N // 2, N - 3]` (inputs) are ids `[1, N // 2 - 1, N - 4]`.

The real failure this prevents: a draft trained on `[-1, 3, 31]` and served with an
engine capturing `[2, 30, 58]` scored 75% offline and ~1.6 accepted tokens served.
"""

from __future__ import annotations

from typing import Sequence

from eagle3.schema import ConfigError

EMBEDDING = -1
CONVENTION = "output_of_layer"  # written into artefacts next to the ids


def default_capture_ids(num_layers: int) -> list[int]:
    """Low, middle and high layer for an `num_layers`-layer target: [1, N//2-1, N-4]."""
    if num_layers < 5:
        raise ConfigError(f"a target needs at least 5 layers for the default capture ids, got {num_layers}")
    return [1, num_layers // 2 - 1, num_layers - 4]


def validate_capture_ids(ids: Sequence[int], num_layers: int, field: str = "capture_layer_ids") -> list[int]:
    """Refuse ids outside -1..N-1, duplicates and unsorted lists, naming the field."""
    ids = list(ids)
    if not ids:
        raise ConfigError(f"{field} is empty: an EAGLE-3 draft needs at least one captured layer")
    for k, i in enumerate(ids):
        if isinstance(i, bool) or not isinstance(i, int):
            raise ConfigError(f"{field}[{k}]={i!r} is not an integer layer id")
        if not EMBEDDING <= i <= num_layers - 1:
            raise ConfigError(
                f"{field}[{k}]={i} is out of range for a {num_layers}-layer target: ids mean "
                f"'output of decoder layer i' and must lie in -1..{num_layers - 1} (-1 = embeddings)"
            )
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{field}={ids} repeats a layer id")
    if ids != sorted(ids):
        raise ConfigError(f"{field}={ids} must be sorted ascending (low, middle, high)")
    return ids


def hf_hidden_states_index(layer_id: int, num_layers: int) -> int:
    """Index into HF `hidden_states` for id `layer_id`; refuses the post-norm last entry."""
    if layer_id == num_layers - 1:
        raise ConfigError(
            f"layer id {layer_id} (the last layer) has no raw entry in HF hidden_states: "
            "its last entry is after the final norm; capture it with a hook instead"
        )
    return layer_id + 1


def from_sglang_layer_inputs(layers: Sequence[int]) -> list[int]:
    """SGLang names captured layers by whose *input* they are: input of layer l = id l-1."""
    return [int(layer) - 1 for layer in layers]


def to_sglang_layer_inputs(ids: Sequence[int]) -> list[int]:
    return [int(i) + 1 for i in ids]


def to_vllm_aux_layer_ids(ids: Sequence[int]) -> list[int]:
    """`eagle_aux_hidden_state_layer_ids` as vLLM 0.32 reads them, for every model family:
    it records the state entering layer L under index L (0: the embeddings; N: the last
    layer's output, before the final norm; `_maybe_add_hidden_state` in llama.py, the
    layer loop of deepseek_v2.py, which Kimi-K2.5's language model is) and takes the
    config's list as it is, so id i is index i + 1. Unlike SGLang, vLLM can capture
    id N-1, and it has no family whose rule depends on the first id. The same "input of
    layer L" naming as SGLang's layers_to_capture."""
    return to_sglang_layer_inputs(ids)


# Target model types whose SGLang 0.5.23 model (deepseek_v2.py, glm4_moe_lite.py) adds 1 to
# `eagle_aux_hidden_state_layer_ids` only when the first id is 1, and otherwise takes the
# list as layer inputs. Kimi-K2/K2.5 run on the DeepSeek-V3 language model.
SGLANG_PLUS_ONE_IF_FIRST_IS_ONE = frozenset(
    {"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25", "glm4_moe_lite"}
)


def sglang_layer_inputs(ids: Sequence[int], model_type: str) -> list[int]:
    """The layers whose input SGLang captures when a draft's config names `ids`, by the
    rule of the target's model family (Llama and most others: always id + 1)."""
    ids = [int(i) for i in ids]
    if model_type in SGLANG_PLUS_ONE_IF_FIRST_IS_ONE and ids[:1] != [1]:
        return ids
    return to_sglang_layer_inputs(ids)


def check_sglang_servable(
    ids: Sequence[int], num_layers: int, model_type: str, field: str = "capture_layer_ids"
) -> None:
    """Refuse capture ids SGLang cannot serve as trained, naming the id and the reason."""
    ids = list(ids)
    if num_layers - 1 in ids:
        raise ConfigError(
            f"{field}={ids}: id {num_layers - 1} (the output of the last layer) cannot be served by SGLang: it "
            f"captures layer inputs, and a {num_layers}-layer target has no layer {num_layers} whose input it "
            "is; train on a lower layer (e.g. the default ids) for SGLang serving"
        )
    inputs = sglang_layer_inputs(ids, model_type)
    captured = from_sglang_layer_inputs(inputs)
    if captured != ids:
        raise ConfigError(
            f"{field}={ids}: SGLang serves a {model_type} target with the inputs of layers "
            f"{inputs}, i.e. ids {captured}, not the trained {ids} (for this family "
            "it adds 1 only when the first id is 1); choose ids whose first is 1, e.g. the default ids"
        )


def sglang_default_layer_inputs(num_layers: int) -> list[int]:
    """The layers (by input) SGLang captures for a Llama-family draft whose config names none
    (its models/llama.py): [2, N // 2, N - 3], i.e. ids `default_capture_ids(N)`."""
    return [2, num_layers // 2, num_layers - 3]


def sglang_capture_plan(
    ids: Sequence[int], num_layers: int, model_type: str, last_input: bool = True
) -> tuple[list[int], dict[int, int]]:
    """What to ask an SGLang 0.5.23 engine for (`return_aux_hidden_state_layer_ids`) so that
    it captures the outputs of `ids` and, with `last_input`, of layer N-2, the last layer's
    input (from which the caller computes the last layer and the final norm).

    Returns (request, slot): the request list, and for each id whose state the engine
    returns, its block in the packed aux tensor. SGLang captures in layer order, one block
    per distinct layer. Id N-1 (the last layer's output) is never captured by SGLang; it has
    no slot and comes from the tail. Refuses, naming the id, what this engine cannot return.
    """
    wanted = sorted({int(i) for i in ids if int(i) != num_layers - 1} | ({num_layers - 2} if last_input else set()))
    inputs = to_sglang_layer_inputs(wanted)  # the layers whose input holds each wanted state
    if model_type in SGLANG_PLUS_ONE_IF_FIRST_IS_ONE:
        # This family takes the list as layer inputs unless it starts with 1 (then it adds 1).
        if inputs[0] == 1:
            raise ConfigError(
                f"capture ids {list(ids)}: SGLang cannot capture id 0 first for a {model_type} "
                "target (it would read the request [1, ...] as ids and add 1); use capture.backend=hf"
            )
        request = inputs
    else:
        # Llama and most families add 1 to every requested id; SGLang refuses negative ids.
        if wanted[0] < 0:
            raise ConfigError(
                f"capture ids {list(ids)}: SGLang 0.5.23 cannot return id {EMBEDDING} (the "
                f"embeddings) for a {model_type} target; use capture.backend=hf"
            )
        request = wanted
    return request, {i: k for k, i in enumerate(wanted)}


def sglang_captured_ids(
    ids: Sequence[int], num_layers: int, slot: dict[int, int], layers_to_capture: Sequence[int]
) -> list[int]:
    """The ids whose states an SGLang engine really puts where `ids` are stored, from the
    `layers_to_capture` its model reports after set-up (inputs of layers, one packed block
    each, in layer order): block `slot[i]` holds the input of layer L, i.e. id L - 1. Id N-1
    comes from the tail: the last layer applied to the block of id N-2, so one layer above
    whatever that block really holds."""
    reported = [int(layer) - 1 for layer in sorted(set(layers_to_capture))]  # packed in layer order
    out = []
    for i in ids:
        if int(i) == num_layers - 1:
            k = slot.get(num_layers - 2)
            out.append(reported[k] + 1 if k is not None and k < len(reported) else -2)
        else:
            k = slot[int(i)]
            out.append(reported[k] if k < len(reported) else -2)  # -2: no block there at all
    return out
