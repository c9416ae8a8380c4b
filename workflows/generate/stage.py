"""Stage `generate`: the target regenerates the answers of a prompt mixture, on Ray Data.

    python -m workflows.generate [hydra overrides]        # this stage only (config `full`)
    python -m workflows.generate mixture=bundled data.limit=8 target=tiny

1. Ingest every dataset of `mixture` (workflows.generate.ingest) into `generate/prompts.parquet`
   (id, dataset, split, messages), with per-dataset counts of what was skipped and why.
2. Cut the prompts into shards of `data.shard_size` and send the shards not yet committed
   through a Ray Data actor pool of target engines (workflows.generate.regenerate): every assistant
   turn is regenerated in order, then the conversation is tokenized with the target's chat
   template and assistant loss mask (eagle3.chat_template).
3. Commit each shard whole: `shards/<k>.parquet` renamed into place, then `<k>.done.json`
   (its counts) written last. A rerun skips committed shards, so a killed run resumes with
   no duplicate and no loss; a changed config or prompt set starts the shards afresh.
4. Write the token-accounting table (per dataset: conversations, prompt tokens, answer
   tokens, skips by reason) to `generate/accounting.{json,txt}`, print it, mark DONE.

Later stages read the committed rows with `RunLayout.read_corpus` (workflows.core.layout).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Callable

from eagle3.schema import ConfigError, output_dict
from eagle3.target_spec import TargetSpec
from workflows.core.cluster import ensure_ray
from workflows.core.config import DataSection, DatasetSpec, FullConfig, resolve_data_path
from workflows.core.errors import USER_ERRORS, StageFailure
from workflows.core.layout import RunLayout
from workflows.core.log import log
from workflows.core.markers import (
    atomic_file,
    config_hash,
    read_json,
    run_stage,
    write_bytes_atomic,
    write_json_atomic,
)
from workflows.core.precision import resolve
from workflows.core.provenance import target_identity
from workflows.core.stage_metrics import StageMetrics
from workflows.generate import ingest, offline_sources
from workflows.generate.regenerate import ShardRegenerator

# ----------------------------------------------------------------------------- ingestion


def ingest_mixture(
    mixture: dict[str, DatasetSpec], data: DataSection, cache_path: Path
) -> tuple[list[dict], dict[str, Counter]]:
    """The mixture's conversations, normalised and split (data.limit per dataset at most,
    data.heldout_fraction held out), with each dataset's counts; the offline sources are
    materialised under `cache_path`."""
    if not mixture:
        raise ConfigError("mixture: no datasets configured (e.g. mixture=default)")
    rows, counts, seen = [], {}, set()
    for name, spec in mixture.items():
        try:
            got, total, paths = _ingest_one(name, spec, data, cache_path, seen)
        except ingest.IngestError as exc:  # name the dataset: a mixture can hold nine
            raise ingest.IngestError(f"mixture.{name}: {exc}") from None
        rows += got
        counts[name] = total
        log(f"generate: {name}: {total['conversations']} conversations from {len(paths)} file(s)")
        ingest.require_conversations(name, paths, total)  # an empty dataset is a mistake: stop
    return rows, counts


def _ingest_one(
    name: str, spec: DatasetSpec, data: DataSection, cache_path: Path, seen: set[str]
) -> tuple[list[dict], Counter, list[str]]:
    """One dataset of the mixture: its normalised rows, counts and files."""
    rows: list[dict] = []
    if spec.source == "file":
        paths = ingest.expand_paths(str(resolve_data_path(spec.path)) if "://" not in spec.path else spec.path)
    else:
        paths = [offline_sources.materialise(spec.source, cache_path)]
    limit = min(x for x in (spec.limit, data.limit, 1 << 62) if x is not None)
    total = Counter()
    for path in paths:
        if total["conversations"] >= limit:
            break
        got, c = ingest.ingest_dataset(
            name,
            path,
            spec.format,
            spec.file_type,
            limit - total["conversations"],
            spec.weight,
            spec.split,
            data.heldout_fraction,
            seen,
            log=log,
            prompt_field=spec.prompt_field,
            tools_field=spec.tools_field,
        )
        rows += got
        total.update(c)
    return rows, total, paths


# ----------------------------------------------------------------------------- shards


def engine_device(data: DataSection) -> str:
    """Where each engine actor computes: the GPUs Ray gives it (data.gpus_per_engine), else
    the CPU. Decided by the config, not by this driver's machine: on a cluster the driver
    may have no GPU while the actors do."""
    return "cuda" if data.gpus_per_engine > 0 else "cpu"


def _driver_has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_count(data: DataSection, pending_shards: int) -> int:
    """Engines to start: data.num_engines, but never more than the shards to do (an engine
    without a shard would only load the target)."""
    return max(1, min(data.num_engines, pending_shards))


def check_tool_rendering(target: TargetSpec, data: DataSection, target_path: Path, rows: list[dict]) -> None:
    """Conversations with tool turns need a target template that renders them (and writes
    calls in a format eagle3.tool_calls reads): refuse in one line, naming the datasets,
    before any engine starts, rather than failing every shard that holds one."""
    with_tools = Counter(r["dataset"] for r in rows if ingest.has_tool_turns(r["messages"], r.get("tools")))
    if not with_tools:
        return
    from transformers import AutoTokenizer

    from eagle3.chat_template import TemplateError, check_tool_template

    tokenizer = AutoTokenizer.from_pretrained(str(target_path), trust_remote_code=target.trust_remote_code)
    try:
        family = check_tool_template(tokenizer, enable_thinking=data.reasoning)
    except TemplateError as exc:
        held = ", ".join(f"{name} ({n})" for name, n in sorted(with_tools.items()))
        raise TemplateError(
            f"generate: the mixture holds tool conversations ({held}) but {exc}; drop those datasets "
            "(~mixture.<name>) or use a target whose template renders tools"
        ) from None
    log(f"generate: {sum(with_tools.values())} tool conversations, calls read in the {family!r} format")


def regenerate_shards(
    cfg: FullConfig,
    target_path: Path,
    plans: list[dict],
    layout: RunLayout,
    on_commit: Callable[[int], None] | None = None,
) -> None:
    """Send the pending shard plans (`shard`, `start`, `stop`: rows of prompts.parquet)
    through the actor pool; each actor reads its prompts and commits its shard itself, the
    driver only sees one small record per shard."""
    import ray

    ensure_ray(cfg.cluster)
    engines = engine_count(cfg.data, len(plans))
    threads = cfg.data.threads_per_engine or max(1, (os.cpu_count() or 1) // engines)
    device = engine_device(cfg.data)
    if device == "cpu" and cfg.data.backend == "sglang" and _driver_has_gpu():
        log(
            "generate: WARNING: data.backend=sglang runs on the CPU (data.gpus_per_engine=0) although this machine "
            f"has GPUs; set data.gpus_per_engine={cfg.target.tp_size} to use them"
        )
    settings = dict(
        max_new_tokens=cfg.data.max_new_tokens,
        temperature=cfg.data.temperature,
        top_p=cfg.data.top_p,
        reasoning=cfg.data.reasoning,
        keep_reasoning=cfg.data.keep_reasoning,
        max_length=cfg.data.max_length,
        overlong=cfg.data.overlong,
        backend=cfg.data.backend,
        dtype=resolve(cfg.data.dtype, device),
        threads=threads,
        seed=cfg.seed,
        sglang_max_total_tokens=cfg.data.sglang_max_total_tokens if device == "cpu" else None,
        trust_remote_code=cfg.target.trust_remote_code,
        tp_size=cfg.target.tp_size,
        device=device,
    )
    ds = ray.data.from_items(plans, override_num_blocks=len(plans)).map_batches(
        ShardRegenerator,
        fn_constructor_kwargs={
            "target_path": str(target_path),
            "settings": settings,
            "prompts_file": str(layout.prompts_file),
            "shards_folder": str(layout.corpus_shards),
            "batch_size": cfg.data.batch_size,
        },
        batch_size=1,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=engines),
        num_cpus=1 if cfg.data.backend == "hf" else 0.5,
        num_gpus=cfg.data.gpus_per_engine or None,
    )
    # Ray metrics: conversations done (of those pending), answer tokens generated and per second.
    conversations = StageMetrics("generate", "conversations", total=sum(p["stop"] - p["start"] for p in plans))
    answers = StageMetrics("generate", "answer_tokens")
    left = {p["shard"] for p in plans}
    try:
        for record in ds.iter_rows():
            k = int(record["shard"])
            left.discard(k)
            conversations.advance(int(record["conversations"]))
            answers.advance(int(record["answer_tokens"]))
            log(f"generate: committed shard {k} ({record['rows']} conversations)")
            if on_commit is not None:
                on_commit(k)
    except USER_ERRORS:
        raise
    except Exception as exc:  # a worker's failure, wrapped by Ray: its cause is the last line
        raise StageFailure(
            f"generate: shard(s) {sorted(left)[:8]}{' and more' if len(left) > 8 else ''} of "
            f"{layout.corpus_shards} did not finish: {root_cause(exc)}; the {len(plans) - len(left)} committed "
            "this run are kept: fix the cause (free space, a dead node) and rerun, which regenerates only the "
            "others (the worker's traceback is in the log above)"
        ) from exc
    if left:
        raise StageFailure(f"generate: shards {sorted(left)} never came back from Ray Data; rerun to regenerate them")


def root_cause(exc: BaseException) -> str:
    """What actually failed in a worker, from the error Ray wraps it in: the innermost cause
    where Ray kept it, else the last line of Ray's text naming an exception that is not
    Ray's own (Ray's text holds the worker's traceback, then its wrapping and its hints)."""
    inner = exc
    while inner.__cause__ is not None:
        inner = inner.__cause__
    if not type(inner).__module__.startswith("ray"):
        text = str(inner).strip().splitlines()
        return f"{type(inner).__name__}: {text[0] if text else ''}"[:400]
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    original = [line for line in named if not line.startswith("ray.")]  # not Ray's own wrapping
    return ((original or named or lines or [type(inner).__name__])[-1])[:400]


# ----------------------------------------------------------------------------- accounting


def accounting(ingest_counts: dict[str, Counter], shards: dict[int, dict]) -> dict[str, dict]:
    table: dict[str, Counter] = {name: Counter() for name in ingest_counts}
    for name, c in ingest_counts.items():
        table[name]["records"] = c["records"]
        if c["tool_conversations"]:
            table[name]["tool_conversations"] = c["tool_conversations"]
        for k, v in c.items():
            if k.startswith("skipped_"):
                table[name][k] += v
    for record in shards.values():
        for name, c in record["counts"].items():
            table.setdefault(name, Counter()).update(c)
    return {name: dict(sorted(c.items())) for name, c in table.items()}


TOOL_COUNTS = ("tool_conversations", "tool_call_matched", "turns_cut_tool_call")


def _tool_part(c: dict) -> str:
    """The tool-call rule's counts of a row (see regenerate._tool_step), shown only where a
    dataset has tool conversations: `tools: conversations=3, call_matched=1, ...`."""
    keys = [k for k in c if (k in TOOL_COUNTS or k.startswith("tool_call_")) and c[k]]
    return ("  tools: " + ", ".join(f"{k.removeprefix('tool_')}={c[k]}" for k in sorted(keys))) if keys else ""


def format_accounting(table: dict[str, dict]) -> str:
    main = ["records", "conversations", "prompt_tokens", "answer_tokens", "truncated", "finished_eos"]
    lines = [f"{'dataset':<20}" + "".join(f"{c:>15}" for c in main) + "  skipped"]
    total = Counter()
    for name, c in table.items():
        total.update(c)
        skips = ", ".join(f"{k.removeprefix('skipped_')}={v}" for k, v in c.items() if k.startswith("skipped_") and v)
        lines.append(f"{name:<20}" + "".join(f"{c.get(k, 0):>15}" for k in main) + f"  {skips or '-'}" + _tool_part(c))
    skips = ", ".join(f"{k.removeprefix('skipped_')}={v}" for k, v in total.items() if k.startswith("skipped_") and v)
    lines.append(
        f"{'TOTAL':<20}" + "".join(f"{total.get(k, 0):>15}" for k in main) + f"  {skips or '-'}" + _tool_part(total)
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- stage


def run(cfg: FullConfig, target_path: Path, on_commit: Callable[[int], None] | None = None) -> Path:
    layout = RunLayout.of(cfg)
    out = layout.stage_dir("generate")
    rows, ingest_counts = ingest_mixture(cfg.mixture, cfg.data, cfg.cache_path)
    if not rows:
        raise ingest.IngestError(
            f"generate: the mixture {list(cfg.mixture)} yields no usable conversation:\n"
            + json.dumps({k: dict(v) for k, v in ingest_counts.items()}, indent=1)
        )
    data = output_dict(cfg.data)
    data["dtype"] = resolve(cfg.data.dtype, engine_device(cfg.data))  # what the engines compute in here
    key = {
        "data": data,
        "target": target_identity(target_path, cfg.cache_path),
        "seed": cfg.seed,
        # A row's tools only where it has some: the keys of runs without tools stay as they were.
        "prompts": config_hash(
            {"rows": [[r["id"], r["split"], r["messages"]] + ([r["tools"]] if r.get("tools") else []) for r in rows]}
        ),
    }

    def build() -> dict:
        folder = layout.corpus_shards
        plan = {"key": config_hash(key), "shard_size": cfg.data.shard_size, "conversations": len(rows)}
        if folder.exists() and (not (folder / "plan.json").exists() or read_json(folder / "plan.json") != plan):
            log(f"generate: config or prompts changed since the shards in {folder} were written; starting afresh")
            shutil.rmtree(folder)
        folder.mkdir(exist_ok=True)
        write_json_atomic(folder / "plan.json", plan)
        with atomic_file(layout.prompts_file) as tmp:
            ingest.write_normalised(rows, tmp)

        # Shard k is rows [k * shard_size, (k+1) * shard_size) of prompts.parquet (same order as rows).
        size = cfg.data.shard_size
        expected = {k: min(size, len(rows) - k * size) for k in range(-(-len(rows) // size))}
        done = layout.committed_corpus_shards()
        plans = [{"shard": k, "start": k * size, "stop": k * size + n} for k, n in expected.items() if k not in done]
        log(
            f"generate: {len(rows)} conversations in {len(expected)} shards, {len(done)} already committed, "
            f"{sum(p['stop'] - p['start'] for p in plans)} conversations to regenerate "
            f"({cfg.data.backend} x{engine_count(cfg.data, len(plans))})"
        )
        if plans:
            check_tool_rendering(cfg.target, cfg.data, target_path, rows)
            regenerate_shards(cfg, target_path, plans, layout, on_commit)
        shards = layout.committed_corpus_shards()
        ids = [i for s in shards.values() for i in s["ids"]]
        if sorted(ids) != sorted(r["id"] for r in rows) or len(shards) != len(expected):
            raise RuntimeError(f"generate: committed shards in {folder} do not cover the prompts exactly")
        table = accounting(ingest_counts, shards)
        text = format_accounting(table)
        accounting_json, accounting_txt = layout.accounting_files
        write_json_atomic(accounting_json, table)
        write_bytes_atomic(accounting_txt, (text + "\n").encode())
        print(text, flush=True)
        for s in shards.values():
            for e in s["errors"]:
                log(f"generate: skipped {e}")
        total = Counter()
        for c in table.values():
            total.update(c)
        return {
            "conversations": total["conversations"],
            "prompt_tokens": total["prompt_tokens"],
            "answer_tokens": total["answer_tokens"],
            "shards": len(shards),
        }

    return run_stage("generate", out, key, build)
