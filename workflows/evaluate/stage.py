"""The evaluate stage itself: held-out answers, the draft as exported, the dtype, the run.
See the package's docstring."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from eagle3.families import build_model, family_of
from eagle3.metrics import assistant_spans
from eagle3.schema import output_dict
from eagle3.target_head import TargetHead
from eagle3.target_spec import TargetSpec
from workflows.core import draft_files
from workflows.core.config import FullConfig
from workflows.core.draft_files import load_draft_config, load_draft_weights
from workflows.core.engine_spec import EngineSpec
from workflows.core.engines import HFEngine
from workflows.core.errors import InputError
from workflows.core.layout import RunLayout
from workflows.core.log import log
from workflows.core.markers import atomic_dir, clear_done, read_json, read_marker, run_stage, write_json_atomic
from workflows.core.provenance import target_identity
from workflows.core.records import ReportHeadline
from workflows.core.serving import vllm_speculative_args
from workflows.core.sglang import speculative_args
from workflows.evaluate.decoding import at_temperature, decode_all, offline_acceptance
from workflows.evaluate.report import by_bucket, by_group, markdown, plot, prompt_kind
from workflows.evaluate.served import served_checks


def heldout_rows(layout: RunLayout, limit: int, max_new_tokens: int) -> list[dict]:
    """Held-out conversations cut to their first answer's first `max_new_tokens` tokens."""
    rows = sorted((r for r in layout.read_corpus() if r["split"] == "heldout"), key=lambda r: r["id"])
    if not rows:
        raise InputError(f"{layout.corpus_shards}: the corpus has no held-out sample (raise data.heldout_fraction)")
    out = []
    for r in rows:
        spans = assistant_spans(torch.tensor(r["loss_mask"]))
        if not spans or spans[0][0] < 1 or spans[0][1] - spans[0][0] < 2:
            continue  # no answer to decode after a prompt
        s, e = spans[0][0], min(spans[0][1], spans[0][0] + max_new_tokens)
        out.append(
            {
                "id": r["id"],
                "input_ids": r["input_ids"][:e],
                "loss_mask": [0] * s + [1] * (e - s),
                "dataset": r.get("dataset", ""),
                "kind": prompt_kind(r.get("messages") or []),
            }
        )
        if len(out) == limit:
            break
    return out


def load_draft_for_eval(layout: RunLayout, model, dtype: torch.dtype) -> tuple[torch.nn.Module, str]:
    """The draft this run's train stage produced: its export (the weights as served) when
    the export stage made it from that very draft, else the trained weights."""
    folder = layout.require_draft()
    draft = build_model(load_draft_config(folder))
    draft.load_target_embeddings(model.get_input_embeddings().weight.float())
    load_draft_weights(folder, draft)
    export = read_marker(layout.stage_dir("export")) or {}
    # The export that holds the draft's own tensors: SGLang's for EAGLE-3, vLLM's for DFlash.
    served = layout.export_dir(family_of(draft).weights_export)
    source = folder / draft_files.WEIGHTS
    if export.get("summary", {}).get("train_key") == layout.done_key("train"):
        source = draft_files.load_served_weights(served, draft)
    elif export:
        log(f"evaluate: {served} was exported from an older draft; scoring {source} instead")
    return draft.to(model.device, dtype).eval(), str(source)


def ablation_file(layout: RunLayout) -> Path:
    """The table `python -m bench.bench_quality` writes into the run folder (may not exist)."""
    return layout.root / "ablation" / "ablation.md"


def ablation_mtime(layout: RunLayout) -> int | None:
    path = ablation_file(layout)
    return path.stat().st_mtime_ns if path.exists() else None


DTYPE_GAP = 0.02  # the offline walk in the serving dtype and in fp32 may differ this much silently


def offline_in_fp32(
    target: TargetSpec, layout: RunLayout, target_path: Path, ids, rows, k: int, walk: float, device: str
) -> dict:
    engine = HFEngine(
        EngineSpec(
            str(target_path),
            dtype="float32",
            capture_ids=ids,
            device=device,
            trust_remote_code=target.trust_remote_code,
        )
    )
    draft, _ = load_draft_for_eval(layout, engine.model, torch.float32)
    groups = [rows[i : i + 4] for i in range(0, len(rows), 4)]
    fp32, _ = offline_acceptance(
        draft, TargetHead.from_hf(engine.model), groups, engine.training_batches(groups, "capture held-out (fp32)"), k
    )
    gap = abs(walk - fp32.walk) / fp32.walk
    if gap > DTYPE_GAP:
        log(
            f"evaluate: WARNING the offline walk is {walk:.3f} in {target.dtype} but {fp32.walk:.3f} in float32 "
            f"({gap:.1%} apart, above {DTYPE_GAP:.0%})"
        )
    return {"acceptance_offline_float32": fp32.walk, "dtype_gap": gap, "dtype_gap_flagged": gap > DTYPE_GAP}


def evaluation_device(setting: str) -> str:
    """evaluate.device settled: auto is CUDA where torch sees a GPU."""
    if setting != "auto":
        return setting
    return "cuda" if torch.cuda.is_available() else "cpu"


def evaluation_dtype(requested: str, serving: str, device: str = "cpu") -> tuple[str, str]:
    """(dtype the evaluation runs in, why): `requested` (evaluate.dtype), or for auto the
    serving dtype (target.dtype) on a GPU, and on a CPU where it computes it fast
    (workflows.core.precision), else float32."""
    from workflows.core.precision import cpu_choice

    if requested != "auto":
        return requested, f"evaluate.dtype={requested}" + (f" (serving: {serving})" if requested != serving else "")
    if serving == "float32":
        return "float32", "the serving dtype"
    if device.startswith("cuda"):
        return serving, "the serving dtype, on the GPU"
    fast, why = cpu_choice()
    if fast == serving:
        return serving, f"the serving dtype ({why})"
    return "float32", (
        f"not the serving dtype {serving}: it runs slowly on this CPU ({why}); set evaluate.dtype={serving} to force it"
    )


def timed_out(report_file: Path) -> list[tuple[str, float]]:
    """(engine, its limit in s) for each served check of a written report that ran out of time
    (workflows.core.serving.serve_prompts: "... did not finish within <limit> s ...")."""
    if not report_file.exists():
        return []
    found = []
    for name, check in read_json(report_file).get("served", {}).items():
        if m := re.search(r"did not finish within (\S+) s", check.get("error", "")):
            found.append((name, float(m.group(1))))
    return found


def run(cfg: FullConfig, target_path: Path) -> Path:
    e = cfg.evaluate
    layout = RunLayout.of(cfg)
    out = layout.stage_dir("evaluate")
    served = layout.benchmark_file  # python -m workflows.tools.benchmark --out ...
    key = {
        "evaluate": output_dict(e),  # a NOT_OUTPUT setting (served_timeout_s) reuses the finished report
        "target": target_identity(target_path, cfg.cache_path),
        **layout.chain("train"),
        "export": layout.done_key("export"),
        "served": served.stat().st_mtime_ns if served.exists() else None,
        "ablation": ablation_mtime(layout),
    }
    # served_timeout_s is NOT_OUTPUT, but a report whose engine ran out of a shorter limit than
    # the one now set is evaluated again (under served=auto a timeout is recorded, not raised).
    late = [(n, t) for n, t in timed_out(layout.report_file) if t < e.served_timeout_s]
    if late:
        ran_out = ", ".join(f"{n} ran out of {t:g} s" for n, t in late)
        log(f"evaluate: {ran_out} in the finished report, the limit is now {e.served_timeout_s:g} s: evaluating again")
        clear_done(out)
    return run_stage("evaluate", out, key, lambda: evaluate_into(cfg, layout, target_path, out))


def evaluate_into(cfg: FullConfig, layout: RunLayout, target_path: Path, out: Path) -> dict:
    """Decode the held-out prompts, score them offline and served, write the report into
    `out`; returns the marker's summary."""
    e = cfg.evaluate
    served = layout.benchmark_file
    torch.manual_seed(cfg.seed)
    device = evaluation_device(e.device)
    dtype_name, dtype_why = evaluation_dtype(cfg.evaluate.dtype, cfg.target.dtype, device)
    log(f"evaluate: computing in {dtype_name} on {device}: {dtype_why}")
    dtype = getattr(torch, dtype_name)
    ids = load_draft_config(layout.require_draft()).capture_layer_ids
    engine = HFEngine(
        EngineSpec(
            str(target_path),
            dtype=dtype_name,
            capture_ids=ids,
            device=device,
            trust_remote_code=cfg.target.trust_remote_code,
        )
    )
    model = engine.model
    cfg.target.check_against_hf_config(model.config)
    draft, source = load_draft_for_eval(layout, model, dtype)
    family = family_of(draft)
    rows = heldout_rows(layout, e.max_prompts, e.max_new_tokens)
    groups = [rows[i : i + 4] for i in range(0, len(rows), 4)]
    batches = engine.training_batches(groups, "capture held-out")
    head = TargetHead.from_hf(model)
    k = e.num_steps
    offline, offline_rows = offline_acceptance(draft, head, groups, batches, k)
    eos = sorted(engine.eos)  # the tokenizer's and generation_config's, where the serving engines stop too
    log(f"evaluate: decoding {len(rows)} held-out prompts, k={k}, topk={e.topk}")
    dec = decode_all(model, draft, rows, ids, k, e.topk, e.num_draft_tokens, eos)
    prompt_lengths = [r["loss_mask"].index(1) for r in rows]
    decoded_counts = [(p["gained"], p["passes"]) for p in dec["per_row"]]
    report = {
        "target": str(target_path),
        "draft": source,
        "prompts": len(rows),
        "max_new_tokens": e.max_new_tokens,
        "num_steps": k,
        "topk": e.topk,
        "num_draft_tokens": e.num_draft_tokens or k + 1,
        "dtype": dtype_name,
        "device": device,
        "dtype_reason": dtype_why,
        "serving_dtype": cfg.target.dtype,
        "draft_family": family.name,
        # The engine `workflows.tools.serve` launches for this family, and its drafting flags.
        "serve_engine": family.weights_export,
        "serve_args": speculative_args(k, e.topk, e.num_draft_tokens or k + 1)
        if family.weights_export == "sglang"
        else vllm_speculative_args(family.served_methods["vllm"], k),
        "acceptance_definitions": {
            "acceptance_decoded": "tokens produced by verify passes / verify passes (the prefill's token excluded)",
            "acceptance_decoded_sglang_definition": "completion tokens / verify passes, the prefill's token "
            "included: SGLang's accept length",
            "acceptance_decoded_vllm_definition": "(accepted draft tokens + verify passes) / verify passes, the "
            "accepted counted before the cut at the answer's length: vLLM's "
            "mean acceptance length",
        },
        "acceptance_decoded_sglang_definition": dec["acceptance_sglang"],
        "acceptance_decoded_vllm_definition": dec["acceptance_vllm"],
        "acceptance_offline": offline.walk,
        "acceptance_offline_per_position_average": offline.per_position_average,
        "acceptance_decoded": dec["acceptance"],
        "parity_ratio": offline.walk / dec["acceptance"],
        "lossless": dec["lossless"],
        "divergences": dec["divergences"],
        "text_agreement": dec["text_agreement"],
        "per_position_acceptance": dec["per_position_acceptance"],
        "verified_per_pass": dec["verified_per_pass"],
        "per_position_acceptance_offline": offline.per_slot_rate,
        "acceptance_by_prompt_length_offline": by_bucket(
            prompt_lengths, [(a.tokens, a.passes) for a in offline_rows], e.length_buckets
        ),
        "acceptance_by_prompt_length_decoded": by_bucket(prompt_lengths, decoded_counts, e.length_buckets),
        "acceptance_by_dataset": by_group(
            [r["dataset"] for r in rows], [(a.tokens, a.passes) for a in offline_rows], decoded_counts
        ),
        "acceptance_by_prompt_kind": by_group(
            [r["kind"] for r in rows], [(a.tokens, a.passes) for a in offline_rows], decoded_counts
        ),
        "speedup_decoded": dec["speedup"],
        "tokens_per_s_decoded": dec["tokens_per_s_spec"],
        "tokens_per_s_plain": dec["tokens_per_s_plain"],
        "target_forwards_decoded": dec["target_forwards"],
        "offline_walk_passes": offline.passes,
        "per_prompt_decoded": dec["per_row"],
    }
    if dtype_name != "float32":  # the same walk in fp32: does precision move the figure?
        report.update(offline_in_fp32(cfg.target, layout, target_path, ids, rows, k, offline.walk, device))
    if served.exists():
        report["served_benchmark"] = read_json(served)
    ablation = ablation_file(layout)
    if ablation.exists():
        report["ablation"] = ablation.read_text()
    if e.topk > 1:  # the served tree, drafted as SGLang drafts it (differs from depth 3 on)
        sg = decode_all(model, draft, rows, ids, k, e.topk, e.num_draft_tokens, eos, sglang_compatible=True)
        report["sglang_draft_attention"] = {
            "acceptance_decoded": sg["acceptance"],
            "acceptance_decoded_sglang_definition": sg["acceptance_sglang"],
            "lossless": sg["lossless"],
            "per_position_acceptance": sg["per_position_acceptance"],
        }
    if e.tree_topk > 1:
        tree = decode_all(model, draft, rows, ids, k, e.tree_topk, e.tree_num_draft_tokens, eos)
        report.update(
            {
                "tree_topk": e.tree_topk,
                "tree_num_draft_tokens": e.tree_num_draft_tokens,
                "acceptance_decoded_tree": tree["acceptance"],
                "speedup_decoded_tree": tree["speedup"],
                "lossless_tree": tree["lossless"],
            }
        )
    if e.temperature > 0:
        report["at_temperature"] = at_temperature(cfg.evaluate, model, draft, head, rows, batches, ids, eos)
    report["served"] = served_checks(cfg, layout, target_path, rows, dec["greedy"], report, dtype_name, eos, device)
    with atomic_dir(out) as tmp:
        plots = plot(report, tmp)
        ReportHeadline.of(report, "the report")  # the readers' record: refuse to write a report they would refuse
        write_json_atomic(tmp / layout.report_file.name, report)
        # The prompts as served, for `workflows.tools.benchmark --prompts <this file>` against a server.
        (tmp / layout.heldout_prompts_file.name).write_text(
            "".join(
                json.dumps(
                    {
                        "id": r["id"],
                        "input_ids": r["input_ids"][: r["loss_mask"].index(1)],
                        "max_new_tokens": len(r["loss_mask"]) - r["loss_mask"].index(1),
                        "stop_token_ids": eos,
                    }
                )
                + "\n"
                for r in rows
            )
        )
        (tmp / layout.report_markdown.name).write_text(markdown(report, plots))
    log(
        f"evaluate: acceptance offline {offline.walk:.3f} decoded {dec['acceptance']:.3f} parity "
        f"{report['parity_ratio']:.3f} lossless {dec['lossless']} speed-up {dec['speedup']:.2f} -> {out}"
    )
    return {
        k: report[k]
        for k in ("acceptance_offline", "acceptance_decoded", "parity_ratio", "lossless", "speedup_decoded")
    }
