"""The report: offline walk vs the reference decoder, and the stage end to end."""
import json

import pytest
import torch

from eagle3.target_features import capture_batch
from eagle3.target_head import TargetHead
from eagle3.training import LoopConfig, OptimConfig, train_in_memory
from eagle3.ttt import NoiseConfig, TTTConfig
from tests.helpers import tiny_hf_llama
from tests.test_acceptance_decoding import LAYERS, greedy_texts, make_draft
from workflows.evaluate import by_bucket, decode_all, offline_acceptance


def test_by_bucket():
    got = by_bucket([10, 70, 64, 600], [(4, 2), (9, 3), (2, 2), (5, 5)], [64, 128])
    assert got == {"<=64": 6 / 4, "<=128": 3.0, ">128": 1.0}


def test_offline_walk_equals_decoded_acceptance_for_a_trained_draft():
    """float64 on both sides: the walk over TTT outputs predicts the decoder exactly,
    row by row, and the decoder stays lossless."""
    torch.manual_seed(0)
    target = tiny_hf_llama(num_layers=6, hidden=24, vocab=97, dtype=torch.float64)
    seqs, masks = greedy_texts(target, 8, prompt_len=6, new_tokens=30, seed=2)
    batch32 = capture_batch(target, seqs, masks, LAYERS, dtype=torch.float32)
    draft = make_draft(target, batch32, draft_vocab=64)
    cfg = LoopConfig(steps=80, ttt=TTTConfig(length=4, decay=0.8, noise=NoiseConfig(kind="gaussian", std=0.01)),
                     optim=OptimConfig(lr=3e-3, warmup_steps=10), compute_dtype="float32", log_every=1000)
    train_in_memory(draft, TargetHead(target.lm_head.weight.float()), [batch32], cfg)
    draft = draft.double().eval()
    rows = [{"id": str(i), "input_ids": s, "loss_mask": m} for i, (s, m) in enumerate(zip(seqs, masks))]
    groups = [rows[:4], rows[4:]]
    batches = [capture_batch(target, [r["input_ids"] for r in g], [r["loss_mask"] for r in g], LAYERS) for g in groups]
    offline, per_row = offline_acceptance(draft, TargetHead(target.lm_head.weight), groups, batches, k=3)
    dec = decode_all(target, draft, rows, LAYERS, num_steps=3, topk=1, num_draft_tokens=None, eos=[])
    assert dec["lossless"] and dec["text_agreement"] == 1.0
    assert offline.walk > 1.3  # the draft learned something, so the comparison means something
    assert [(a.tokens, a.passes) for a in per_row] == [(p["gained"], p["passes"]) for p in dec["per_row"]]
    assert dec["acceptance"] == offline.walk
    assert dec["per_position_acceptance"] == pytest.approx(offline.per_slot_rate)
    tree = decode_all(target, draft, rows, LAYERS, num_steps=3, topk=2, num_draft_tokens=6, eos=[])
    assert tree["lossless"] and tree["acceptance"] >= dec["acceptance"] - 0.05


@pytest.mark.slow
def test_full_pipeline_through_evaluate_writes_the_report(tmp_path, tiny_target, monkeypatch):
    from tests.test_workflows import tiny_cfg
    from workflows import full

    cfg = tiny_cfg(tiny_target, tmp_path / "run", "train.steps=60", "evaluate.max_prompts=4",
                   "evaluate.max_new_tokens=20", "evaluate.num_steps=3", "train.acceptance_k=3",
                   "train.backend=local")
    assert cfg.stages[-2:] == ["export", "evaluate"]
    logs = []
    monkeypatch.setattr(full, "log", logs.append)
    full.run(cfg)
    report = json.loads((tmp_path / "run" / "report" / "report.json").read_text())
    # The run ends on the report's headline, the draft's place and the serve command.
    assert logs[-3].startswith(f"acceptance: offline {report['acceptance_offline']:.3f}, decoded ")
    assert logs[-2] == f"draft: {tmp_path / 'run' / 'export' / 'sglang'}"
    assert logs[-1].endswith(f"python -m workflows.tools.serve target=tiny run_dir={tmp_path / 'run'} serve.launch=true")
    for key in ("acceptance_offline", "acceptance_decoded", "parity_ratio", "lossless", "num_draft_tokens", "topk",
                "per_position_acceptance", "speedup_decoded"):
        assert key in report, key
    assert report["lossless"] is True and report["num_draft_tokens"] == 4 and report["topk"] == 1
    assert len(report["per_position_acceptance"]) == 3
    assert report["serve_args"] == ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
                                    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    # SGLang counts the prefill's token too: one more token per prompt over the same passes.
    passes = report["target_forwards_decoded"]
    assert report["acceptance_decoded_sglang_definition"] == pytest.approx(
        report["acceptance_decoded"] + report["prompts"] / passes)
    assert report["acceptance_decoded"] >= 1.0 and report["speedup_decoded"] > 0
    # Same draft, same answers, same dtype: the offline walk predicts decoding.
    assert 0.95 <= report["parity_ratio"] <= 1.05, report
    for png in ("per_position.png", "by_prompt_length.png", "speed.png"):
        assert (tmp_path / "run" / "report" / png).stat().st_size > 1000
    assert "parity ratio" in (tmp_path / "run" / "report" / "report.md").read_text()
    assert (tmp_path / "run" / "export" / "sglang" / "config.json").exists()
    assert (tmp_path / "run" / "export" / "DONE.json").exists()
    # The export was made from this run's draft: the report scores the weights as served.
    assert report["draft"] == str(tmp_path / "run" / "export" / "sglang" / "model.safetensors")

    # Retrain without exporting again: the old export belongs to another draft, so the
    # report scores the new trained draft, never the stale export.
    retrained = tiny_cfg(tiny_target, tmp_path / "run", "train.steps=30", "evaluate.max_prompts=4",
                         "evaluate.max_new_tokens=20", "evaluate.num_steps=3", "train.acceptance_k=3",
                         "train.backend=local", "stages=[train,evaluate]",
                         "train.resume=false")  # another step budget: a fresh run, not a resume
    full.run(retrained)
    report = json.loads((tmp_path / "run" / "report" / "report.json").read_text())
    assert report["draft"] == str(tmp_path / "run" / "train" / "draft" / "draft.safetensors")


def test_markdown_lists_served_benchmark():
    from workflows.evaluate import markdown

    r = {"draft": "d", "target": "t", "prompts": 2, "max_new_tokens": 8, "num_steps": 3, "topk": 1,
         "acceptance_offline": 1.5, "acceptance_offline_per_position_average": 1.7, "acceptance_decoded": 1.5,
         "acceptance_decoded_sglang_definition": 1.7, "dtype": "float32",
         "serve_args": ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3"],
         "parity_ratio": 1.0, "lossless": True, "text_agreement": 1.0, "tokens_per_s_plain": 10.0,
         "tokens_per_s_decoded": 12.0, "speedup_decoded": 1.2, "per_position_acceptance_offline": [0.5, 0.4, 0.3],
         "per_position_acceptance": [0.5, 0.4, 0.3],
         "served_benchmark": {"api": "generate", "results": {"1": {"tokens_per_s_mean": 42.0, "accept_length": 2.5}}}}
    md = markdown(r, ["speed.png"])
    assert "| parity ratio offline / decoded | 1.000 |" in md
    assert "| served (generate), concurrency 1: tokens/s, accept length | 42.0, 2.5 |" in md
    assert "![speed.png](speed.png)" in md
    assert "| acceptance decoded, SGLang's definition" in md and "| 1.700 |" in md
    assert "serving with `--speculative-algorithm EAGLE3 --speculative-num-steps 3`" in md
