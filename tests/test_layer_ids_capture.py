import pytest
import torch

from eagle3.layer_ids import (
    default_capture_ids,
    from_sglang_layer_inputs,
    hf_hidden_states_index,
    to_sglang_layer_inputs,
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


@pytest.mark.parametrize(
    "ids, model_type, inputs",
    [
        ([1, 14, 26], "llama", [2, 15, 27]),
        ([-1, 2, 30], "llama", [0, 3, 31]),
        ([1, 29, 57], "deepseek_v3", [2, 30, 58]),
        ([-1, 2, 30], "deepseek_v3", [-1, 2, 30]),  # taken as inputs: the first id is not 1
        ([-1, 2, 30], "kimi_k25", [-1, 2, 30]),
    ],
)
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


@pytest.mark.parametrize(
    "ids, model_type, request_, slots",
    [
        # Llama: SGLang adds 1 to each requested id; N-2 (the last layer's input) is added once.
        ([1, 14, 26], "llama", [1, 14, 26, 28], {1: 0, 14: 1, 26: 2, 28: 3}),
        ([0, 2, 4], "llama", [0, 2, 4], {0: 0, 2: 1, 4: 2}),  # N=6: id 4 is already N-2
        ([1, 2, 5], "llama", [1, 2, 4], {1: 0, 2: 1, 4: 2}),  # id N-1 has no slot: the tail gives it
        # DeepSeek family: the request is taken as layer inputs unless it starts with 1.
        ([1, 29, 57], "deepseek_v3", [2, 30, 58, 60], {1: 0, 29: 1, 57: 2, 59: 3}),
        ([-1, 2, 30], "kimi_k25", [0, 3, 31, 60], {-1: 0, 2: 1, 30: 2, 59: 3}),
    ],
)
def test_sglang_capture_plan_asks_for_the_ids_and_the_last_layers_input(ids, model_type, request_, slots):
    from eagle3.layer_ids import sglang_capture_plan, sglang_layer_inputs

    num_layers = {"llama": 30, "deepseek_v3": 61, "kimi_k25": 61}[model_type] if ids[0] != 0 and 5 not in ids else 6
    request, slot = sglang_capture_plan(ids, num_layers, model_type)
    assert (request, slot) == (request_, slots)
    # What SGLang then captures (its family rule) is exactly the slots' ids, in layer order.
    assert [i - 1 for i in sglang_layer_inputs(request, model_type)] == sorted(slot)
    # Without the tail (SGLang's runner returns the final state itself), N-2 is asked for only
    # when it is a capture id.
    request, slot = sglang_capture_plan(ids, num_layers, model_type, last_input=False)
    assert sorted(slot) == sorted(i for i in ids if i != num_layers - 1)
    assert [i - 1 for i in sglang_layer_inputs(request, model_type)] == sorted(slot)


def test_the_ids_sglang_really_captured_follow_from_the_layers_its_model_reports():
    """sglang_captured_ids reads SGLang's own `layers_to_capture` (inputs of layers) back into
    the ids the stored blocks hold: the plan's request as each family's rule sets it up gives
    the stored ids back; the same request read by the other family's rule shows the shift."""
    from eagle3.layer_ids import sglang_capture_plan, sglang_captured_ids, sglang_layer_inputs

    for ids, n, family in (([1, 3, 4], 8, "deepseek_v3"), ([1, 3, 5], 6, "llama"), ([-1, 2, 30], 61, "kimi_k25")):
        request, slot = sglang_capture_plan(ids, n, family)
        assert sglang_captured_ids(ids, n, slot, sglang_layer_inputs(request, family)) == ids
    request, slot = sglang_capture_plan([1, 3, 4], 8, "deepseek_v3")  # [2, 4, 5, 7]: taken as given
    assert sglang_captured_ids([1, 3, 4], 8, slot, sglang_layer_inputs(request, "llama")) == [2, 4, 5]
    request, slot = sglang_capture_plan([1, 3, 5], 6, "llama")  # [1, 3, 4]: a DeepSeek model adds 1 too
    assert sglang_captured_ids([1, 3, 5], 6, slot, [2, 4, 5]) == [1, 3, 5]
    assert sglang_captured_ids([1, 3, 5], 6, slot, [1, 3, 4]) == [0, 2, 4]  # taken as given: off by one
    assert sglang_captured_ids([1, 3, 5], 6, slot, [2, 5, 4]) == [1, 3, 5]  # packed in layer order


def test_sglang_capture_plan_refuses_what_the_engine_cannot_return():
    from eagle3.layer_ids import sglang_capture_plan

    with pytest.raises(ConfigError, match=r"cannot return id -1 \(the embeddings\) for a llama target"):
        sglang_capture_plan([-1, 2, 4], 6, "llama")
    with pytest.raises(ConfigError, match=r"cannot capture id 0 first for a deepseek_v3 target"):
        sglang_capture_plan([0, 29, 57], 61, "deepseek_v3")


@pytest.mark.parametrize("ids", [[0, 2, 4], [1, 3, 5]])
def test_the_last_layer_tail_gives_hfs_final_state(tiny_target, ids):
    """norm(layer_{N-1}(id N-2)), from one layer loaded alone, equals the whole model's final
    state (and its pre-norm output equals id N-1): what an SGLang capture computes in one pass."""
    from workflows.core.last_layer import FinalLayerTail
    from workflows.core.targets import load_target

    model, _ = load_target(tiny_target)
    torch.manual_seed(0)
    ids_ = torch.randint(0, 1000, (1, 23))
    aux, final = capture_states(model, ids_, torch.ones_like(ids_), [4, 5])
    tail = FinalLayerTail(tiny_target, torch.float32)
    assert tail.num_layers == 6
    out, normed = tail(aux[0, :, :64])
    torch.testing.assert_close(normed, final[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, aux[0, :, 64:], atol=1e-5, rtol=1e-5)
    # Causal: a prefix gives the same states as the whole sequence's first rows.
    torch.testing.assert_close(tail(aux[0, :9, :64])[1], final[0, :9], atol=1e-5, rtol=1e-5)


def test_the_tail_refuses_a_checkpoint_it_cannot_run_alone(tiny_target, tmp_path):
    import json
    import shutil

    from workflows.core.last_layer import FinalLayerTail, TailUnavailable

    quantized = tmp_path / "q"
    shutil.copytree(tiny_target, quantized)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "x"}}))
    with pytest.raises(TailUnavailable, match="a quantized checkpoint"):
        FinalLayerTail(quantized, torch.float32)
    (quantized / "config.json").write_text(json.dumps(config))
    (quantized / "model.safetensors").unlink()
    with pytest.raises(TailUnavailable, match="no safetensors checkpoint"):
        FinalLayerTail(quantized, torch.float32)


def test_the_tail_batches_right_padded_sequences_exactly(tiny_target):
    from workflows.core.last_layer import FinalLayerTail

    tail = FinalLayerTail(tiny_target, torch.float32)
    torch.manual_seed(1)
    inputs = [torch.randn(n, 64) for n in (5, 17, 9, 1)]
    outs, normed = tail.batch(inputs, token_budget=40)  # groups of mixed lengths, padded right
    for x, o, f in zip(inputs, outs, normed):
        one_o, one_f = tail(x)
        assert o.shape == f.shape == x.shape
        torch.testing.assert_close(o, one_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(f, one_f, atol=1e-5, rtol=1e-5)
