"""The evaluate stage's served check: the exported draft served by the real engines
(workflows.core.serving) with the report's drafting, dtype and prompts."""

from __future__ import annotations

from pathlib import Path

from eagle3.families import family_named
from eagle3.metrics import ratio_interval
from workflows.core.config import FullConfig
from workflows.core.errors import MissingArtefact, ServingError
from workflows.core.layout import RunLayout
from workflows.core.log import log
from workflows.core.markers import read_marker
from workflows.core.serving import ENGINES, ServeJob, available_engines, served_check, verdict, vllm_target_args
from workflows.evaluate.report import served_per_position

# Why an engine does not serve a family here, where the engine has that method.
NOT_SERVED = {
    ("dflash", "sglang"): (
        "SGLang 0.5.23's DFLASH drafts only with GPU attention backends (flashinfer, fa3, fa4, triton, ...) and "
        "reads CUDA memory figures in its worker; the project exports DFlash drafts for vLLM, which serves them on "
        "CPU and GPU"
    ),
    ("dspark", "sglang"): (
        "SGLang 0.5.23 serves DSPARK on CUDA, NPU or XPU only (its server refuses a CPU, and its drafting "
        "kernels are Triton); the project serves DSpark drafts by vLLM, and writes SGLang's layout for a draft "
        "with the target's head (draft.dspark.head=target over the whole vocabulary), held to SGLang's own loader"
    ),
}


def serve_job(
    cfg: FullConfig, engine: str, draft: Path, report: dict, rows: list[dict], eos: list[int], dtype: str, device: str
) -> ServeJob:
    """`engine` serving the export at `draft` with the report's drafting on the held-out
    `rows`' prompts and budgets, as the evaluate stage's settings ask."""
    e = cfg.evaluate
    return ServeJob(
        engine=engine,
        target_path=str(report["target"]),
        draft_path=str(draft),
        method=family_named(cfg.draft.family).served_methods[engine],
        num_steps=report["num_steps"],
        topk=report["topk"],
        num_draft_tokens=report["num_draft_tokens"],
        prompts=[r["input_ids"][: r["loss_mask"].index(1)] for r in rows],
        max_new_tokens=[len(r["loss_mask"]) - r["loss_mask"].index(1) for r in rows],
        eos=eos,
        dtype=dtype,
        device=device,
        tp_size=cfg.target.tp_size,
        seed=cfg.seed,
        trust_remote_code=cfg.target.trust_remote_code,
        timeout_s=e.served_timeout_s,
        sampled_temperature=e.temperature,
        sampled_seeds=list(e.seeds) if e.temperature > 0 else [],
        baseline=e.served_speed,
        **(vllm_target_args(report["target"], device) if engine == "vllm" else {}),
    )


def served_checks(
    cfg: FullConfig,
    layout: RunLayout,
    target_path: Path,
    rows: list[dict],
    greedy: list[list[int]],
    report: dict,
    dtype: str,
    eos: list[int],
    device: str,
) -> dict:
    """The exported draft served by each engine of `evaluate.served` with the report's
    drafting and dtype, on the prompts just decoded, beside the prediction in that engine's
    definition (workflows.core.serving). An engine named explicitly must serve; under
    `auto` one that is missing or fails is recorded in the report and the log."""
    e = cfg.evaluate
    if e.served == "none":
        return {}
    required = e.served != "auto"
    export = (read_marker(layout.stage_dir("export")) or {}).get("summary", {})
    folders = {"sglang": layout.sglang_export, "vllm": layout.vllm_export}
    predicted = {
        "sglang": ("acceptance_decoded_sglang_definition", report["acceptance_decoded_sglang_definition"]),
        "vllm": ("acceptance_decoded_vllm_definition", report["acceptance_decoded_vllm_definition"]),
    }
    if e.topk > 1 and "sglang_draft_attention" in report:  # SGLang drafts trees with its own attention
        predicted["sglang"] = (
            "sglang_draft_attention.acceptance_decoded_sglang_definition",
            report["sglang_draft_attention"]["acceptance_decoded_sglang_definition"],
        )
    # The standard error of each prediction over the prompts (the served check's range where
    # half-precision near-ties send answers off greedy decoding); none for the tree's SGLang
    # prediction, whose per-prompt counts the report does not keep.
    rows_decoded = report["per_prompt_decoded"]
    spread = {
        "sglang": ratio_interval([(r["tokens"], r["passes"]) for r in rows_decoded])[1],
        "vllm": ratio_interval([(r["accepted_uncut"] + r["passes"], r["passes"]) for r in rows_decoded])[1],
    }
    if predicted["sglang"][0] != "acceptance_decoded_sglang_definition":
        spread["sglang"] = None
    family = family_named(cfg.draft.family)
    have, checks = available_engines(e.vllm_python, device), {}
    for engine in ENGINES if e.served == "auto" else (e.served,):
        if engine not in family.served_methods:
            why = NOT_SERVED.get(
                (family.name, engine), f"the project does not export {family.name} drafts for {engine}"
            )
        elif engine not in have:
            why = (
                "vLLM is not installed (make setup makes .venv-vllm; or set evaluate.vllm_python)"
                if engine == "vllm"
                else "SGLang is not installed (pip install -e .[sglang])"
            )
        elif export.get("train_key") != layout.done_key("train") or engine not in export.get("formats", []):
            why = f"no {engine} export of this draft (run the export stage: stages=[export,evaluate])"
        elif engine == "vllm" and e.topk > 1:  # served=auto only: naming vllm is refused by the config
            why = f"vLLM drafts chains only; evaluate.topk={e.topk}"
        else:
            why = None
        if why is not None:
            if required:
                raise MissingArtefact(f"evaluate.served={engine}: {why}")
            log(f"evaluate: not served by {engine}: {why}")
            checks[engine] = {"skipped": why}
            continue
        job = serve_job(cfg, engine, Path(folders[engine]), report, rows, eos, dtype, device)
        sampled = report.get("at_temperature", {}).get("decoded", {}).get(engine)
        try:
            checks[engine] = served_check(
                job,
                greedy,
                predicted[engine][1],
                predicted[engine][0],
                e.served_tolerance,
                e.vllm_python,
                log=log,
                sampled_prediction=sampled,
                spread=spread[engine],
            )
            # By draft position, in the report's measure, where the engine's counters give it (vLLM).
            per_position = served_per_position(checks[engine]["counters"])
            if per_position is not None:
                checks[engine]["per_position_acceptance"] = per_position
        except ServingError as exc:
            if required:
                raise
            checks[engine] = {"engine_name": engine, "error": str(exc)}
        log(f"evaluate: served by {verdict({'engine_name': engine, **checks[engine]})}")
    return checks
