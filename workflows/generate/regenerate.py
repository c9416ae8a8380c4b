"""The Ray Data callable that regenerates conversations with a target engine.

Every assistant turn is regenerated in order: turn t's answer is generated from the
system prompt, the user turns up to t and the *regenerated* answers before it, so the
history the draft trains on is what the target would really have said. Batches advance
turn by turn, all conversations of the batch together.

Tool conversations (agentic ones): turn t is generated after the dataset's tool results
that answer the calls of turn t-1, and the dataset's results are kept only while they still
answer the call the *target* made: see _tool_step for the rule (a differing call ends the
conversation with the target's own turn, counted by outcome in the accounting table).

One engine (workflows.core.engines: `hf` batched transformers generate, the CPU default,
or `sglang`) per Ray actor, for the actor's life.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from eagle3 import tool_calls
from eagle3.chat_template import (
    TemplateError,
    apply_length_policy,
    check_template,
    generation_prompt_ids,
    render,
    template_messages,
    tokenize_conversation,
    tool_family,
    written_with_calls,
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


def _segments(messages: list[dict]) -> list[tuple[list[dict], dict | None]]:
    """The conversation cut at its assistant turns: (the turns sent before assistant turn t:
    a user turn, or the tool results answering the calls of turn t-1; the dataset's turn t,
    None for the answer to a conversation that ends on a user turn or on tool results)."""
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    out, sent = [], []
    for m in body:
        if m["role"] == "assistant":
            out.append((sent, m))
            sent = []
        else:
            sent.append({k: v for k, v in m.items() if k != "reasoning_content"})
    if sent:
        out.append((sent, None))
    return out


def _tool_step(st: dict, t: int, raw: str, finish: str, tokenizer) -> tuple[dict, str | None]:
    """The rule for turn t of a conversation with tools: (the message kept, the outcome).

    The dataset's tool results answer the calls the dataset's assistant made. The target's
    own turn t is parsed for calls in its template's format (eagle3.tool_calls):
    * the dataset's turn made calls and the target made the same ones (names and
      arguments, compared as canonical JSON), written exactly as its template writes them,
      finished: `tool_call_matched`: the turn is kept as a call and the dataset's results
      follow, the conversation goes on;
    * the dataset's turn made calls and the target's differ (other calls, none, unreadable,
      cut at max_new_tokens): `tool_call_differs_cut`: the dataset's results no longer
      answer it, so the conversation ends with this turn;
    * the same calls, written otherwise than its template writes them (spacing, key
      order): `tool_call_text_differs_cut`: going on would put the template's text, not the
      target's, in the history the draft trains on, so the conversation ends here;
    * the dataset's turn answered without calls but the target called a tool while later
      turns remain: `tool_call_unexpected_cut`: no result answers it, it ends here.
    A turn that ends the conversation is the target's own text, kept whole (its calls as it
    wrote them) and trained on: what came before it is kept, nothing is dropped silently."""
    dataset = st["segments"][t][1]
    wanted = (dataset or {}).get("tool_calls")
    last = t == len(st["segments"]) - 1
    try:
        before, calls = tool_calls.parse(st["family"], raw)
    except tool_calls.ToolCallSyntaxError:
        before, calls = raw, None
    plain = {"role": "assistant", "content": raw}
    if not wanted:
        called = calls is None or bool(calls)  # None: it opened a call it could not write
        return plain, "tool_call_unexpected_cut" if called and not last else None
    if calls is None or finish != "eos" or tool_calls.signature(calls) != tool_calls.signature(wanted):
        return plain, "tool_call_differs_cut"
    kept = {"role": "assistant", "content": before.strip(), "tool_calls": calls}
    try:
        history = template_messages([*st["history"], kept])
        prefix = render(tokenizer, history[:-1], add_generation_prompt=True, **st["kwargs"])
        written = written_with_calls(tokenizer, history, len(history) - 1, prefix, st["kwargs"])
    except TemplateError:
        written = None
    if written != raw:
        return plain, "tool_call_text_differs_cut"
    return kept, "tool_call_matched"


def regenerate_conversations(
    engine, tokenizer, conversations: list[list[dict]], s: Settings, tools: list[list[dict] | None] | None = None
) -> list[dict]:
    """Regenerated, tokenized conversations; each result has `status` ('ok' or a skip
    reason), `cut` (why later turns were not generated: `overlong` or a tool-call outcome)
    and `tool_outcomes` (counts of the tool-call rule's outcomes, see _tool_step)."""
    tools = tools or [None] * len(conversations)
    states = []
    for messages, own_tools in zip(conversations, tools):
        system = [m for m in messages[:1] if m["role"] == "system"]
        with_tools = bool(own_tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
        kwargs = {**s.template_kwargs, **({"tools": own_tools} if own_tools else {})}
        states.append(
            {
                "history": [{"role": m["role"], "content": m["content"]} for m in system],
                "segments": _segments(messages),
                "finish": [],
                "stopped": False,
                "cut": None,
                "kwargs": kwargs,
                "family": tool_family(tokenizer, **s.template_kwargs) if with_tools else None,
                "outcomes": Counter(),
            }
        )
    for t in range(max((len(st["segments"]) for st in states), default=0)):
        batch = []
        for st in states:
            if st["stopped"] or t >= len(st["segments"]):
                continue
            history = st["history"] + st["segments"][t][0]
            ids = generation_prompt_ids(tokenizer, history, **st["kwargs"])
            if len(ids) >= s.max_length:  # no room left for an answer: later turns are cut
                st["stopped"], st["cut"] = True, "overlong"
                continue
            st["history"] = history
            batch.append((st, ids))
        if not batch:
            break
        answers = engine.generate([ids for _, ids in batch], s.max_new_tokens, s.temperature, s.top_p)
        for (st, _), (answer, finish) in zip(batch, answers):
            if st["family"] is None:
                message = {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)}
            else:
                # Kept with its special tokens: a template's call markup may be made of them
                # (Kimi-K2's are); the stop token itself is not in `answer`.
                raw = tokenizer.decode(answer, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                message, outcome = _tool_step(st, t, raw, finish, tokenizer)
                if outcome is not None:
                    st["outcomes"][outcome] += 1
                    if outcome.endswith("_cut"):
                        st["stopped"], st["cut"] = True, outcome
            st["history"].append(message)
            st["finish"].append(finish)
    return [_tokenize(tokenizer, st, s) for st in states]


def _tokenize(tokenizer, st: dict, s: Settings) -> dict:
    result = {
        "messages": st["history"],
        "finish": st["finish"][-1] if st["finish"] else None,
        "turns_cut": len(st["segments"]) - len(st["finish"]),
        "cut": st["cut"] if len(st["segments"]) > len(st["finish"]) else None,
        "tool_outcomes": dict(st["outcomes"]),
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
            **st["kwargs"],
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
            self.engine,
            self.tokenizer,
            [json.loads(r["messages_json"]) for r in rows],
            self.s,
            tools=[json.loads(r.get("tools_json") or "null") for r in rows],
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
                    "cut": res["cut"],
                    "tool_outcomes_json": json.dumps(res["tool_outcomes"]) if res["tool_outcomes"] else None,
                    "messages_json": json.dumps(res["messages"], ensure_ascii=False),
                    "tools_json": row.get("tools_json"),
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
            # Turns not generated: the prompt outgrew max_length, or the tool-call rule ended
            # the conversation (its outcome counted below, per conversation).
            c["turns_cut_overlong" if r.get("cut") in (None, "overlong") else "turns_cut_tool_call"] += r["turns_cut"]
            for outcome, n in json.loads(r.get("tool_outcomes_json") or "{}").items():
                c[outcome] += n
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
                    tools = p.pop("tools", None)
                    p["tools_json"] = json.dumps(tools, ensure_ascii=False) if tools else None
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
            ("cut", pa.string()),  # why later turns were not generated (overlong, a tool-call outcome)
            ("tool_outcomes_json", pa.string()),  # the tool-call rule's outcomes in this conversation
            ("messages_json", pa.string()),
            ("tools_json", pa.string()),  # the conversation's tool definitions, null without
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.uint8())),
            ("prompt_tokens", pa.int64()),
            ("answer_tokens", pa.int64()),
        ]
    )
