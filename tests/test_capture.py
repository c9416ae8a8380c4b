"""The capture stage on the tiny target: Ray actor pool, bit-exact states, resume, refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from eagle3.schema import ConfigError
from eagle3.target_features import capture_states
from storage.reader import StoreReader
from storage.store import ProvenanceMismatch
from storage.verify import verify
from tests.faults import capture_faults
from tests.helpers import cfg_for, corpus_rows, run_dir_with_corpus
from workflows.capture import stage as capture
from workflows.core import shard_plan as capture_plan
from workflows.core.errors import USER_ERRORS, InputError, StageFailure


def test_capture_is_bit_exact_and_resumes_after_a_crash(tiny_target, corpus, tmp_path, ray_local):
    run_dir = run_dir_with_corpus(corpus, tmp_path)
    samples = corpus_rows(run_dir)
    n_shards = len(capture_plan.plan_shards(samples, 3)[0])
    # Every shard after the 3rd fails (twice: once, then its retry): 3 are committed, the
    # others are reported and the stage ends with an error naming them.
    crashed = f"{n_shards - 3} shard\\(s\\) failed twice.*test fault fail_after_shards=3: simulated crash"
    with capture_faults(fail_after_shards=3), pytest.raises(StageFailure, match=crashed):
        capture.run(cfg_for(tiny_target, run_dir), tiny_target)
    failed = json.loads((run_dir / "capture" / "summary.json").read_text())["failed_shards"]
    assert len(failed) == n_shards - 3 and all("simulated crash" in f["error"] for f in failed)
    partial = StoreReader(str(run_dir / "store"))
    assert len(partial.shards) == 3 and len(partial) < len(samples)
    assert not (run_dir / "capture" / "DONE.json").exists()
    written = sorted(p.name for p in (run_dir / "store" / "shards").iterdir() if p.is_dir())
    assert written == sorted(r["shard"] for r in partial.shards)  # the failed ones left nothing behind
    assert not {f["shard"] for f in failed} & set(written)
    # A driver killed before committing: the manifest and commit log are lost, the 3 shards
    # stay complete; and one of them is half-written (its writer killed before the marker).
    import zarr

    from storage.zarr_io import zarr_store

    (run_dir / "store" / "manifest.parquet").unlink()
    shutil.rmtree(run_dir / "store" / "commits", ignore_errors=True)
    victim = written[-1]
    zarr.open_group(zarr_store(str(run_dir / "store" / "shards" / victim)), mode="r+").attrs["complete"] = False
    capture.run(cfg_for(tiny_target, run_dir), tiny_target)
    summary = json.loads((run_dir / "capture" / "summary.json").read_text())
    # 12 samples, 3 per shard, train and held-out in separate shards.
    assert n_shards == sum(-(-sum(r["split"] == s for r in samples) // 3) for s in ("train", "heldout"))
    assert summary["verify_ok"] and summary["samples"] == len(samples) and summary["shards"] == n_shards
    # The 3 written before: 2 adopted (complete, never committed), the victim redone.
    assert summary["adopted_shards"] == 2 and summary["new_shards"] == n_shards - 2
    assert summary["failed_shards"] == []
    reader = StoreReader(str(run_dir / "store"))
    assert sorted(reader.sample_ids) == sorted(r["id"] for r in samples)  # every sample exactly once
    assert verify(str(run_dir / "store"))["ok"]
    # The spot check recomputed 2 samples with HF in the driver and recorded its figures.
    spot = summary["spot_check"]
    assert spot["ran"] and spot["samples"] == 2 and spot["layers"] == ["id 0", "id 2", "id 4", "final"]
    assert 0 <= spot["rel_diff"] <= spot["tolerance"] == 2**-8 + 1e-3 and spot["seconds"] >= spot["load_seconds"] > 0
    assert spot["max_token_rel_diff"] <= 2**-8 + 1e-6  # float32 engines: every token within bf16 rounding
    assert json.loads((run_dir / "capture" / "DONE.json").read_text())["summary"]["spot_check"] == spot
    prov = reader.provenance
    assert prov["capture_layer_ids"] == [0, 2, 4] and prov["layer_id_convention"] == "output_of_layer"
    # The layers the engines reported capturing: per actor, in the summary and in the store.
    assert prov["engine_captured_layer_ids"] == summary["engine_captured_layer_ids"] == [0, 2, 4]
    assert {tuple(a["captured_layer_ids"]) for a in summary["per_actor"].values()} == {(0, 2, 4)}
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

    # A rerun reuses the finished stage, also with settings that change how it runs, not
    # what it writes (eagle3.schema.NOT_OUTPUT): nothing is captured or verified again.
    done = (run_dir / "capture" / "DONE.json").stat().st_mtime_ns
    for extra in (
        (),
        (
            "capture.engine_timeout_s=60",
            "capture.max_actor_restarts=0",
            "capture.micro_batch_tokens=512",
            "capture.shards_per_call=1",
            "capture.cpus_per_actor=0.5",
        ),
    ):
        assert capture.run(cfg_for(tiny_target, run_dir, *extra), tiny_target) == run_dir / "capture"
    assert (run_dir / "capture" / "DONE.json").stat().st_mtime_ns == done


def test_failing_shards_are_reported_and_only_they_rerun(tiny_target, corpus, tmp_path, ray_local):
    run_dir = run_dir_with_corpus(corpus, tmp_path)
    plans = capture_plan.plan_shards(corpus_rows(run_dir), 3)[0]
    bad = sorted([plans[1].name, plans[-1].name])  # a train shard and a held-out one
    assert bad[0].startswith("heldout-") and bad[1].startswith("train-")
    reported = (
        r"2 shard\(s\) failed twice: heldout-\S+, train-\S+; first error: RuntimeError: test fault "
        r"fail_shards: simulated failure of shard.*rerun, which captures only these"
    )
    with capture_faults(fail_shards=bad), pytest.raises(StageFailure, match=reported):
        capture.run(cfg_for(tiny_target, run_dir), tiny_target)
    assert issubclass(StageFailure, USER_ERRORS)  # the entry points' one `error:` line, exit status 2
    summary = json.loads((run_dir / "capture" / "summary.json").read_text())
    assert sorted(f["shard"] for f in summary["failed_shards"]) == bad and summary["verify_ok"] is None
    assert summary["new_shards"] == len(plans) - 2 and summary["shards"] == len(plans) - 2
    good = {r["shard"] for r in StoreReader(str(run_dir / "store")).shards}
    assert good == {p.name for p in plans} - set(bad) and not (run_dir / "capture" / "DONE.json").exists()
    stamps = {n: (run_dir / "store" / "shards" / n / "zarr.json").stat().st_mtime_ns for n in good}
    # Without the fault, a rerun captures exactly the two and leaves the others alone.
    capture.run(cfg_for(tiny_target, run_dir), tiny_target)
    summary = json.loads((run_dir / "capture" / "summary.json").read_text())
    assert summary["new_shards"] == 2 and summary["adopted_shards"] == 0 and summary["failed_shards"] == []
    assert summary["verify_ok"] and summary["shards"] == len(plans)
    assert stamps == {n: (run_dir / "store" / "shards" / n / "zarr.json").stat().st_mtime_ns for n in good}
    assert sorted(StoreReader(str(run_dir / "store")).sample_ids) == sorted(r["id"] for r in corpus_rows(run_dir))


def test_an_actor_killed_mid_batch_is_restarted_and_its_shards_rewritten(tiny_target, corpus, tmp_path, ray_local):
    run_dir = run_dir_with_corpus(corpus, tmp_path)
    plans = capture_plan.plan_shards(corpus_rows(run_dir), 3)[0]
    # The call holding shards 0 and 1 writes shard 0 (never committed), then its process
    # exits at shard 1. Ray restarts the actor and reruns the call. Ray Data may hand that
    # actor another call first (it then shows in the summary with those shards).
    with capture_faults(die_in_shards=(plans[1].name,), marker_dir=tmp_path / "faults"):
        capture.run(cfg_for(tiny_target, run_dir), tiny_target)
    dead = (tmp_path / "faults" / f"died-in-{plans[1].name}").read_text()
    summary = json.loads((run_dir / "capture" / "summary.json").read_text())
    assert summary["verify_ok"] and summary["shards"] == summary["new_shards"] == len(plans)
    assert summary["failed_shards"] == []
    assert set(summary["per_actor"]) - {dead}, "no restarted process finished the killed call"
    assert summary["per_actor"].get(dead, {"shards": 0})["shards"] < len(plans)
    assert sum(a["shards"] for a in summary["per_actor"].values()) == len(plans)
    assert sorted(StoreReader(str(run_dir / "store")).sample_ids) == sorted(r["id"] for r in corpus_rows(run_dir))


def test_a_failing_shard_is_retried_once_in_place_then_reported():
    """capture_and_write with retries=1: the bad shard is tried twice, after the others, and
    comes back as an error row; a shard that fails once then succeeds is written."""
    from workflows.capture.writer import ShardPlan, capture_and_write

    class Engine:
        def states(self, seqs):
            return [(torch.ones(len(s), 6), torch.ones(len(s), 2)) for s in seqs]

    class Store:
        def __init__(self):
            self.written, self.removed = [], []

        def write_shard(self, name, data, chunk_bytes, compression):
            if name == "flaky" and "flaky" not in self.removed:  # the first write dies
                raise OSError("disk hiccup")
            self.written.append(name)
            return {"shard": name, "n_tokens": len(data.input_ids)}

        def remove_shard(self, name):
            self.removed.append(name)

    attempts = []

    def load(plan):  # each attempt at a shard loads it first
        attempts.append(plan.name)
        if plan.name == "bad":
            raise RuntimeError("always")
        return plan

    plans = [ShardPlan(n, [n], [[1, 2, 3]], [[0, 1, 1]]) for n in ("a", "bad", "flaky", "b")]
    store = Store()
    rows = capture_and_write(Engine(), store, plans, 1 << 20, retries=1, load=load)
    assert attempts == ["a", "bad", "flaky", "b", "bad", "flaky"]
    assert [r["shard"] for r in rows] == ["a", "b", "bad", "flaky"] and store.written == ["a", "b", "flaky"]
    assert rows[2]["error"] == "RuntimeError: always" and rows[2]["n_tokens"] == 0
    assert [r["error"] for r in rows if r["shard"] != "bad"] == [None] * 3 and store.removed == ["bad", "bad", "flaky"]
    with pytest.raises(RuntimeError, match="always"):  # retries=None: the first error propagates
        capture_and_write(Engine(), Store(), plans, 1 << 20, load=load)


def test_store_refuses_a_contradicting_config_and_the_spot_check_a_tampered_store(
    tiny_target, corpus, tmp_path, ray_local
):
    """A store refuses a config that contradicts it. One layer of one spot-checked sample
    scaled, then replaced by another layer's states: the stage (or the spot check alone)
    refuses, naming the shard, the sample, the layer and the difference, and the capture is
    not marked done."""
    from workflows.capture.spot_check import pick

    run_dir = run_dir_with_corpus(corpus, tmp_path)
    capture.run(cfg_for(tiny_target, run_dir, "capture.spot_check_samples=0"), tiny_target)
    assert json.loads((run_dir / "capture" / "summary.json").read_text())["spot_check"] == {
        "ran": False,
        "reason": "capture.spot_check_samples=0",
    }
    with pytest.raises(ProvenanceMismatch, match="'capture_layer_ids'"):
        capture.run(cfg_for(tiny_target, run_dir, "target.capture_layer_ids=[1,2,4]"), tiny_target)
    with pytest.raises(ProvenanceMismatch, match="'plan'"):
        capture.run(cfg_for(tiny_target, run_dir, "capture.shard_samples=5"), tiny_target)

    cfg, url = cfg_for(tiny_target, run_dir), str(run_dir / "store")
    shard, k = pick(StoreReader(url), 2)[1]
    sample = StoreReader(url).store.shard_attrs(shard)["sample_ids"][k]
    tamper(url, shard, k, lambda states: states[:, 1].mul_(1.5))
    (run_dir / "capture" / "DONE.json").unlink(missing_ok=True)  # the stage rerun over this store
    said = (
        rf"shard {shard}, sample '{sample}', layer id 2: the store differs from an HF recomputation by "
        r"0\.(49\d|5\d*) of the tokens' scale on average"  # a layer scaled by 1.5: 0.5, give or take bf16
    )
    with pytest.raises(StageFailure, match=said):
        capture.run(cfg, tiny_target)
    assert not (run_dir / "capture" / "DONE.json").exists()
    assert "layer id 2" in json.loads((run_dir / "capture" / "summary.json").read_text())["spot_check"]["failed"]
    # id 2's slot holding id 4's states (a layer-id rule misread): refused as well.
    tamper(url, shard, k, lambda states: states[:, 1].copy_(states[:, 2]))
    with pytest.raises(
        StageFailure,
        match=rf"shard {shard}, sample '{sample}', layer id 2: .*of the tokens' scale on average \(worst token",
    ):
        capture.run_spot_check(cfg, tiny_target, url)

    # (b) A store whose engine reported capturing other layers than it names: the train side
    # refuses to open it, and an actor reporting them ends the stage, naming both lists.
    from storage.store import HiddenStateStore, StoreError
    from workflows.core.layout import RunLayout

    HiddenStateStore(url).record({"engine_captured_layer_ids": [1, 3, 5]})
    with pytest.raises(
        StoreError,
        match=r"names capture ids \[0, 2, 4\] but its hf capture engine reported "
        r"capturing ids \[1, 3, 5\]",
    ):
        RunLayout.of(cfg).open_store()
    with pytest.raises(StageFailure, match=r"actor a's engine reports capturing ids \[1, 3, 5\] where the store's"):
        capture.record_captured_layers(HiddenStateStore(url), [0, 2, 4], {"a": {"captured_layer_ids": [1, 3, 5]}})


def tamper(store_url: str, shard: str, k: int, change) -> None:
    """Rewrite sample `k` of `shard` through the store's writer, its aux states [T, 3, H]
    changed in place by `change` (a capture that went wrong, as the spot check sees it)."""
    import numpy as np

    from storage.store import HiddenStateStore, ShardData
    from storage.zarr_io import from_bf16_bits, to_bf16_bits

    arrays = StoreReader(store_url).read_shard(shard)
    a, b = arrays["offsets"][k], arrays["offsets"][k + 1]
    aux = from_bf16_bits(arrays["aux"]).float()
    states = aux[a:b].view(b - a, 3, -1)
    change(states)
    aux[a:b] = states.view(b - a, -1)
    fields = {f: arrays[f] for f in ("input_ids", "loss_mask", "offsets", "final")}
    data = ShardData(sample_ids=arrays["sample_ids"], aux=np.ascontiguousarray(to_bf16_bits(aux)), **fields)
    HiddenStateStore(store_url).write_shard(shard, data)


def test_train_reads_the_same_batches_from_the_store(tiny_target, corpus, tmp_path, ray_local):
    from eagle3.target_features import capture_batch
    from tests.helpers import contract_of
    from workflows.core.layout import RunLayout
    from workflows.core.provenance import target_identity
    from workflows.core.targets import load_target
    from workflows.train.data import eval_batches

    run_dir = run_dir_with_corpus(corpus, tmp_path)
    cfg = cfg_for(tiny_target, run_dir)
    capture.run(cfg, tiny_target)
    identity = target_identity(tiny_target, cfg.cache_path)
    reader = RunLayout.of(cfg).open_store(expect=contract_of(cfg, identity))
    rows = {r["id"]: r for r in corpus_rows(run_dir)}
    # Shards are per split, named by it, and hold exactly the corpus's samples of that split.
    for split in ("train", "heldout"):
        names = reader.shard_names(split)
        assert names and all(n.startswith(split + "-") for n in names)
        ids = [sid for n in names for sid in reader.store.shard_attrs(n)["sample_ids"]]
        assert sorted(ids) == sorted(i for i, r in rows.items() if r["split"] == split)
    model, _ = load_target(tiny_target, dtype="float32")
    names = reader.shard_names("train")
    order = [sid for n in names for sid in reader.store.shard_attrs(n)["sample_ids"]]
    for k, got in enumerate(eval_batches(reader, names, batch_size=4, max_seq_len=4096, pad_id=0)):
        group = [rows[sid] for sid in order[4 * k : 4 * k + 4]]
        want = capture_batch(model, [r["input_ids"] for r in group], [r["loss_mask"] for r in group], [0, 2, 4])
        assert set(got) == set(want) and got["aux"].dtype == torch.bfloat16
        for key in ("input_ids", "loss_mask", "attention_mask", "position_ids", "segment_ids"):
            assert torch.equal(got[key], want[key]), key
        m = want["attention_mask"]
        torch.testing.assert_close(
            got["aux"][m].float(), want["aux"][m].to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2
        )
        torch.testing.assert_close(
            got["final"][m].float(), want["final"][m].to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2
        )
    # train.eval_max_samples: the first samples in store order, however many shards there are.
    bounded = list(eval_batches(reader, names, batch_size=4, max_seq_len=4096, pad_id=0, max_samples=5))
    assert len(order) > 5 and [b["input_ids"].shape[0] for b in bounded] == [4, 1]
    first = [rows[sid]["input_ids"] for sid in order[:5]]
    assert [r[m].tolist() for b in bounded for r, m in zip(b["input_ids"], b["attention_mask"])] == first
    layout = RunLayout.of(cfg)
    with pytest.raises(ProvenanceMismatch, match="'hidden_size'"):
        layout.open_store(expect=contract_of(cfg_for(tiny_target, run_dir, "target.hidden_size=96"), identity))
    # The train side checks as much as capture does: the engine's dtype, backend, weights.
    with pytest.raises(ProvenanceMismatch, match="'engine_dtype'"):
        layout.open_store(expect=contract_of(cfg_for(tiny_target, run_dir, "capture.dtype=bfloat16"), identity))
    with pytest.raises(ProvenanceMismatch, match="'target_weights_sha256'"):
        layout.open_store(expect=contract_of(cfg, {**identity, "weights_sha256": "other"}))


def test_bad_inputs_are_refused_or_counted(tiny_target, tmp_path):
    with pytest.raises(ConfigError, match=r"target.capture_layer_ids\[2\]=7 is out of range"):
        cfg_for(tiny_target, tmp_path, "target.capture_layer_ids=[0,2,7]")
    plans, skipped, _ = capture_plan.plan_shards(
        [
            {"id": "a", "input_ids": [1, 2], "loss_mask": [0, 1]},
            {"id": "e", "input_ids": [], "loss_mask": []},
            {"id": "b", "input_ids": [3], "loss_mask": [1]},
        ],
        shard_samples=4,
    )
    assert skipped == {"empty_sample": 1} and plans[0].sample_ids == ["a", "b"] and plans[0].n_tokens == 3
    with pytest.raises(InputError, match="row 0 \\(id 'x'\\): field input_ids has 2 tokens but loss_mask 1"):
        capture_plan.plan_shards([{"id": "x", "input_ids": [1, 2], "loss_mask": [1]}], shard_samples=4)


@pytest.mark.slow
@pytest.mark.sglang
def test_the_capture_stage_on_sglang_uses_one_engine_per_actor_and_one_forward(
    tiny_target, corpus, tmp_path, ray_local
):
    """capture.backend=sglang through the Ray stage: one engine for the actor's calls, every
    state from one forward (ids 1 and 3 and the final state from SGLang's runner, 5 = the last
    layer's output from the tail), stored states equal to HF's."""
    pytest.importorskip("sglang")
    from workflows.core.engine_spec import EngineSpec
    from workflows.core.engines import make_engine

    run_dir = run_dir_with_corpus(corpus, tmp_path)
    cfg = cfg_for(tiny_target, run_dir, "capture.backend=sglang", "target.capture_layer_ids=[1,3,5]")
    capture.run(cfg, tiny_target)
    summary = json.loads((run_dir / "capture" / "summary.json").read_text())
    (actor,) = summary["per_actor"].values()
    n_shards = len(capture_plan.plan_shards(corpus_rows(run_dir), 3)[0])
    assert summary["verify_ok"] and actor["shards"] == n_shards > 2 * cfg.capture.shards_per_call  # several calls
    assert (actor["engine_starts"], actor["final_state"]) == (1, "runner")
    # What SGLang's Llama model reports capturing (inputs of layers 2, 4, 5: ids 1, 3 and the
    # tail's input 4, whose last layer gives id 5), recorded in the store.
    assert (actor["layers_to_capture"], actor["captured_layer_ids"]) == ([2, 4, 5], [1, 3, 5])
    prov = StoreReader(str(run_dir / "store")).provenance
    assert (prov["engine_layers_to_capture"], prov["engine_captured_layer_ids"]) == ([2, 4, 5], [1, 3, 5])
    reader = StoreReader(str(run_dir / "store"))
    hf = make_engine("hf", EngineSpec(str(tiny_target), capture_ids=[1, 3, 5]))
    for sample_id in reader.sample_ids[:4]:
        sample = reader.sample(sample_id)
        ((aux, final),) = hf.states([sample["input_ids"].tolist()])
        torch.testing.assert_close(sample["aux"].float(), aux.bfloat16().float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(sample["final"].float(), final.bfloat16().float(), atol=2e-2, rtol=2e-2)
