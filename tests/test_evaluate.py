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
    cfg = LoopConfig(
        steps=80,
        ttt=TTTConfig(length=4, decay=0.8, noise=NoiseConfig(kind="gaussian", std=0.01)),
        optim=OptimConfig(lr=3e-3, warmup_steps=10),
        compute_dtype="float32",
        log_every=1000,
    )
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
    from workflows.evaluate.report import served_per_position

    cfg = tiny_cfg(
        tiny_target,
        tmp_path / "run",
        "train.steps=60",
        "evaluate.max_prompts=4",
        "evaluate.max_new_tokens=20",
        "evaluate.num_steps=3",
        "train.acceptance_k=3",
        "train.backend=local",
        "evaluate.served=auto",
        "evaluate.temperature=0.8",
        # 8 seeds x 3 prompts: sampled figures with a standard error worth the name (2 seeds left
        # the reference's at 6 runs, whose spread misjudged the noise by half).
        "evaluate.seeds=[0,1,2,3,4,5,6,7]",
        "evaluate.device=cpu",
    )
    assert cfg.stages[-2:] == ["export", "evaluate"]
    logs = []
    monkeypatch.setattr(full, "log", logs.append)
    full.run(cfg)
    report = json.loads((tmp_path / "run" / "report" / "report.json").read_text())
    # The run ends on the report's headline, the draft's place and the serve command.
    assert logs[-3].startswith(f"acceptance: offline {report['acceptance_offline']:.3f}, decoded ")
    assert logs[-2] == f"draft: {tmp_path / 'run' / 'export' / 'sglang'}"
    assert logs[-1].endswith(
        f"python -m workflows.tools.serve target=tiny run_dir={tmp_path / 'run'} serve.cpu=true serve.launch=true"
    )  # evaluated on the CPU, so served on it
    for key in (
        "acceptance_offline",
        "acceptance_decoded",
        "parity_ratio",
        "lossless",
        "num_draft_tokens",
        "topk",
        "per_position_acceptance",
        "speedup_decoded",
    ):
        assert key in report, key
    assert report["lossless"] is True and report["num_draft_tokens"] == 4 and report["topk"] == 1
    assert len(report["per_position_acceptance"]) == 3
    assert report["serve_args"] == [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
    ]
    # SGLang counts the prefill's token too: one more token per prompt over the same passes.
    passes = report["target_forwards_decoded"]
    assert report["acceptance_decoded_sglang_definition"] == pytest.approx(
        report["acceptance_decoded"] + report["prompts"] / passes
    )
    # The headline is the per-prompt counts pooled (not a mean of per-prompt ratios), within
    # what k=3 can give; the speed-up is the ratio of the two speeds it reports.
    rows = report["per_prompt_decoded"]
    assert sum(r["passes"] for r in rows) == passes and len(rows) == report["prompts"]
    assert report["acceptance_decoded"] == pytest.approx(sum(r["gained"] for r in rows) / passes)
    assert 1.0 <= report["acceptance_decoded"] <= 4.0
    assert report["speedup_decoded"] == pytest.approx(report["tokens_per_s_decoded"] / report["tokens_per_s_plain"])
    # Same draft, same answers, same dtype: the offline walk predicts decoding.
    assert 0.95 <= report["parity_ratio"] <= 1.05, report
    for png in ("per_position.png", "by_prompt_length.png", "speed.png"):
        assert (tmp_path / "run" / "report" / png).stat().st_size > 1000
    assert "parity ratio" in (tmp_path / "run" / "report" / "report.md").read_text()
    assert (tmp_path / "run" / "export" / "sglang" / "config.json").exists()
    assert (tmp_path / "run" / "export" / "DONE.json").exists()
    # The export was made from this run's draft: the report scores the weights as served.
    assert report["draft"] == str(tmp_path / "run" / "export" / "sglang" / "model.safetensors")
    # Served by both engines on the same prompts: each one's own figure is the prediction in
    # its definition, and each served output is plain greedy decoding.
    served = report["served"]
    assert set(served) == {"sglang", "vllm"}, served
    assert served["sglang"]["predicted"] == report["acceptance_decoded_sglang_definition"]
    assert served["vllm"]["predicted"] == report["acceptance_decoded_vllm_definition"]
    for engine, check in served.items():
        assert check["identical_to_greedy"] == check["prompts"] == report["prompts"] and check["matches_prediction"], (
            check
        )
        assert check["accept_length"] == pytest.approx(check["predicted"], rel=0.02), check
        assert check["device"] == "cpu" and check["dtype"] == report["dtype"] == "float32"
        assert f"; served by {check['engine']} {check['accept_length']:.3f} vs predicted" in logs[-3]
        # Sampling at 0.8 (evaluate.temperature), once per seed of evaluate.seeds, after the greedy round.
        sampled = check["sampled"]
        assert sampled["temperature"] == 0.8 and sampled["seeds"] == list(range(8)), sampled
        counters = sampled["counters"]
        if engine == "sglang":  # one request per prompt and seed
            assert len(counters["completion_tokens"]) == len(counters["verify_passes"]) == 8 * report["prompts"]
        else:  # a chain of 3 drafted tokens per verify pass
            assert counters["num_draft_tokens"] == 3 * counters["num_drafts"], counters
    # SGLang 0.5.23 on a CPU commits the target's argmax when verifying, at any temperature (it
    # has no CPU sampling kernel), as the engine itself says: its figure is kept, not compared.
    hot_sglang = served["sglang"]["sampled"]
    assert hot_sglang["verify"] == "argmax" and "range95" not in hot_sglang, hot_sglang
    assert "at temperature 0.8" in logs[-3] and "not compared: sglang" in logs[-3], logs[-3]
    # vLLM-CPU samples when verifying (with workflows/vllm_cpu_shim/vllm_cpu_standins/sampling.py in place of its
    # broken spreading of the sampling parameters) and says so; its figure is set in the range a
    # second estimate of the reference's size falls in 95% of the time (tests/test_vllm_sampling.py
    # holds it there on the memorised draft; docs/serving.md, "Sampling").
    hot_vllm = served["vllm"]["sampled"]
    assert (
        hot_vllm["verify"] == "sampling"
        and hot_vllm["predicted"] == report["at_temperature"]["decoded"]["vllm"]["value"]
    )
    # vLLM's counters by draft position, in the report's P(accepted | reached), in report.md too.
    per_position = served["vllm"]["per_position_acceptance"]
    assert per_position == pytest.approx(served_per_position(served["vllm"]["counters"]), nan_ok=True)
    assert len(per_position) == 3
    assert f"| served by {served['vllm']['engine']} |" in (tmp_path / "run" / "report" / "report.md").read_text()
    half = 1.96 * 2**0.5 * report["at_temperature"]["decoded"]["vllm"]["standard_error"]
    assert hot_vllm["range95"] == pytest.approx([hot_vllm["predicted"] - half, hot_vllm["predicted"] + half])
    hot = report["at_temperature"]
    assert hot["temperature"] == 0.8 and len(hot["per_step_acceptance_rate_offline"]) == 3
    assert hot["decoded"]["tokens_per_pass"]["standard_error"] > 0
    # The offline expectation scores the draft on the greedy answers it was trained on; sampled
    # text strays from them, so decoding accepts somewhat less (the tiny test target, 32 seeds:
    # 1.142 offline, 1.088 +- 0.008 decoded). Within 12% of each other.
    decoded = hot["decoded"]["tokens_per_pass"]
    assert abs(hot["acceptance_offline_expected"] / decoded["value"] - 1) < 0.12, hot
    assert "| served by sglang 0.5.23 (cpu, float32)" in (tmp_path / "run" / "report" / "report.md").read_text()
    rows = [json.loads(line) for line in (tmp_path / "run" / "report" / "prompts.jsonl").read_text().splitlines()]
    assert [len(r["input_ids"]) for r in rows] == [p["prompt_tokens"] for p in report["per_prompt_decoded"]]

    # Retrain without exporting again: the old export belongs to another draft, so the
    # report scores the new trained draft, never the stale export.
    retrained = tiny_cfg(
        tiny_target,
        tmp_path / "run",
        "train.steps=8",
        "evaluate.max_prompts=4",
        "evaluate.max_new_tokens=20",
        "evaluate.num_steps=3",
        "train.acceptance_k=3",
        "train.backend=local",
        "stages=[train,evaluate]",
        "evaluate.served=auto",
        "train.resume=false",
    )  # another step budget: a fresh run, not a resume
    full.run(retrained)
    report = json.loads((tmp_path / "run" / "report" / "report.json").read_text())
    assert report["draft"] == str(tmp_path / "run" / "train" / "draft" / "draft.safetensors")
    # ... and serves nothing: the exports belong to the old draft.
    assert {e: c.get("skipped", "") for e, c in report["served"].items()} == {
        e: f"no {e} export of this draft (run the export stage: stages=[export,evaluate])" for e in ("sglang", "vllm")
    }


def test_markdown_lists_served_benchmark():
    from workflows.evaluate import markdown

    r = {
        "draft": "d",
        "target": "t",
        "prompts": 2,
        "max_new_tokens": 8,
        "num_steps": 3,
        "topk": 1,
        "acceptance_offline": 1.5,
        "acceptance_offline_per_position_average": 1.7,
        "acceptance_decoded": 1.5,
        "acceptance_decoded_sglang_definition": 1.7,
        "dtype": "float32",
        "serve_args": ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3"],
        "parity_ratio": 1.0,
        "lossless": True,
        "text_agreement": 1.0,
        "tokens_per_s_plain": 10.0,
        "tokens_per_s_decoded": 12.0,
        "speedup_decoded": 1.2,
        "per_position_acceptance_offline": [0.5, 0.4, 0.3],
        "per_position_acceptance": [0.5, 0.4, 0.3],
        "served_benchmark": {"api": "generate", "results": {"1": {"tokens_per_s_mean": 42.0, "accept_length": 2.5}}},
    }
    md = markdown(r, ["speed.png"])
    assert "| parity ratio offline / decoded | 1.000 |" in md
    assert "| served (generate), concurrency 1: tokens/s, accept length | 42.0, 2.5 |" in md
    assert "![speed.png](speed.png)" in md
    assert "| acceptance decoded, SGLang's definition" in md and "| 1.700 |" in md
    assert "serving with `--speculative-algorithm EAGLE3 --speculative-num-steps 3`" in md


def test_a_divergence_at_a_near_tie_is_told_apart_from_a_defect():
    """bf16: a token's head row duplicates the greedy token's at position 2, so the target's
    top-2 margin there is exactly 0 (a numerical tie); the widest other margin is no tie."""
    from eagle3.spec_decode import greedy_decode
    from workflows.evaluate import divergence
    from workflows.full import why_not_lossless

    target = tiny_hf_llama(num_layers=2, hidden=24, vocab=97, dtype=torch.bfloat16, seed=3)
    prompt = [5, 17, 33, 2]
    plain, _ = greedy_decode(target, prompt, 6)
    twin = next(t for t in range(plain[2] + 1, 97) if t not in plain)  # above it: ties go to the lower id
    with torch.no_grad():
        target.lm_head.weight[twin] = target.lm_head.weight[plain[2]]
    margins = []
    assert greedy_decode(target, prompt, 6, margins=margins)[0] == plain and margins[2][1] == 0.0
    tie = divergence("p", plain[:2] + [twin] + plain[3:], plain, margins, torch.bfloat16)
    assert tie == {
        **tie,
        "position": 2,
        "decoded": twin,
        "greedy": plain[2],
        "top2_margin": 0.0,
        "kind": "numerical tie",
    }
    assert tie["resolution"] == pytest.approx(4 * 2**-7 * max(1.0, abs(margins[2][0])))
    wide = max((i for i in range(6) if i != 2), key=lambda i: margins[i][1] / max(1.0, abs(margins[i][0])))
    assert margins[wide][1] > 4 * 2**-7 * max(1.0, abs(margins[wide][0]))  # a clear choice ...
    flipped = plain[:wide] + [(plain[wide] + 1) % 97] + plain[wide + 1 :]
    defect = divergence("q", flipped, plain, margins, torch.bfloat16)
    assert (defect["position"], defect["kind"]) == (wide, "defect")  # ... flipped: not rounding
    # In fp32 the same margin of 0 is still a tie, a wide one still a defect; the report says which.
    assert divergence("p", plain[:2] + [twin], plain[:3], margins, torch.float32)["kind"] == "numerical tie"
    assert why_not_lossless([tie, defect]) == (
        " (1 of 2 divergent prompts numerical ties in bfloat16, 1 defects: see the report)"
    )
    assert why_not_lossless([]) == ""


def test_acceptance_at_temperature_maths():
    """The expected chain length against its definition by enumeration, the per-step
    acceptance rates at a temperature near 0 against the step accuracies, and the pooled
    ratio's standard error against the formula written out."""
    import itertools

    from eagle3.metrics import expected_acceptance_length, ratio_interval
    from eagle3.training import acceptance_rates_at, forward_batch

    rates = [0.9, 0.5, 0.25]
    # Enumerate every accept/reject pattern: tokens = 1 + leading accepted drafts.
    total = 0.0
    for pattern in itertools.product([True, False], repeat=3):
        prob = 1.0
        for a, ok in zip(rates, pattern):
            prob *= a if ok else 1 - a
        lead = next((i for i, ok in enumerate(pattern) if not ok), 3)
        total += prob * (1 + lead)
    assert expected_acceptance_length(rates) == pytest.approx(total)
    assert expected_acceptance_length([1.0] * 4) == 5.0 and expected_acceptance_length([0.0, 1.0]) == 1.0

    torch.manual_seed(0)
    target = tiny_hf_llama(num_layers=6, hidden=24, vocab=97, dtype=torch.float64)
    seqs, masks = greedy_texts(target, 4, prompt_len=6, new_tokens=12, seed=2)
    batch = capture_batch(target, seqs, masks, LAYERS)
    draft = make_draft(target, batch, draft_vocab=64).double().eval()
    head = TargetHead(target.lm_head.weight)
    sums, counts = acceptance_rates_at(draft, head, batch, 3, temperature=1e-4)
    scores = forward_batch(draft, head, batch, TTTConfig(length=3), train=False)
    assert (sums / counts).tolist() == pytest.approx(scores.step_acc, abs=1e-6)
    hot, _ = acceptance_rates_at(draft, head, batch, 3, temperature=1e4)  # the target nearly uniform
    assert (hot / counts).tolist() == pytest.approx([1 / 97] * 3, rel=1e-3)

    pairs = [(10, 8), (12, 9), (7, 7), (15, 10)]
    ratio, se = ratio_interval(pairs)
    assert ratio == 44 / 34
    residuals = [y - ratio * x for y, x in pairs]
    assert se == pytest.approx((sum(e * e for e in residuals) / 3 / 4) ** 0.5 / (34 / 4))


def test_acceptance_by_dataset_and_kind_sums_tokens_over_passes_within_each_group():
    from workflows.evaluate.report import by_group, markdown, prompt_kind

    names = ["glaive", "chat", "glaive", "chat", "chat"]
    offline = [(6, 3), (2, 2), (4, 1), (3, 3), (0, 0)]
    decoded = [(5, 3), (2, 2), (3, 1), (4, 3), (1, 1)]
    got = by_group(names, offline, decoded)
    # The ratio of sums, not the mean of ratios: a long answer weighs what its passes weigh.
    assert got == {
        "chat": {"prompts": 3, "offline": 5 / 5, "decoded": 7 / 6},
        "glaive": {"prompts": 2, "offline": 10 / 4, "decoded": 8 / 4},
    }
    assert prompt_kind([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]) == "chat"
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    assert prompt_kind([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}]) == "tools"
    assert prompt_kind([{"role": "tool", "content": "42"}]) == "tools"
    lines = [line for line in markdown_rows(markdown, got) if line.startswith("| glaive")]
    assert lines == ["| glaive | 2 | 2.500 | 2.000 |"]


def markdown_rows(markdown, groups: dict) -> list[str]:
    """The report's markdown for a minimal report holding `groups` as its dataset column."""
    report = {
        "draft": "d",
        "target": "t",
        "prompts": 5,
        "max_new_tokens": 8,
        "num_steps": 3,
        "topk": 1,
        "acceptance_offline": 1.5,
        "acceptance_offline_per_position_average": 1.6,
        "acceptance_decoded": 1.5,
        "acceptance_decoded_sglang_definition": 1.6,
        "parity_ratio": 1.0,
        "lossless": True,
        "text_agreement": 1.0,
        "tokens_per_s_plain": 1.0,
        "tokens_per_s_decoded": 1.0,
        "speedup_decoded": 1.0,
        "per_position_acceptance_offline": [0.5],
        "per_position_acceptance": [0.5],
        "serve_args": [],
        "dtype": "float32",
        "acceptance_by_dataset": groups,
    }
    return markdown(report, []).splitlines()


@pytest.mark.slow
def test_a_block_draft_goes_through_the_pipeline_and_vllm_serves_it_as_predicted(tmp_path, tiny_target, monkeypatch):
    """`workflows.full draft=dflash` on the tiny target: the block draft trained from the
    store, exported for vLLM, evaluated (offline walk of blocks, reference decoder) and served
    by vLLM on the held-out prompts, its figure the prediction and its outputs greedy's;
    SGLang, which has no CPU path for DFLASH, is skipped with the reason."""
    from tests.test_workflows import tiny_cfg
    from workflows import full

    cfg = tiny_cfg(
        tiny_target,
        tmp_path / "run",
        "draft=dflash",
        "draft.dflash.num_layers=2",
        "data.limit=64",  # the 48 train conversations a block draft needs to read the states (not memorise)
        "train.steps=240",
        "train.optim.lr=1e-2",
        "evaluate.max_prompts=6",
        "evaluate.max_new_tokens=20",
        "evaluate.num_steps=4",
        "train.acceptance_k=4",
        "train.backend=local",
        "evaluate.served=auto",
        "evaluate.temperature=0.8",
        "evaluate.seeds=[0,1]",
        "evaluate.device=cpu",
        "evaluate.served_speed=true",
    )
    logs = []
    monkeypatch.setattr(full, "log", logs.append)
    full.run(cfg)
    run = tmp_path / "run"
    report = json.loads((run / "report" / "report.json").read_text())
    assert report["draft_family"] == "dflash" and report["serve_engine"] == "vllm"
    assert report["draft"] == str(run / "export" / "vllm" / "model.safetensors")  # scored as served
    assert not (run / "export" / "sglang").exists()
    assert report["lossless"] and 0.97 <= report["parity_ratio"] <= 1.03, report
    assert report["acceptance_decoded"] > 1.05  # the draft reads the target's states: something is accepted
    assert len(report["per_position_acceptance"]) == 4 and report["num_draft_tokens"] == 5
    assert "GPU attention backends" in report["served"]["sglang"]["skipped"]
    check = report["served"]["vllm"]
    assert check["identical_to_greedy"] == check["prompts"] == report["prompts"], check
    assert check["matches_prediction"] and check["predicted"] == report["acceptance_decoded_vllm_definition"]
    # Exactly the reference decoder's passes and accepted tokens (a two-layer draft: vLLM-CPU
    # reads its second layer's context through the first layer's k_norm unless stood in for,
    # workflows/vllm_cpu_shim; served 1.075 against 1.086 without the stand-in).
    rows = report["per_prompt_decoded"]
    assert check["counters"]["num_drafts"] == sum(r["passes"] for r in rows), check
    assert check["counters"]["num_accepted_tokens"] == sum(r["accepted_uncut"] for r in rows), check
    assert check["counters"]["num_draft_tokens"] == 4 * check["counters"]["num_drafts"]
    # At the serving temperature: the block draft's per-slot rates offline, and vLLM sampling
    # when it verifies, its figure in the reference decoder's 95% range.
    hot = report["at_temperature"]
    assert len(hot["per_step_acceptance_rate_offline"]) == 4
    assert check["sampled"]["verify"] == "sampling" and check["sampled"]["within"], check["sampled"]
    # The engine's own speed with and without the draft, on the same prompts: plain decoding's
    # answers are greedy's, and the speed-up is the ratio of the two figures.
    plain = check["without_draft"]
    assert plain["identical_to_greedy"] == check["prompts"], plain
    assert plain["speedup"] == pytest.approx(check["tokens_per_s"] / plain["tokens_per_s"])
    assert f"x{plain['speedup']:.2f}" in logs[-3]
    markdown = (run / "report" / "report.md").read_text()
    assert f"| {check['tokens_per_s']:.1f} / {plain['tokens_per_s']:.1f} / {plain['speedup']:.2f} |" in markdown
    assert f"served by {check['engine']} {check['accept_length']:.3f} vs predicted" in logs[-3]
    assert logs[-2] == f"draft: {run / 'export' / 'vllm'}"


@pytest.mark.slow
def test_a_dspark_draft_goes_through_the_pipeline_and_vllm_serves_it_as_predicted(tmp_path, tiny_target):
    """`workflows.full draft=dspark` on the tiny target: the DSpark draft (Markov and confidence
    heads) trained from the store, exported in vLLM's Qwen3DSparkModel layout, decoded by the
    reference decoder token by token with the Markov bias, and served by vLLM (its V2 runner,
    the only one with DSpark) on the held-out prompts: its figure the prediction, its outputs
    greedy's, its passes and accepted tokens the reference decoder's (a mis-wired DSpark export
    served: tests/test_served.py)."""
    from tests.test_workflows import tiny_cfg
    from workflows import full

    run = tmp_path / "run"
    cfg = tiny_cfg(
        tiny_target,
        run,
        "draft=dspark",
        "draft.dspark.num_layers=1",
        "draft.dspark.block_size=4",
        "draft.dspark.markov_rank=32",
        "data.limit=64",
        "train.steps=200",
        "train.optim.lr=1e-2",
        "evaluate.max_prompts=4",
        "evaluate.max_new_tokens=16",
        "evaluate.num_steps=4",
        "train.acceptance_k=4",
        "train.backend=local",
        "evaluate.served=vllm",
        "evaluate.device=cpu",
    )
    full.run(cfg)
    report = json.loads((run / "report" / "report.json").read_text())
    assert report["draft_family"] == "dspark" and report["serve_engine"] == "vllm"
    assert report["lossless"] and 0.97 <= report["parity_ratio"] <= 1.03, report
    assert report["acceptance_decoded"] > 1.2, report  # the draft reads the target's states
    assert report["verified_per_pass"] == 4  # no adaptive cut by default: the whole block is verified
    # Its own head over a draft vocabulary: no SGLang DSPARK folder (tests/test_dspark_sglang.py)
    assert json.loads((run / "export" / "DONE.json").read_text())["summary"]["formats"] == ["vllm"]
    assert not (run / "export" / "sglang").exists()
    check = report["served"]["vllm"]
    assert check["identical_to_greedy"] == check["prompts"] == report["prompts"], check
    assert check["matches_prediction"] and check["predicted"] == report["acceptance_decoded_vllm_definition"]
    rows = report["per_prompt_decoded"]
    assert check["counters"]["num_drafts"] == sum(r["passes"] for r in rows), check
    assert check["counters"]["num_accepted_tokens"] == sum(r["accepted_uncut"] for r in rows), check
