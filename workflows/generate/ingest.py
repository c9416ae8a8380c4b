"""Ingestion: prompt datasets in the formats people have -> one normalised Parquet table.

Formats (`format`, or `auto` to detect per record):
* `sharegpt`: `{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}`;
  `value` is a string or, as in sets converted from OpenAI's, a list of parts read as below
* `openai`:   `{"messages": [{"role": ..., "content": ..., "reasoning_content"?: ...}, ...]}`;
  `content` is a string or a list of parts (`[{"type": "text", "text": ...}, {"type":
  "image_url", ...}]`): the text parts (`text`/`input_text`) are joined with one space, as
  SGLang 0.5.23 flattens a parts list for a text-only chat template
  (`process_content_for_template_format`, "string" format), so the prompt the target sees
  here is the one it is served; every other part is dropped and counted.
* `prompts`:  `{"prompt": "...", "system"?: "..."}`; `prompt_field` names another string field
  holding the prompt (instruction datasets: `instruction`, `question`, `problem`)
Files: JSON (a list of records), JSONL (optionally .gz), Parquet; local paths or fsspec
URLs (`memory://`, `s3://`, ...; compression inferred from the name). A UTF-8 byte-order
mark at the start of a JSON/JSONL file is accepted (editors on Windows write one).

Tool turns (agentic conversations), in every layout below, become one internal form (the one
Hugging Face chat templates take; read by `workflows/generate/tool_turns.py`):
* OpenAI: the record's `tools` (or the dataset's `tools_field`), assistant `tool_calls` with
  `content` null or text, `tool` turns with `tool_call_id`; the older `function_call` on an
  assistant turn answered by a `function` turn.
* ShareGPT: `function_call` turns (the call as JSON), `tool` / `observation` /
  `function_response` results, calls written inside the assistant's text (Hermes
  `<tool_call>` blocks, glaive `<functioncall>`), the tools as a list or a JSON string.

Normalised record: id, dataset, split, messages (list of {role, content, reasoning_content},
plus `tool_calls` on an assistant turn that calls, `tool_call_id` / `name` on a tool
result, only where present), and `tools` when the record has tool definitions.
Ids: the record's own `id` when present, else a hash of its content, both prefixed by the
dataset name. Duplicates (same system+user turns, anywhere in the mixture) are kept once.
Split: `heldout` when a hash of the id falls under the held-out fraction, unless the dataset
forces one split or takes each record's own (`split: record`).

What is fatal and what is skipped (nothing is dropped silently):
* fatal, naming file and line (JSON/JSONL) or row (Parquet): malformed JSON, bytes that are
  not UTF-8, a record that is not an object or lacks the format's field, an unreadable file,
  a JSON file nesting deeper than Python's parser goes (its deepest line named).
* counted skips, by reason, in the accounting table (first location of each logged):
  `empty_conversation` (no turns, or no user turn), `missing_role_or_content`,
  `unknown_role`, `non_alternating_roles`, `empty_prompt`, `duplicate`, `weight_sampled_out`,
  `lone_surrogate` (a `\ud800`-style escape: valid JSON, but not text any tokenizer takes),
  `too_deep` (a JSONL line nesting deeper than Python's parser goes: valid JSON, no record),
  `bad_tool_call` (a call without a name, unreadable call text), `bad_tool_arguments`
  (arguments that are not a JSON object), `bad_tools` (an unreadable tool list),
  `tool_result_without_call`, `tool_call_without_result` (a call followed by a user turn);
  and `non_text_part`, which counts *parts* (images, audio, ...) dropped from the
  content lists of conversations that were kept (the conversation itself is kept). A turn
  whose list has no text part at all is a `missing_role_or_content` skip of its record.
* fatal, naming the dataset and its file(s) with the counts by reason: a dataset that
  yields no conversation at all (`require_conversations`).
* fine: a conversation ending on a user turn (its answer is generated); existing assistant
  turns are kept in the record (regeneration replaces them).
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import io
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from workflows.core.errors import InputError
from workflows.generate import tool_turns
from workflows.generate.messages import Skip, content_text, new_message

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
    # Tool results, as function-calling sets name them (Hermes, LLaMA-Factory, glaive-style).
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
    # An assistant turn whose value is the call itself, as JSON (LLaMA-Factory, xLAM-style).
    "function_call": "assistant",
}
OPENAI_ROLES = {
    "user": "user",
    "assistant": "assistant",
    "system": "system",
    "developer": "system",
    "tool": "tool",
    "function": "tool",  # the older OpenAI layout: a `function_call` answered by a `function` turn
}
FORMAT_FIELD = {"sharegpt": "conversations", "openai": "messages", "prompts": "prompt"}


class IngestError(InputError):
    """Fatal bad input; the message names the file and line or row."""


def hash_fraction(text: str) -> float:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def split_of(sample_id: str, heldout_fraction: float) -> str:
    """Deterministic train/held-out split by a hash of the id."""
    return "heldout" if hash_fraction(sample_id) < heldout_fraction else "train"


# ----------------------------------------------------------------------------- reading files


def _file_type(path: str, file_type: str) -> str:
    if file_type != "auto":
        return file_type
    name = path.lower().removesuffix(".gz")
    for ext, kind in ((".jsonl", "jsonl"), (".ndjson", "jsonl"), (".json", "json"), (".parquet", "parquet")):
        if name.endswith(ext):
            return kind
    raise IngestError(f"{path}: cannot tell the file type from the name; set file_type (json, jsonl, parquet)")


def _open_bytes(path: str) -> bytes:
    import fsspec

    try:
        with fsspec.open(path, "rb", compression="infer") as f:
            return f.read()
    except FileNotFoundError:
        raise IngestError(f"{path}: file not found") from None
    except (OSError, gzip.BadGzipFile, EOFError) as exc:
        raise IngestError(f"{path}: cannot read ({exc})") from None


def _decode(data: bytes, path: str, line_of_offset) -> str:
    # A byte-order mark at the very start is valid UTF-8 framing, not content: drop it
    # (json.loads refuses a str starting with U+FEFF). Error offsets stay in file bytes.
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        start = exc.start + bom
        line, col = line_of_offset(start)
        raise IngestError(f"{path}:{line}: not UTF-8 (byte 0x{data[start]:02x} at column {col})") from None


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _deepest_line(text: str) -> int:
    """The line where JSON `text` first nests deepest (brackets inside strings skipped)."""
    depth, deepest, at = 0, 0, 0
    for token in _JSON_TOKEN.finditer(text):
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(token.group(), 0)
        if depth > deepest:
            deepest, at = depth, token.start()
    return text.count("\n", 0, at) + 1


def iter_records(path: str, file_type: str = "auto") -> Iterator[tuple[str, Any]]:
    """(location, record) pairs; location is `file:line` or `file:row N`. The record is a
    Skip where a line is valid JSON that cannot be read as a record (`too_deep`)."""
    kind = _file_type(path, file_type)
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(io.BytesIO(_open_bytes(path)))
        except Exception as exc:  # noqa: BLE001 - arrow raises many types for a bad file
            if isinstance(exc, IngestError):
                raise
            raise IngestError(f"{path}: not a readable Parquet file ({exc})") from None
        for i, row in enumerate(table.to_pylist()):
            yield f"{path}:row {i}", row
        return
    data = _open_bytes(path)

    def line_of(offset: int) -> tuple[int, int]:
        before = data[:offset]
        return before.count(b"\n") + 1, offset - (before.rfind(b"\n") + 1) + 1

    text = _decode(data, path, line_of)
    if kind == "json":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise IngestError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg}, column {exc.colno})") from None
        except RecursionError:  # one list: no record can be skipped alone, as a JSONL line is
            raise IngestError(
                f"{path}:{_deepest_line(text)}: JSON nested deeper than Python's parser goes "
                f"(~{sys.getrecursionlimit()} levels); drop that record, or write the file as JSONL "
                "(one record a line), where such a record is a counted too_deep skip"
            ) from None
        if isinstance(records, dict) and isinstance(records.get("data"), list):
            records = records["data"]
        if not isinstance(records, list):
            raise IngestError(f'{path}: a JSON file must hold a list of records (or {{"data": [...]}})')
        for i, record in enumerate(records):
            yield f"{path}:record {i}", record
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise IngestError(f"{path}:{lineno}: malformed JSON ({exc.msg}, column {exc.colno})") from None
        except RecursionError:
            # Valid JSON, but past what Python's parser can nest: like a lone surrogate, no
            # conversation a target takes, so one such line is a counted skip, not a lost file.
            record = Skip("too_deep", f"nested deeper than Python's JSON parser goes (~{sys.getrecursionlimit()})")
        yield f"{path}:{lineno}", record


# ----------------------------------------------------------------------------- normalising


def _turns(items, role_key, text_key, roles, openai=False) -> tuple[list[dict], int]:
    """Messages of a conversation and the number of non-text parts dropped from its content
    lists; `openai` reads the OpenAI tool layouts, else ShareGPT's."""
    if not isinstance(items, list) or not items:
        raise Skip("empty_conversation")
    out, dropped = [], 0
    for k, turn in enumerate(items):
        if not isinstance(turn, dict) or not isinstance(turn.get(role_key), str):
            raise Skip("missing_role_or_content", f"turn {k}")
        given = turn[role_key].strip().lower()
        role = roles.get(given)
        if role is None:
            raise Skip("unknown_role", f"turn {k}: {turn[role_key]!r}")
        where = f"turn {k}"
        if role == "assistant" and openai:
            message, n = tool_turns.openai_assistant(turn, where)
        elif role == "tool" and openai:
            message, n = tool_turns.openai_tool(turn, where), 0
        else:
            # A ShareGPT value may be a list of parts too (converted OpenAI sets write them).
            text, n = content_text(turn.get(text_key), where)
            if given == "function_call":  # ShareGPT: the value is the call, as JSON
                message = new_message("assistant", "", tool_calls=tool_turns.json_calls(text, where))
            elif role == "assistant" and not openai:
                message = tool_turns.sharegpt_assistant(text, where)
            elif role == "tool" and not openai:
                out += [new_message("tool", r) for r in tool_turns.tool_results(text)]
                continue
            else:
                message = new_message(role, text)
        dropped += n
        if isinstance(turn.get("reasoning_content"), str) and turn["reasoning_content"]:
            message["reasoning_content"] = turn["reasoning_content"]
        if out and _merges(out[-1], message):  # a text turn, then its call as a turn of its own
            out[-1]["tool_calls"] = message["tool_calls"]
            continue
        out.append(message)
    return out, dropped


def _merges(previous: dict, message: dict) -> bool:
    return (
        previous["role"] == "assistant"
        and message["role"] == "assistant"
        and not previous.get("tool_calls")
        and bool(message.get("tool_calls"))
        and not message["content"]
    )


def _check_order(body: list[dict]) -> None:
    """Turns follow one another as a served conversation does: user, then assistant; an
    assistant's calls are answered by one or more tool results, then the assistant again."""
    prev = None
    for k, m in enumerate(body):
        role = m["role"]
        if prev is None:
            expected = {"user"}
        elif prev["role"] == "user":
            expected = {"assistant"}
        elif prev["role"] == "tool":
            expected = {"tool", "assistant"}
        elif prev.get("tool_calls"):
            expected = {"tool"}
        else:
            expected = {"user"}
        if role not in expected:
            if role == "tool":
                raise Skip("tool_result_without_call", f"turn {k}: a tool result answering no call")
            if "tool" in expected and len(expected) == 1:
                raise Skip("tool_call_without_result", f"turn {k}: {role} after a tool call, expected its result")
            raise Skip("non_alternating_roles", f"turn {k} is {role}, expected {' or '.join(sorted(expected))}")
        prev = m


def normalise(
    record: Any, fmt: str, location: str, prompt_field: str = "prompt", tools_field: str = "tools"
) -> tuple[list[dict], int, list[dict] | None]:
    """Messages of one record, the number of non-text content parts dropped from it and its
    tool definitions (None without); raises IngestError (fatal) or Skip (counted)."""
    if not isinstance(record, dict):
        raise IngestError(f"{location}: a record must be a JSON object, got {type(record).__name__}")
    fields = {**FORMAT_FIELD, "prompts": prompt_field}
    if fmt == "auto":
        fmt = next((f for f, key in fields.items() if key in record), None)
        if fmt is None:
            raise IngestError(f"{location}: no 'conversations', 'messages' or {prompt_field!r} field")
    key = fields[fmt]
    if key not in record:
        raise IngestError(f"{location}: missing field {key!r} (format {fmt})")
    dropped = 0
    if fmt == "sharegpt":
        messages, dropped = _turns(record[key], "from", "value", SHAREGPT_ROLES)
    elif fmt == "openai":
        messages, dropped = _turns(record[key], "role", "content", OPENAI_ROLES, openai=True)
    else:
        if not isinstance(record[key], str):
            raise IngestError(f"{location}: field {key!r} must be a string")
        if not record[key].strip():
            raise Skip("empty_prompt")
        messages = [{"role": "user", "content": record[key], "reasoning_content": None}]
        if isinstance(record.get("system"), str) and record["system"].strip():
            messages.insert(0, {"role": "system", "content": record["system"], "reasoning_content": None})
    tools = tool_turns.tool_list(record.get(tools_field), location)
    for k, m in enumerate(messages):
        for name in ("content", "reasoning_content"):
            if m[name] is not None and not _encodable(m[name]):
                # Valid JSON ("\ud800") but no text: it can be neither tokenized nor stored.
                raise Skip("lone_surrogate", f"turn {k} {name}: a lone UTF-16 surrogate (a broken emoji?)")
        if m.get("tool_calls") and not _encodable(json.dumps(m["tool_calls"], ensure_ascii=False)):
            raise Skip("lone_surrogate", f"turn {k} tool_calls: a lone UTF-16 surrogate")
    if tools and not _encodable(json.dumps(tools, ensure_ascii=False)):
        raise Skip("lone_surrogate", f"field {tools_field!r}: a lone UTF-16 surrogate")
    body = messages[1:] if messages[0]["role"] == "system" else messages
    if not any(m["role"] == "user" for m in body):
        raise Skip("empty_conversation", "no user turn")
    _check_order(body)
    return messages, dropped, tools


def has_tool_turns(messages: list[dict], tools: list[dict] | None = None) -> bool:
    return bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def prompt_key(messages: list[dict], tools: list[dict] | None = None) -> str:
    """Content hash of what is sent to the target (system, user and tool turns, the tools
    and the calls the results answer)."""
    sent: list = [[m["role"], m["content"]] for m in messages if m["role"] != "assistant"]
    calls = [m["tool_calls"] for m in messages if m.get("tool_calls")]
    if tools or calls:  # only then: the keys of conversations without tools stay as they were
        sent.append({"tools": tools, "calls": calls})
    return hashlib.sha256(json.dumps(sent, ensure_ascii=False).encode()).hexdigest()


# ----------------------------------------------------------------------------- mixture


def row_split(record: dict, location: str, split: str, sample_id: str, heldout_fraction: float) -> str:
    """The dataset's fixed split, the id hash's (auto), or the record's own (record)."""
    if split == "record":
        own = record.get("split")
        if own not in ("train", "heldout"):
            raise IngestError(
                f"{location}: field 'split' must be 'train' or 'heldout' (the dataset's split is 'record'), got {own!r}"
            )
        return own
    return split if split != "auto" else split_of(sample_id, heldout_fraction)


def ingest_dataset(
    name: str,
    path: str,
    fmt: str,
    file_type: str,
    limit: int | None,
    weight: float,
    split: str,
    heldout_fraction: float,
    seen: set[str],
    log=print,
    prompt_field: str = "prompt",
    tools_field: str = "tools",
) -> tuple[list[dict], Counter]:
    """Normalised rows of one dataset plus its counts (read, kept, skipped_<reason>)."""
    rows, counts = [], Counter()
    first_seen: dict[str, str] = {}
    for location, record in iter_records(path, file_type):
        if limit is not None and len(rows) >= limit:
            break
        counts["records"] += 1
        try:
            if isinstance(record, Skip):  # read, but not as a record (iter_records)
                raise record
            messages, dropped_parts, tools = normalise(record, fmt, location, prompt_field, tools_field)
            if isinstance(record.get("id"), str) and not _encodable(record["id"]):
                raise Skip("lone_surrogate", "field 'id': a lone UTF-16 surrogate")
        except Skip as skip:
            counts[f"skipped_{skip.reason}"] += 1
            first_seen.setdefault(skip.reason, f"{location} {skip.detail}".strip())
            continue
        key = prompt_key(messages, tools)
        own = record.get("id")
        sample_id = f"{name}:{own}" if isinstance(own, (str, int)) and str(own) else f"{name}:{key[:16]}"
        if weight < 1.0 and hash_fraction("weight:" + sample_id) >= weight:
            counts["skipped_weight_sampled_out"] += 1
            continue
        if key in seen:
            counts["skipped_duplicate"] += 1
            first_seen.setdefault("duplicate", location)
            continue
        seen.add(key)
        if dropped_parts:  # counted for kept conversations only: a skipped record counts once
            counts["skipped_non_text_part"] += dropped_parts
            first_seen.setdefault("non_text_part", location)
        row = {
            "id": sample_id,
            "dataset": name,
            "split": row_split(record, location, split, sample_id, heldout_fraction),
            "messages": messages,
        }
        if tools:
            row["tools"] = tools
        if has_tool_turns(messages, tools):
            counts["tool_conversations"] += 1
        rows.append(row)
    for reason, where in first_seen.items():
        unit = "content part(s)" if reason == "non_text_part" else "record(s)"
        log(f"ingest {name}: skipped {counts['skipped_' + reason]} {unit} for {reason}, first at {where}")
    ids = Counter(r["id"] for r in rows)
    dup_ids = [i for i, n in ids.items() if n > 1]
    if dup_ids:
        raise IngestError(f"{path}: id {dup_ids[0]!r} is used by {ids[dup_ids[0]]} different records")
    counts["conversations"] = len(rows)
    return rows, counts


def require_conversations(name: str, paths: list[str], counts: Counter) -> None:
    """A dataset of the mixture that yields no conversation is a mistake (wrong path, wrong
    format, all filtered out): stop, naming it, its file(s) and what was skipped for what."""
    if counts["conversations"] > 0:
        return
    files = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    skips = ", ".join(
        f"{k.removeprefix('skipped_')}={v}" for k, v in sorted(counts.items()) if k.startswith("skipped_") and v
    )
    raise IngestError(
        f"dataset {name!r} ({files}) yields no conversation: {counts['records']} record(s) read, "
        f"skipped: {skips or 'none (the file holds no record)'}"
    )


def messages_type():
    import pyarrow as pa

    # Tool calls are JSON text in the table: their arguments are free-form objects, which a
    # fixed Arrow struct cannot hold. decode_row turns the stored row back into the dict.
    fields = ["role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name"]
    return pa.list_(pa.struct([(f, pa.string()) for f in fields]))


def _encode_message(m: dict) -> dict:
    calls = m.get("tool_calls")
    return {**m, "tool_calls": json.dumps(calls, ensure_ascii=False) if calls else None}


def write_normalised(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "id": pa.array([r["id"] for r in rows], pa.string()),
            "dataset": pa.array([r["dataset"] for r in rows], pa.string()),
            "split": pa.array([r["split"] for r in rows], pa.string()),
            "messages": pa.array([[_encode_message(m) for m in r["messages"]] for r in rows], messages_type()),
            "tools": pa.array(
                [json.dumps(r["tools"], ensure_ascii=False) if r.get("tools") else None for r in rows], pa.string()
            ),
        }
    )
    pq.write_table(table, path)


def decode_row(row: dict) -> dict:
    """A row of prompts.parquet as ingestion made it: tool fields only where present."""
    messages = []
    for m in row["messages"]:
        out = {k: m[k] for k in ("role", "content", "reasoning_content")}
        if m.get("tool_calls"):
            out["tool_calls"] = json.loads(m["tool_calls"])
        out.update({k: m[k] for k in ("tool_call_id", "name") if m.get(k)})
        messages.append(out)
    decoded = {**row, "messages": messages}
    tools = decoded.pop("tools", None)
    if tools:
        decoded["tools"] = json.loads(tools)
    return decoded


def read_normalised(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return [decode_row(r) for r in pq.read_table(path).to_pylist()]


def expand_paths(path: str) -> list[str]:
    """A path, URL or glob pattern -> the files it names (sorted; a glob must match something)."""
    if not any(ch in path for ch in "*?["):
        return [path]
    import fsspec

    try:
        fs, _, paths = fsspec.core.get_fs_token_paths(path)
    except OSError as exc:  # unreachable store, offline Hub, missing credentials
        raise IngestError(f"{path}: cannot list the files ({exc})") from None
    if not paths:
        raise IngestError(f"{path}: the pattern matches no file")
    return [fs.unstrip_protocol(p) if "://" in path else p for p in sorted(paths)]
