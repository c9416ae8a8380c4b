import pytest
import torch

from eagle3.layer_ids import (
    default_capture_ids, from_sglang_layer_inputs, hf_hidden_states_index, to_sglang_layer_inputs,
    validate_capture_ids,
)
from eagle3.schema import ConfigError
from eagle3.target_features import capture_states
from tests.helpers import tiny_hf_llama


def test_default_ids_and_sglang_mapping():
    assert default_capture_ids(30) == [1, 14, 26]
    assert default_capture_ids(61) == [1, 29, 57]
    # SGLang's default inputs [2, N//2, N-3] are our default ids.
    n = 61
    assert from_sglang_layer_inputs([2, n // 2, n - 3]) == default_capture_ids(n)
    assert to_sglang_layer_inputs([-1, 2, 30]) == [0, 3, 31]


@pytest.mark.parametrize(
    "ids, message",
    [
        ([1, 14, 30], r"capture_layer_ids\[2\]=30 is out of range for a 30-layer target"),
        ([-2, 3, 5], r"capture_layer_ids\[0\]=-2 is out of range"),
        ([3, 3, 5], "repeats"),
        ([5, 3, 1], "sorted"),
        ([], "empty"),
        ([1, "x", 3], "not an integer"),
    ],
)
def test_bad_ids_are_refused_naming_the_field(ids, message):
    with pytest.raises(ConfigError, match=message):
        validate_capture_ids(ids, 30)


def test_last_layer_has_no_raw_hf_entry():
    assert hf_hidden_states_index(3, 30) == 4
    assert hf_hidden_states_index(-1, 30) == 0
    with pytest.raises(ConfigError, match="after the final norm"):
        hf_hidden_states_index(29, 30)


def test_capture_ids_match_hf_output_hidden_states():
    model = tiny_hf_llama(num_layers=6)
    ids = torch.randint(0, 97, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    layer_ids = [-1, 0, 2, 5]
    aux, final = capture_states(model, ids, mask, layer_ids)
    hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    h = 24
    chunks = aux.split(h, dim=-1)
    for layer_id, chunk in zip(layer_ids[:-1], chunks[:-1]):
        torch.testing.assert_close(chunk, hs[layer_id + 1])
    # The last layer: the hook returns the raw residual stream; HF's entry is post-norm.
    raw_last = chunks[-1]
    assert not torch.allclose(raw_last, hs[6])
    torch.testing.assert_close(model.model.norm(raw_last), hs[6])
    torch.testing.assert_close(final, hs[6])


def test_capture_refuses_unknown_layer():
    model = tiny_hf_llama(num_layers=6)
    with pytest.raises(ConfigError, match="out of range for a 6-layer target"):
        capture_states(model, torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3), [1, 2, 6])


@pytest.mark.parametrize("ids, model_type, inputs", [
    ([1, 14, 26], "llama", [2, 15, 27]),
    ([-1, 2, 30], "llama", [0, 3, 31]),
    ([1, 29, 57], "deepseek_v3", [2, 30, 58]),
    ([-1, 2, 30], "deepseek_v3", [-1, 2, 30]),  # taken as inputs: the first id is not 1
    ([-1, 2, 30], "kimi_k25", [-1, 2, 30]),
])
def test_sglang_reads_ids_by_the_targets_family(ids, model_type, inputs):
    from eagle3.layer_ids import sglang_layer_inputs

    assert sglang_layer_inputs(ids, model_type) == inputs


def test_ids_sglang_cannot_serve_are_refused_by_name():
    from eagle3.layer_ids import check_sglang_servable

    check_sglang_servable([1, 29, 57], 61, "deepseek_v3")
    check_sglang_servable([-1, 2, 30], 61, "llama")
    with pytest.raises(ConfigError, match=r"id 60 \(the output of the last layer\) cannot be served by SGLang"):
        check_sglang_servable([1, 29, 60], 61, "deepseek_v3")
    with pytest.raises(ConfigError, match=r"inputs of layers \[-1, 2, 30\], i.e. ids \[-2, 1, 29\], not the trained"):
        check_sglang_servable([-1, 2, 30], 61, "deepseek_v3", "target.capture_layer_ids")
