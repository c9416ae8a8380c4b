"""The wiring doctor names both sides of every disagreement."""

import pytest
import torch

from eagle3.schema import ConfigError
from workflows.core import wiring as doctor
from workflows.core.wiring import Side, check, side_from_engine_capture, side_from_provenance


def draft_side(**facts):
    base = {
        "capture_layer_ids": [-1, 2, 30],
        "target_hidden_size": 7168,
        "target_vocab_size": 163840,
        "draft_vocab_size": 32000,
        "vocab_map_sha256": "aa",
        "tokenizer_sha256": "t1",
        "chat_template_sha256": "c1",
        "target_path": "/models/K",
        "target_num_layers": 61,
    }
    base.update(facts)
    return Side("draft checkpoint (train/draft)", base)


def test_the_real_failure_trained_on_embeddings_served_on_layer_inputs():
    served = side_from_engine_capture("SGLang engine (default capture)", [2, 30, 58])
    assert served.facts["capture_layer_ids"] == [1, 29, 57]
    errors = check([draft_side(), served])
    assert len(errors) == 1
    msg = errors[0]
    assert msg.startswith("capture_layer_ids:")
    assert "draft checkpoint (train/draft) says [-1, 2, 30]" in msg
    assert "SGLang engine (default capture) says [1, 29, 57] (inputs of layers [2, 30, 58])" in msg


def test_same_wiring_in_both_conventions_agrees():
    assert check([draft_side(capture_layer_ids=[1, 29, 57]), side_from_engine_capture("engine", [2, 30, 58])]) == []


@pytest.mark.parametrize(
    "field, other",
    [
        ("target_hidden_size", 4096),
        ("target_vocab_size", 128256),
        ("draft_vocab_size", 16000),
        ("vocab_map_sha256", "bb"),
        ("tokenizer_sha256", "t2"),
        ("chat_template_sha256", "c2"),
        ("target_path", "/models/Other"),
        ("target_num_layers", 60),
        ("capture_layer_ids", [1, 29, 57]),
    ],
)
def test_every_kind_of_mismatch_is_named(field, other):
    a, b = draft_side(), draft_side(**{field: other})
    b.name = "SGLang export (export/sglang)"
    errors = check([a, b])
    assert len(errors) == 1 and errors[0].startswith(f"{field}:")
    assert "draft checkpoint (train/draft)" in errors[0] and "SGLang export (export/sglang)" in errors[0]
    with pytest.raises(ConfigError, match=field):
        doctor.raise_on_errors(errors)


def test_unknown_convention_and_inconsistent_vocab_map_are_errors():
    side = side_from_provenance(
        "store (run/store)", {"capture_layer_ids": [0, 2, 4], "layer_id_convention": "hf_index"}
    )
    assert "no known layer-id convention" in check([side])[0]
    bad = Side("draft")
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[0, 3, 5]] = True
    doctor.check_vocab_map(bad, torch.tensor([0, 2, 4]), t2d)  # target ids 0, 3, 6 vs marked 0, 3, 5
    assert bad.errors and "d2t and t2d disagree" in bad.errors[0]
    good = Side("draft")
    doctor.check_vocab_map(good, torch.tensor([0, 2, 3]), t2d)
    assert good.errors == [] and good.facts["draft_vocab_size"] == 3


def test_export_without_layer_ids_means_sglang_default(tmp_path):
    """An export that names no ids is served with SGLang's default layers: caught."""
    import json

    from safetensors.torch import save_file

    t2d = torch.zeros(8, dtype=torch.bool)
    t2d[:4] = True
    save_file({"d2t": torch.zeros(4, dtype=torch.long), "t2d": t2d}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 16, "vocab_size": 8, "draft_vocab_size": 4}
        )
    )
    side = doctor.side_from_sglang_export(tmp_path, target_num_layers=61)
    errors = check(
        [
            draft_side(draft_vocab_size=None, vocab_map_sha256=None, target_hidden_size=None, target_vocab_size=None),
            side,
        ]
    )
    assert any("says [1, 29, 57] (inputs of layers [2, 30, 58]; SGLang's default" in e for e in errors), errors


def export_naming(folder, ids, num_layers=61, vocab=163840):
    """A minimal SGLang export folder whose config names `ids`."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:4] = True
    save_file({"d2t": torch.zeros(4, dtype=torch.long), "t2d": t2d}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "hidden_size": 7168,
                "vocab_size": vocab,
                "draft_vocab_size": 4,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids},
                "eagle3_pipeline": {"target_num_layers": num_layers},
            }
        )
    )
    return folder


def kimi_draft(ids):
    return draft_side(
        capture_layer_ids=ids,
        draft_vocab_size=None,
        vocab_map_sha256=None,
        target_hidden_size=None,
        target_vocab_size=None,
    )


def test_kimi_preset_follows_sglangs_deepseek_rule(tmp_path):
    """SGLang's DeepSeek-V3 model (Kimi-K2.5's language model) adds 1 only when the first id is 1."""
    from workflows.core.config import compose

    kimi = compose(["target=kimi_k25_int4"]).target
    assert kimi.model_type == "deepseek_v3" and kimi.capture_ids == [1, 29, 57]
    good = doctor.side_from_sglang_export(export_naming(tmp_path / "a", [1, 29, 57]), 61, kimi.model_type)
    assert check([kimi_draft([1, 29, 57]), good]) == []
    # The variant the original run ended with: SGLang reads [-1, 2, 30] as layer *inputs*.
    bad = doctor.side_from_sglang_export(export_naming(tmp_path / "b", [-1, 2, 30]), 61, kimi.model_type)
    [error] = check([kimi_draft([-1, 2, 30]), bad])
    assert "says [-1, 2, 30]" in error and "says [-2, 1, 29] (inputs of layers [-1, 2, 30] for a deepseek_v3" in error
    # A Llama target reads the same list as outputs: no disagreement there.
    llama = doctor.side_from_sglang_export(export_naming(tmp_path / "b", [-1, 2, 30]), 61, "llama")
    assert check([kimi_draft([-1, 2, 30]), llama]) == []


def test_the_last_layer_cannot_be_served(tmp_path):
    side = doctor.side_from_sglang_export(export_naming(tmp_path, [1, 29, 60]), 61, "deepseek_v3")
    assert any("names id 60, the last layer's output, which SGLang cannot capture" in e for e in check([side]))


def test_the_store_side_holds_what_its_engine_reported_capturing(tmp_path):
    """A store's recorded engine-captured ids (the capture stage's `engine_captured_layer_ids`)
    are what it holds: a provenance naming other ids is an error naming both lists, and a draft
    or an export whose ids are not among the captured ones is refused, naming both."""
    prov = {"capture_layer_ids": [1, 29, 57], "layer_id_convention": "output_of_layer", "backend": "sglang"}
    honest = doctor.side_from_store("s3://b/store", {**prov, "engine_captured_layer_ids": [1, 29, 57]})
    assert check([honest, kimi_draft([1, 29, 57])]) == []
    [error] = check([honest, kimi_draft([2, 29, 57])])
    assert error == (
        "capture_layer_ids: draft checkpoint (train/draft) says [2, 29, 57] but hidden-state store (s3://b/store) "
        "holds [1, 29, 57] (as its sglang capture engine reported capturing): [2] are not captured"
    )
    shifted = doctor.side_from_store("s3://b/store", {**prov, "engine_captured_layer_ids": [2, 30, 58]})
    errors = check([shifted, kimi_draft([1, 29, 57])])
    assert errors[0] == (
        "hidden-state store (s3://b/store): its provenance names capture ids [1, 29, 57] but its sglang capture "
        "engine reported capturing ids [2, 30, 58]: the stored states are of other layers; recapture"
    )
    assert "says [1, 29, 57] but hidden-state store (s3://b/store) holds [2, 30, 58]" in errors[1]
    export = doctor.side_from_sglang_export(export_naming(tmp_path, [1, 29, 58]), 61, "deepseek_v3")
    [error] = check([honest, export])
    assert f"SGLang export ({tmp_path}) says [1, 29, 58] (inputs of layers [2, 30, 59]" in error
    assert error.endswith("holds [1, 29, 57] (as its sglang capture engine reported capturing): [58] are not captured")
    assert doctor.side_from_store("x", prov).facts["stored_capture_ids"] == [1, 29, 57]  # nothing recorded
