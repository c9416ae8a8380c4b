"""`auto` compute dtypes: measured on the machine, explicit values kept, the choice logged."""

from __future__ import annotations

import pytest

from workflows.core import precision


@pytest.fixture(autouse=True)
def fresh_choice():
    precision.cpu_choice.cache_clear()
    yield
    precision.cpu_choice.cache_clear()


@pytest.mark.parametrize(
    "bf16, fp32, chosen",
    [
        (8.0, 55.0, "float32"),  # an AMD EPYC without bf16 units (the figures that made bf16 crawl)
        (300.0, 50.0, "bfloat16"),  # a Xeon with AMX
        (55.0, 50.0, "float32"),  # barely faster: not worth the precision
    ],
)
def test_auto_picks_the_faster_dtype_and_says_why(monkeypatch, capsys, bf16, fp32, chosen):
    monkeypatch.setattr(precision, "matmul_gflops", lambda dtype: bf16 if dtype == "bfloat16" else fp32)
    assert precision.resolve("auto") == chosen
    assert precision.resolve("auto") == chosen  # measured once per process
    out = capsys.readouterr().out
    assert out.count("[precision]") == 1
    assert f"CPU compute dtype: {chosen}: bf16 matmul {bf16:.1f} GFLOP/s vs fp32 {fp32:.1f}" in out


def test_explicit_dtypes_are_kept(monkeypatch):
    monkeypatch.setattr(precision, "matmul_gflops", lambda dtype: pytest.fail("measured an explicit dtype"))
    assert [precision.resolve(d) for d in ("bfloat16", "float32", "float16")] == ["bfloat16", "float32", "float16"]


def test_the_measurement_is_real_and_restores_threads():
    import torch

    threads = torch.get_num_threads()
    dtype, why = precision.cpu_choice()
    assert dtype in ("bfloat16", "float32") and "GFLOP/s" in why
    assert torch.get_num_threads() == threads
    # One 256^3 product in fp32 runs at well over 0.1 GFLOP/s on any CPU this runs on.
    assert precision.matmul_gflops("float32") > 0.1


def test_the_config_defaults_to_auto_and_the_store_records_the_resolved_dtype(monkeypatch):
    from tests.helpers import contract_of
    from workflows.core.config import compose

    cfg = compose(["target=tiny"])
    assert (cfg.data.dtype, cfg.capture.dtype, cfg.train.compute_dtype, cfg.train.capture_dtype) == ("auto",) * 4
    monkeypatch.setattr(precision, "matmul_gflops", lambda dtype: 300.0 if dtype == "bfloat16" else 50.0)
    identity = {"path": "/t", "weights_sha256": "w", "tokenizer_sha256": "t", "chat_template_sha256": "c"}
    assert contract_of(cfg, identity)["engine_dtype"] == "bfloat16"
    assert contract_of(compose(["target=tiny", "capture.dtype=float32"]), identity)["engine_dtype"] == "float32"


@pytest.mark.parametrize(
    "bf16, fp32, overrides, chosen, reason",
    [
        (8.0, 55.0, [], "float32", "not the serving dtype bfloat16: it runs slowly on this CPU"),
        (300.0, 50.0, [], "bfloat16", "the serving dtype"),
        (8.0, 55.0, ["evaluate.dtype=bfloat16"], "bfloat16", "evaluate.dtype=bfloat16"),
        (300.0, 50.0, ["evaluate.dtype=float32"], "float32", "evaluate.dtype=float32 (serving: bfloat16)"),
        (8.0, 55.0, ["target=tiny"], "float32", "the serving dtype"),  # the tiny target is served in fp32
    ],
)
def test_evaluation_runs_in_the_serving_dtype_where_it_is_fast(monkeypatch, bf16, fp32, overrides, chosen, reason):
    from workflows.core.config import compose
    from workflows.evaluate import evaluation_dtype

    monkeypatch.setattr(precision, "matmul_gflops", lambda dtype: bf16 if dtype == "bfloat16" else fp32)
    cfg = compose(overrides)  # the default target (SmolLM2) is served in bf16
    assert cfg.evaluate.dtype == next((o.split("=")[1] for o in overrides if o.startswith("evaluate.")), "auto")
    dtype, why = evaluation_dtype(cfg.evaluate.dtype, cfg.target.dtype)
    assert dtype == chosen and why.startswith(reason), why


def test_evaluation_on_a_gpu_follows_the_gpu_not_this_cpu(monkeypatch):
    import torch

    from workflows.core.config import compose
    from workflows.evaluate.stage import evaluation_device

    monkeypatch.setattr(precision, "matmul_gflops", lambda dtype: pytest.fail("probed the CPU for a GPU evaluation"))
    from workflows.evaluate import evaluation_dtype

    serving = compose([]).target.dtype  # SmolLM2, served in bf16

    assert evaluation_dtype("auto", serving, "cuda") == ("bfloat16", "the serving dtype, on the GPU")
    assert evaluation_dtype(compose(["evaluate.dtype=float32"]).evaluate.dtype, serving, "cuda")[0] == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert evaluation_device("auto") == "cuda" and evaluation_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert evaluation_device("auto") == "cpu"
