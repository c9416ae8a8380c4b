"""What SGLang will really do with the drafting arguments; the launch command; benchmark."""

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers import free_port
from workflows.tools.serve import ServeArgsError, launch_command, resolve_spec_args

ROOT = Path(__file__).resolve().parents[1]


def test_topk1_caps_num_draft_tokens_loudly():
    e = resolve_spec_args(1, 1, 16, "DeepseekV3ForCausalLM")
    assert (e.num_steps, e.topk, e.num_draft_tokens) == (1, 1, 2)
    assert "replaces num_draft_tokens=16 by num_steps+1=2" in e.warnings[0]
    assert resolve_spec_args(3, 1, 4, "LlamaForCausalLM").warnings == []


def test_partial_arguments_are_refused():
    for args in [(None, 4, None), (None, None, 8), (3, None, None), (3, 2, None)]:
        with pytest.raises(ServeArgsError, match="set all of num_steps, topk, num_draft_tokens or none"):
            resolve_spec_args(*args, "LlamaForCausalLM")


def test_defaults_per_architecture_are_stated():
    e = resolve_spec_args(None, None, None, "LlamaForCausalLM")
    assert (e.num_steps, e.topk, e.num_draft_tokens) == (5, 4, 8) and "SGLang picks" in e.warnings[0]
    e = resolve_spec_args(None, None, None, "DeepseekV3ForCausalLM")
    assert (e.num_steps, e.topk, e.num_draft_tokens) == (3, 1, 4)
    assert (resolve_spec_args(None, None, None, "KimiK25ForConditionalGeneration").num_draft_tokens) == 4


def test_tree_bound():
    assert resolve_spec_args(2, 2, 7, "LlamaForCausalLM").warnings == []  # 6 nodes = 2 + 1*4
    e = resolve_spec_args(2, 2, 8, "LlamaForCausalLM")
    assert "exceeds topk + (num_steps-1)*topk^2 = 6" in e.warnings[0] and e.num_draft_tokens == 8


def test_launch_command_and_env():
    e = resolve_spec_args(3, 1, 4, "LlamaForCausalLM")
    argv, env = launch_command("/m/target", "/m/draft", e, tp_size=8, env={"NCCL_CUMEM_ENABLE": "0"})
    s = " ".join(argv)
    assert "-m sglang.launch_server --model-path /m/target --host 127.0.0.1" in s
    assert "--tp-size 8 --speculative-algorithm EAGLE3 --speculative-draft-model-path /m/draft" in s
    assert "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in s
    assert env == {"NCCL_CUMEM_ENABLE": "0"}
    # SGLang's own parser accepts every flag we emit.
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(argv[3:])
    assert args.speculative_algorithm == "EAGLE3" and args.speculative_num_draft_tokens == 4
    assert args.tp_size == 8 and args.host == "127.0.0.1"


@pytest.mark.slow
def test_benchmark_reads_the_accept_length_of_a_served_draft(memorised, tiny_target):
    """`serve.cpu=true`'s command serves the draft with SGLang's EAGLE-3 on the CPU, and the
    benchmark, sent the same prompts (token ids, as the report's prompts.jsonl), reads the
    reference decoder's SGLang-definition figure from the server's replies."""
    from workflows.tools.benchmark import run_benchmark, wait_healthy

    port = free_port()
    argv, env = launch_command(
        str(tiny_target),
        str(memorised["sglang"]),
        resolve_spec_args(3, 1, 4, "LlamaForCausalLM"),
        port=port,
        cpu=True,
        extra_args=["--log-level", "warning", "--skip-server-warmup"],
    )
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and "--mem-fraction-static 0.2" in " ".join(argv)
    proc = subprocess.Popen(
        argv, env={**os.environ, **env}, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout_s=300, proc=proc)
        rows = [
            {"input_ids": p, "max_new_tokens": n} for p, n in zip(memorised["prompts"], memorised["max_new_tokens"])
        ]
        one = run_benchmark(url, rows, max_new_tokens=2048, warmup=0, runs=8, concurrency=[1])["results"]["1"]
        assert one["completion_tokens"] == sum(memorised["max_new_tokens"])  # each row's own budget
        assert one["accept_length"] == pytest.approx(memorised["chain"]["acceptance_sglang"], rel=0.02)
        by_openai = run_benchmark(
            url, rows, max_new_tokens=2048, warmup=0, runs=2, concurrency=[1], api="openai", model=str(tiny_target)
        )["results"]["1"]  # one row per run: rows 0 and 1
        assert by_openai["completion_tokens"] == sum(memorised["max_new_tokens"][:2])  # the rows' budgets there too
        prompts = ["The quick brown fox", "Once upon a time", "In the beginning"]
        for api in ("generate", "openai"):
            res = run_benchmark(
                url,
                prompts,
                max_new_tokens=12,
                warmup=1,
                runs=2,
                concurrency=[1, 3],
                api=api,
                model=str(tiny_target),
                ignore_eos=True,
            )
            single, many = res["results"]["1"], res["results"]["3"]
            assert single["runs"] == 2 and single["completion_tokens"] == 2 * 12
            assert many["completion_tokens"] == 2 * 3 * 12
            # Only /generate reports verify passes (the server drafts: it has passes to report).
            assert (single["accept_length"] is None) == (api == "openai")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_serve_defaults_to_what_the_report_evaluated(tmp_path):
    import json

    from workflows.core.config import compose
    from workflows.core.layout import RunLayout
    from workflows.tools.serve import drafting_to_serve

    def drafting(cfg):
        return drafting_to_serve(cfg.serve, cfg.evaluate, RunLayout.of(cfg).report_file)

    cfg = compose(["target=tiny", f"run_dir={tmp_path}", "evaluate.num_steps=3"])
    assert drafting(cfg) == (3, 1, 4)  # no report yet: the evaluate config, a chain
    (tmp_path / "report").mkdir()
    report = {
        "acceptance_offline": 1.5,
        "acceptance_decoded": 1.5,
        "acceptance_decoded_sglang_definition": 1.6,
        "parity_ratio": 1.0,
        "lossless": True,
        "speedup_decoded": 1.0,
        "dtype": "float32",
        "serve_args": [],
        **{"num_steps": 5, "topk": 1, "num_draft_tokens": 6},
    }
    (tmp_path / "report" / "report.json").write_text(json.dumps(report))
    assert drafting(cfg) == (5, 1, 6)
    explicit = compose(
        ["target=tiny", f"run_dir={tmp_path}", "serve.num_steps=2", "serve.topk=4", "serve.num_draft_tokens=8"]
    )
    assert drafting(explicit) == (2, 4, 8)
    # Never SGLang's own per-architecture pick (a (5, 4, 8) tree for Llama) unless asked for.
    assert resolve_spec_args(*drafting(cfg), "LlamaForCausalLM").topk == 1
