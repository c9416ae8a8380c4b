"""The capture stage on the tiny target: Ray actor pool, bit-exact states, resume, refusals."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eagle3.schema import ConfigError
from eagle3.target_features import capture_states
from storage.reader import StoreReader
from storage.store import ProvenanceMismatch
from storage.verify import verify
from tests.helpers import corpus_rows
from workflows.capture import stage as capture
from workflows.core.config import compose
from workflows.core.errors import InputError
from workflows.generate import stage as generate


def cfg_for(tiny_target, run_dir, *extra):
    return compose([
        "target=tiny", "mixture=bundled", f"cache_dir={tiny_target.parent.parent}", f"run_dir={run_dir}",
        "data.limit=12", "data.max_new_tokens=16", "data.heldout_fraction=0.25",
        "capture.shard_samples=3", "capture.shards_per_call=2", "capture.micro_batch_tokens=256",
        "cluster.dashboard=false", "cluster.num_cpus=2", "data.dtype=float32", "capture.dtype=float32", *extra])


@pytest.fixture(scope="module")
def corpus(tiny_target, tmp_path_factory):
    """A generated corpus (12 conversations of the tiny target), copied per test."""
    run_dir = tmp_path_factory.mktemp("corpus")
    generate.run(cfg_for(tiny_target, run_dir), tiny_target)
    return run_dir


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray per test session (starting it takes seconds on 2 cores)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="warning")
    yield ray


def run_dir_with_corpus(corpus, tmp_path) -> Path:
    shutil.copytree(corpus / "generate", tmp_path / "generate")
    return tmp_path


def test_capture_is_bit_exact_and_resumes_after_a_crash(tiny_target, corpus, tmp_path, ray_local):
    run_dir = run_dir_with_corpus(corpus, tmp_path)
    samples = corpus_rows(run_dir)
    # The actor dies before its 4th shard: 3 shards are written, the run fails.
    with pytest.raises(Exception, match="simulated crash"):
        capture.run(cfg_for(tiny_target, run_dir, "capture.fail_after_shards=3"), tiny_target)
    partial = StoreReader(str(run_dir / "store"))
    assert len(partial) < len(samples)
    assert not (run_dir / "capture" / "DONE.json").exists()
    written = sorted(p.name for p in (run_dir / "store" / "shards").iterdir() if p.is_dir())
    assert len(written) == 3
    # Make one of them half-written (its writer killed before the marker): it must be redone.
    import zarr
    from storage.zarr_io import zarr_store
    committed = {r["shard"] for r in partial.shards}
    victim = [w for w in written if w not in committed][-1]
    zarr.open_group(zarr_store(str(run_dir / "store" / "shards" / victim)), mode="r+").attrs["complete"] = False
    capture.run(cfg_for(tiny_target, run_dir), tiny_target)
    summary = json.loads((run_dir / "capture" / "summary.json").read_text())
    assert summary["verify_ok"] and summary["samples"] == len(samples) and summary["shards"] == 4
    assert summary["adopted_shards"] == 2 - len(committed) and summary["new_shards"] == 2
    reader = StoreReader(str(run_dir / "store"))
    assert sorted(reader.sample_ids) == sorted(r["id"] for r in samples)  # every sample exactly once
    assert verify(str(run_dir / "store"))["ok"]
    prov = reader.provenance
    assert prov["capture_layer_ids"] == [0, 2, 4] and prov["layer_id_convention"] == "output_of_layer"
    assert prov["final_is_normed"] is True and prov["backend"] == "hf" and prov["tokenizer_sha256"]

    # Bit-exact against a direct single-sample HF capture, rounded to bf16 the same way.
    from workflows.core.targets import load_target

    model, _ = load_target(tiny_target, dtype="float32")
    for row in samples[:3]:
        ids = torch.tensor([row["input_ids"]])
        aux, final = capture_states(model, ids, torch.ones_like(ids), [0, 2, 4])
        got = reader.sample(row["id"])
        assert got["input_ids"].tolist() == row["input_ids"] and got["loss_mask"].tolist() == row["loss_mask"]
        torch.testing.assert_close(got["aux"].float(), aux[0].to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(got["final"].float(), final[0].to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)

    # A rerun reuses the finished stage.
    assert capture.run(cfg_for(tiny_target, run_dir), tiny_target) == run_dir / "capture"


def test_store_refuses_a_contradicting_config(tiny_target, corpus, tmp_path, ray_local):
    run_dir = run_dir_with_corpus(corpus, tmp_path)
    capture.run(cfg_for(tiny_target, run_dir), tiny_target)
    with pytest.raises(ProvenanceMismatch, match="'capture_layer_ids'"):
        capture.run(cfg_for(tiny_target, run_dir, "target.capture_layer_ids=[1,2,4]"), tiny_target)
    with pytest.raises(ProvenanceMismatch, match="'plan'"):
        capture.run(cfg_for(tiny_target, run_dir, "capture.shard_samples=5"), tiny_target)


def test_train_reads_the_same_batches_from_the_store(tiny_target, corpus, tmp_path, ray_local):
    from eagle3.target_features import capture_batch
    from workflows.core.provenance import identity_for
    from workflows.core.targets import load_target
    from workflows.train.stage import make_batches
    from workflows.train.store_data import store_batches

    run_dir = run_dir_with_corpus(corpus, tmp_path)
    cfg = cfg_for(tiny_target, run_dir)
    capture.run(cfg, tiny_target)
    groups = make_batches(corpus_rows(run_dir), 4, seed=0)
    identity = identity_for(cfg, tiny_target)
    [batches] = store_batches(cfg, identity, [groups], pad_id=0)
    model, _ = load_target(tiny_target, dtype="float32")
    for group, got in zip(groups, batches):
        want = capture_batch(model, [r["input_ids"] for r in group], [r["loss_mask"] for r in group], [0, 2, 4])
        assert set(got) == set(want) and got["aux"].dtype == torch.bfloat16
        for k in ("input_ids", "loss_mask", "attention_mask"):
            assert torch.equal(got[k], want[k]), k
        m = want["attention_mask"]
        torch.testing.assert_close(got["aux"][m].float(), want["aux"][m].to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(got["final"][m].float(), want["final"][m].to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)
    with pytest.raises(ProvenanceMismatch, match="'hidden_size'"):
        store_batches(cfg_for(tiny_target, run_dir, "target.hidden_size=96"), identity, [groups], 0)
    # The train side checks as much as capture does: the engine's dtype, backend, weights.
    with pytest.raises(ProvenanceMismatch, match="'engine_dtype'"):
        store_batches(cfg_for(tiny_target, run_dir, "capture.dtype=bfloat16"), identity, [groups], 0)
    with pytest.raises(ProvenanceMismatch, match="'target_weights_sha256'"):
        store_batches(cfg, {**identity, "weights_sha256": "other"}, [groups], 0)


def test_bad_inputs_are_refused_or_counted(tiny_target, tmp_path):
    with pytest.raises(ConfigError, match=r"target.capture_layer_ids\[2\]=7 is out of range"):
        cfg_for(tiny_target, tmp_path, "target.capture_layer_ids=[0,2,7]")
    plans, skipped = capture.plan_shards(
        [{"id": "a", "input_ids": [1, 2], "loss_mask": [0, 1]}, {"id": "e", "input_ids": [], "loss_mask": []},
         {"id": "b", "input_ids": [3], "loss_mask": [1]}], shard_samples=4)
    assert skipped == {"empty_sample": 1} and plans[0].sample_ids == ["a", "b"]
    with pytest.raises(InputError, match="row 0 \\(id 'x'\\): field input_ids has 2 tokens but loss_mask 1"):
        capture.plan_shards([{"id": "x", "input_ids": [1, 2], "loss_mask": [1]}], shard_samples=4)


def test_estimate_and_space_refusal(tiny_target, tmp_path, capsys):
    kimi = compose(["target=kimi_k25_int4"])
    est = capture.estimate(kimi, 88_000_000)
    assert est["bytes_per_token"] == 2 * 4 * 7168 + 5 == 57349
    assert est["projected_bytes"] == 57349 * 88_000_000  # ~5.05 TB (4.59 TiB)
    assert est["projected"].startswith("5.047 TB (4.590 TiB)")
    with pytest.raises(ConfigError, match="capture.store=.*needs ~5046.71 GB.*capture.ignore_space=true"):
        capture.check_space(str(tmp_path / "store"), est["projected_bytes"], ignore=False)
    assert capture.check_space(str(tmp_path / "store"), est["projected_bytes"], ignore=True)["free_bytes"] > 0


@pytest.mark.slow
@pytest.mark.sglang
def test_sglang_and_hf_engines_give_the_same_states(tiny_target):
    """Parity on CPU in fp32: SGLang (aux pass + full pass, in a subprocess) vs HF hooks."""
    pytest.importorskip("sglang")
    from workflows.core.engines import EngineSpec, make_engine

    seqs = [[1, 5, 9, 33, 2, 7, 100, 4, 8, 8], [3, 4, 5, 6, 7]]
    spec = EngineSpec(str(tiny_target), dtype="float32", layer_ids=[0, 2, 4])
    sgl = make_engine("sglang", spec).states(seqs)
    hf = make_engine("hf", spec).states(seqs)
    for (sa, sf), (ha, hf_) in zip(sgl, hf):
        assert sa.shape == ha.shape == (sa.shape[0], 3 * 64) and sf.shape == hf_.shape
        torch.testing.assert_close(sa, ha.float(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(sf, hf_.float(), atol=1e-4, rtol=1e-4)
