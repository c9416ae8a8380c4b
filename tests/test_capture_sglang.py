"""The SGLang capture engine alone (no Ray stage): its states against HF's by either
final-state method, the worker's timeout, the runner's micro-batches, and what it refuses.
The capture stage on SGLang, through Ray, is in test_capture.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from eagle3.schema import ConfigError


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.parametrize("method,dtype", [("runner", "float32"), ("runner", "bfloat16"), ("tail", "float32")])
def test_sglang_states_equal_hfs_by_either_final_state_method(tiny_target, method, dtype):
    """Both ways of getting the final state from SGLang give HF's states: SGLang's model runner
    (aux and final as tensors from one forward; bf16 crosses as bf16) and the Engine's aux
    states plus the last layer's tail. fp32 on CPU is exact up to kernel order."""
    pytest.importorskip("sglang")
    from workflows.core.engine_spec import EngineSpec
    from workflows.core.engines import make_engine

    seqs = [[1, 5, 9, 33, 2, 7, 100, 4, 8, 8], [3, 4, 5, 6, 7]]
    # 12 tokens per forward: the runner prefills the two sequences as two micro-batches.
    spec = EngineSpec(str(tiny_target), dtype=dtype, capture_ids=[1, 3, 4], final_state=method, micro_batch_tokens=12)
    engine = make_engine("sglang", spec)
    got = engine.states(seqs)
    assert (engine.final_method, engine.engine_starts) == (method, 1)
    for (sa, sf), (ha, hf_) in zip(got, make_engine("hf", spec).states(seqs)):
        assert sa.shape == ha.shape == (sa.shape[0], 3 * 64) and sf.shape == hf_.shape
        assert sa.dtype == sf.dtype == (torch.bfloat16 if (method, dtype) == ("runner", "bfloat16") else torch.float32)
        if dtype == "float32":
            torch.testing.assert_close(sa, ha.float(), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(sf, hf_.float(), atol=5e-4, rtol=1e-4)
        else:  # two bf16 stacks' rounding, layers deep: close as a whole (1-1.5% here), not element by element
            assert (sa.float() - ha.float()).norm() / ha.float().norm() < 0.02
            assert (sf.float() - hf_.float()).norm() / hf_.float().norm() < 0.03
    engine.bare_forward(seqs)  # the benchmark's baseline on the same engine
    if method == "runner":  # a sequence longer than the KV pool (4096 tokens on CPU) is refused, by name
        with pytest.raises(RuntimeError, match="a sequence of 4097 tokens does not fit SGLang's KV pool of 4096"):
            engine.states([[7] * 4097])
    assert engine.states(seqs[::-1])[0][0].shape == got[1][0].shape and engine.engine_starts == 1
    engine.close()
    engine.close()  # twice is harmless


@pytest.mark.sglang
def test_a_silent_sglang_capture_worker_is_reported_after_its_timeout(tiny_target):
    """capture.engine_timeout_s bounds the worker's start (and each call): past it the actor
    gets an error naming the step, the timeout and the worker's state, and the worker is
    told to exit."""
    pytest.importorskip("sglang")
    from workflows.core.engine_spec import EngineSpec
    from workflows.core.engines import make_engine

    engine = make_engine("sglang", EngineSpec(str(tiny_target), capture_ids=[1, 3, 4], timeout_s=0.5))
    with pytest.raises(
        RuntimeError,
        match=r"SGLang capture worker failed during start \(did not answer "
        r"within 0.5 s; rc None\)",
    ):
        engine.states([[1, 2, 3]])
    assert engine._proc is None  # killed: a worker past its timeout gets no grace period


def test_runner_micro_batches_keep_order_and_the_token_budget():
    """The SGLang runner's micro-batches against the obvious reference: consecutive, every
    sequence once, each group within the budget unless it is one longer sequence."""
    import random

    from workflows.core.sglang_runner import micro_batches

    rng = random.Random(0)
    for _ in range(200):
        seqs = [[rng.randrange(9)] * rng.randint(1, 40) for _ in range(rng.randint(1, 12))]
        budget = rng.randint(1, 60)
        groups = micro_batches(seqs, budget)
        assert [s for g in groups for s in g] == seqs and all(groups)
        assert all(sum(map(len, g)) <= budget or len(g) == 1 for g in groups)
        # greedy: a group closes only when the next sequence would not fit
        assert all(sum(map(len, a)) + len(b[0]) > budget for a, b in zip(groups, groups[1:]))
        # and at most max_seqs sequences (SGLang's request pool), still greedy and in order
        capped = micro_batches(seqs, budget, max_seqs=3)
        assert [s for g in capped for s in g] == seqs and all(0 < len(g) <= 3 for g in capped)
        assert all(len(a) == 3 or sum(map(len, a)) + len(b[0]) > budget for a, b in zip(capped, capped[1:]))


def test_sglang_refuses_the_last_layers_output_where_the_tail_cannot_run(tiny_target, tmp_path):
    """SGLang never returns id N-1 (the last layer's output); only the tail gives it, and the
    tail cannot run a quantized layer: refused before any engine starts, naming why."""
    from workflows.core.engine_spec import EngineSpec
    from workflows.core.engines import make_engine

    quantized = tmp_path / "q"
    shutil.copytree(tiny_target, quantized)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "x"}}))
    engine = make_engine("sglang", EngineSpec(str(quantized), capture_ids=[1, 3, 5]))
    with pytest.raises(
        ConfigError,
        match=r"capture id 5 \(the last layer's output, which SGLang never returns\) "
        "needs the last layer's tail: .*a quantized checkpoint",
    ):
        engine.states([[1, 2, 3]])
    assert engine.engine_starts == 0
    with pytest.raises(ConfigError, match="capture.final_state=tail: .*a quantized checkpoint"):
        make_engine("sglang", EngineSpec(str(quantized), capture_ids=[1, 3, 4], final_state="tail")).states([[1, 2]])
    assert engine._proc is None  # the worker exited at EOF
