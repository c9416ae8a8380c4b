"""Stage `generate`: the target regenerates the answers to a prompt list.

The draft must learn what the target really says, so answers come from the target
itself (greedy, so the text is what greedy serving would produce). This first version
runs one HF engine in-process over a JSONL prompt list; the Ray Data mixture pipeline
(many datasets, SGLang actors) builds on the same output schema.

Output: `<run_dir>/generate/samples.parquet`, one row per conversation:
id, dataset, split (train/heldout by id hash), prompt, answer, finish (eos/length),
input_ids (the chat-templated conversation), loss_mask (1 on the answer tokens).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from workflows.common import atomic_dir, log, mark_done, stage_is_done
from workflows.config import FullConfig, resolve_data_path


def read_prompts(path: Path, limit: int | None = None) -> tuple[list[dict], dict]:
    """Rows with `id` and `prompt`. Bad lines raise naming file and line; empty prompts are
    skipped and counted."""
    rows, skipped = [], {"empty_prompt": 0}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({exc.msg})") from None
            if not isinstance(row, dict) or "prompt" not in row:
                raise ValueError(f"{path}:{lineno}: missing field 'prompt'")
            if not isinstance(row["prompt"], str):
                raise ValueError(f"{path}:{lineno}: field 'prompt' must be a string")
            if not row["prompt"].strip():
                skipped["empty_prompt"] += 1
                continue
            rows.append({"id": str(row.get("id", f"{path.stem}-{lineno}")), "prompt": row["prompt"]})
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise ValueError(f"{path}: no usable prompts")
    return rows, skipped


def split_of(sample_id: str, heldout_fraction: float) -> str:
    """Deterministic train/held-out split by a hash of the id."""
    h = int(hashlib.sha256(sample_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if h < heldout_fraction else "train"


@torch.no_grad()
def regenerate(model, tokenizer, prompts: list[dict], cfg, progress=True) -> tuple[list[dict], dict]:
    """Greedy answers for `prompts` in batches; returns rows and skip counts."""
    from tqdm import tqdm

    tokenizer.padding_side = "left"  # decoder-only batched generation pads on the left
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos = tokenizer.eos_token_id
    rows, counts = [], {"truncated": 0, "dropped_overlong": 0}
    bar = tqdm(total=len(prompts), desc="generate", unit="prompt", disable=not progress)
    for start in range(0, len(prompts), cfg.batch_size):
        chunk = prompts[start : start + cfg.batch_size]
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], tokenize=False,
                                          add_generation_prompt=True)
            for p in chunk
        ]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=cfg.max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
        width = enc["input_ids"].shape[1]
        for i, p in enumerate(chunk):
            prompt_ids = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
            answer_ids = out[i, width:].tolist()
            finish = "length"
            if eos in answer_ids:
                answer_ids = answer_ids[: answer_ids.index(eos) + 1]
                finish = "eos"
            ids = prompt_ids + answer_ids
            mask = [0] * len(prompt_ids) + [1] * len(answer_ids)
            if len(ids) > cfg.max_length:
                if cfg.overlong == "drop":
                    counts["dropped_overlong"] += 1
                    continue
                ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
                counts["truncated"] += 1
            rows.append({
                "id": p["id"], "prompt": p["prompt"], "finish": finish,
                "answer": tokenizer.decode(answer_ids, skip_special_tokens=True),
                "input_ids": ids, "loss_mask": mask,
            })
        bar.update(len(chunk))
    bar.close()
    return rows, counts


def write_samples(rows: list[dict], path: Path, dataset: str, heldout_fraction: float) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "id": [r["id"] for r in rows],
        "dataset": [dataset] * len(rows),
        "split": [split_of(r["id"], heldout_fraction) for r in rows],
        "prompt": [r["prompt"] for r in rows],
        "answer": [r["answer"] for r in rows],
        "finish": [r["finish"] for r in rows],
        "input_ids": pa.array([r["input_ids"] for r in rows], type=pa.list_(pa.int32())),
        "loss_mask": pa.array([r["loss_mask"] for r in rows], type=pa.list_(pa.uint8())),
    })
    pq.write_table(table, path)


def read_samples(run_dir: Path) -> list[dict]:
    import pyarrow.parquet as pq

    path = run_dir / "generate" / "samples.parquet"
    if not (run_dir / "generate" / "DONE.json").exists():
        raise FileNotFoundError(f"{path}: the generate stage has not finished; run stages=[generate] first")
    return pq.read_table(path).to_pylist()


def run(cfg: FullConfig, target_path: Path) -> Path:
    from workflows.target import load_target, target_provenance

    out = cfg.run_path / "generate"
    prompts_path = resolve_data_path(cfg.data.prompts)
    key = {"data": vars(cfg.data), "target": target_provenance(target_path), "prompts": str(prompts_path)}
    if stage_is_done(out, key):
        log(f"generate: reusing {out}")
        return out
    prompts, skipped = read_prompts(prompts_path, cfg.data.limit)
    log(f"generate: {len(prompts)} prompts from {prompts_path} (skipped {skipped})")
    model, tokenizer = load_target(target_path, dtype=cfg.target.dtype)
    rows, counts = regenerate(model, tokenizer, prompts, cfg.data)
    with atomic_dir(out) as tmp:
        write_samples(rows, tmp / "samples.parquet", prompts_path.stem, cfg.data.heldout_fraction)
    answer_tokens = sum(sum(r["loss_mask"]) for r in rows)
    summary = {"conversations": len(rows), "answer_tokens": answer_tokens,
               "finished_eos": sum(r["finish"] == "eos" for r in rows), **skipped, **counts}
    mark_done(out, key, summary)
    log(f"generate: {summary}")
    return out
