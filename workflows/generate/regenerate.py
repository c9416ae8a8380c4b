"""The Ray Data callable that regenerates conversations with a target engine.

Every assistant turn is regenerated in order: turn t's answer is generated from the
system prompt, the user turns up to t and the *regenerated* answers before it, so the
history the draft trains on is what the target would really have said. Batches advance
turn by turn, all conversations of the batch together.

One engine (workflows.core.engines: `hf` batched transformers generate, the CPU default,
or `sglang`) per Ray actor, for the actor's life.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from eagle3.chat_template import (
    TemplateError,
    apply_length_policy,
    check_template,
    generation_prompt_ids,
    tokenize_conversation,
)
from workflows.core.engine_spec import EngineSpec
from workflows.core.engines import make_engine
from workflows.core.markers import atomic_file, write_json_atomic
from workflows.generate.ingest import decode_row


@dataclass
class Settings:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    reasoning: bool = False
    keep_reasoning: bool = True
    max_length: int = 512
    overlong: str = "truncate"
    backend: str = "hf"
    dtype: str = "float32"
    threads: int = 0
    seed: int = 0
    sglang_max_total_tokens: int | None = 4096  # None: SGLang sizes its KV pool (GPUs)
    trust_remote_code: bool = False
    device: str = "cpu"
    tp_size: int = 1

    @property
    def template_kwargs(self) -> dict:
        # Templates that know it (Qwen3, ...) switch thinking on/off; others ignore the variable.
        return {"enable_thinking": self.reasoning}


def regenerate_conversations(engine, tokenizer, conversations: list[list[dict]], s: Settings) -> list[dict]:
    """Regenerated, tokenized conversations; each result has `status` ('ok' or a skip reason)."""
    states = []
    for messages in conversations:
        system = [m for m in messages[:1] if m["role"] == "system"]
        users = [m["content"] for m in messages if m["role"] == "user"]
        states.append(
            {
                "history": [{"role": m["role"], "content": m["content"]} for m in system],
                "users": users,
                "finish": [],
                "stopped": False,
            }
        )
    for t in range(max((len(st["users"]) for st in states), default=0)):
        batch = []
        for st in states:
            if st["stopped"] or t >= len(st["users"]):
                continue
            history = st["history"] + [{"role": "user", "content": st["users"][t]}]
            ids = generation_prompt_ids(tokenizer, history, **s.template_kwargs)
            if len(ids) >= s.max_length:  # no room left for an answer: later turns are cut
                st["stopped"] = True
                continue
            st["history"] = history
            batch.append((st, ids))
        if not batch:
            break
        answers = engine.generate([ids for _, ids in batch], s.max_new_tokens, s.temperature, s.top_p)
        for (st, _), (answer, finish) in zip(batch, answers):
            text = tokenizer.decode(answer, skip_special_tokens=True)
            st["history"].append({"role": "assistant", "content": text})
            st["finish"].append(finish)
    return [_tokenize(tokenizer, st, s) for st in states]


def _tokenize(tokenizer, st: dict, s: Settings) -> dict:
    result = {
        "messages": st["history"],
        "finish": st["finish"][-1] if st["finish"] else None,
        "turns_cut": len(st["users"]) - len(st["finish"]),
        "input_ids": [],
        "loss_mask": [],
        "truncated": False,
        "status": "ok",
        "error": None,
    }
    if not st["finish"]:
        result["status"] = "prompt_overlong"
        return result
    try:
        tok = tokenize_conversation(
            tokenizer,
            st["history"],
            keep_reasoning=s.keep_reasoning,
            end_of_turn=[f == "eos" for f in st["finish"]],
            **s.template_kwargs,
        )
    except TemplateError as exc:
        result.update(status="mask_round_trip_failed", error=str(exc))
        return result
    fitted, reason = apply_length_policy(tok, s.max_length, s.overlong)
    if fitted is None:
        result["status"] = reason
        return result
    result.update(
        input_ids=fitted.input_ids, loss_mask=fitted.loss_mask, truncated=len(fitted.input_ids) < len(tok.input_ids)
    )
    return result


class Regenerator:
    """Ray Data callable class: one target engine per actor, a batch of conversations per call."""

    def __init__(self, target_path: str, settings: dict):
        self.s = s = Settings(**settings)
        self.engine = make_engine(
            s.backend,
            EngineSpec(
                target_path,
                dtype=s.dtype,
                trust_remote_code=s.trust_remote_code,
                threads=s.threads,
                device=s.device,
                seed=s.seed,
                max_total_tokens=s.sglang_max_total_tokens,
                tp_size=s.tp_size,
            ),
        )
        self.tokenizer = self.engine.tokenizer
        check_template(self.tokenizer, **self.s.template_kwargs)  # refuse a template before any work

    def __call__(self, batch):
        import pyarrow as pa

        rows = batch.to_pylist()
        results = regenerate_conversations(
            self.engine, self.tokenizer, [json.loads(r["messages_json"]) for r in rows], self.s
        )
        out = []
        for row, res in zip(rows, results):
            mask = res["loss_mask"]
            out.append(
                {
                    "id": row["id"],
                    "dataset": row["dataset"],
                    "split": row["split"],
                    "shard": row["shard"],
                    "status": res["status"],
                    "error": res["error"],
                    "finish": res["finish"],
                    "truncated": res["truncated"],
                    "turns_cut": res["turns_cut"],
                    "messages_json": json.dumps(res["messages"], ensure_ascii=False),
                    "input_ids": res["input_ids"],
                    "loss_mask": mask,
                    "prompt_tokens": len(mask) - sum(mask),
                    "answer_tokens": sum(mask),
                }
            )
        return pa.Table.from_pylist(out, schema=RESULT_SCHEMA())


def commit_shard_files(folder: Path, index: int, rows: list[dict]) -> dict:
    """Write one shard's ok rows (Parquet, renamed into place), then its marker with counts:
    `<k>.parquet`, then `<k>.done.json` last (a shard without its marker is not committed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ok = [r for r in rows if r["status"] == "ok"]
    shard = Path(folder) / f"{index:05d}.parquet"
    with atomic_file(shard) as tmp:
        pq.write_table(pa.Table.from_pylist(ok, schema=RESULT_SCHEMA()), tmp)
    per_dataset: dict[str, Counter] = defaultdict(Counter)
    errors = []
    for r in rows:
        c = per_dataset[r["dataset"]]
        if r["status"] == "ok":
            c["conversations"] += 1
            c["prompt_tokens"] += r["prompt_tokens"]
            c["answer_tokens"] += r["answer_tokens"]
            c["truncated"] += int(r["truncated"])
            c["turns_cut_overlong"] += r["turns_cut"]
            c["finished_eos"] += int(r["finish"] == "eos")
        else:
            c[f"skipped_{r['status']}"] += 1
            if r["error"]:
                errors.append(f"{r['id']}: {r['error']}")
    record = {
        "rows": len(ok),
        "ids": sorted(r["id"] for r in rows),
        "errors": errors[:5],
        "counts": {k: dict(v) for k, v in per_dataset.items()},
    }
    write_json_atomic(shard.with_name(f"{index:05d}.done.json"), record)
    return record


class ShardRegenerator(Regenerator):
    """Ray Data callable class for whole output shards: each input row is a shard plan
    (`shard`, `start`, `stop`: its rows of prompts.parquet). The actor reads those prompts,
    regenerates them `batch_size` at a time, commits the shard itself (commit_shard_files)
    and returns only a small record: no conversation goes back through the driver."""

    def __init__(self, target_path: str, settings: dict, prompts_file: str, shards_folder: str, batch_size: int):
        super().__init__(target_path, settings)
        import pyarrow.parquet as pq

        self.prompts = pq.read_table(prompts_file, memory_map=True)  # mapped: pages read when sliced
        self.folder, self.batch_size = Path(shards_folder), batch_size

    def __call__(self, batch):
        import pyarrow as pa

        out = []
        for plan in batch.to_pylist():
            rows_of = self.prompts.slice(plan["start"], plan["stop"] - plan["start"]).to_pylist()
            prompts = [decode_row(r) for r in rows_of]
            rows = []
            for k in range(0, len(prompts), self.batch_size):
                group = prompts[k : k + self.batch_size]
                for p in group:
                    p["messages_json"], p["shard"] = json.dumps(p.pop("messages")), plan["shard"]
                    p["tools_json"] = json.dumps(p.pop("tools", None))
                rows += super().__call__(pa.Table.from_pylist(group)).to_pylist()
            record = commit_shard_files(self.folder, plan["shard"], rows)
            answers = sum(c.get("answer_tokens", 0) for c in record["counts"].values())
            out.append(
                {"shard": plan["shard"], "conversations": len(rows), "rows": record["rows"], "answer_tokens": answers}
            )
        return pa.Table.from_pylist(out)


def RESULT_SCHEMA():  # noqa: N802 - a schema constant, built lazily (pyarrow import)
    import pyarrow as pa

    return pa.schema(
        [
            ("id", pa.string()),
            ("dataset", pa.string()),
            ("split", pa.string()),
            ("shard", pa.int64()),
            ("status", pa.string()),
            ("error", pa.string()),
            ("finish", pa.string()),
            ("truncated", pa.bool_()),
            ("turns_cut", pa.int64()),
            ("messages_json", pa.string()),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.uint8())),
            ("prompt_tokens", pa.int64()),
            ("answer_tokens", pa.int64()),
        ]
    )
