"""Tool turns (agentic conversations) read out of the layouts datasets use, into the one
internal form that Hugging Face chat templates take, so that the target's own template
writes the calls and results as it does when served:
* an assistant message may carry `tool_calls`: [{"type": "function", "function":
  {"name": str, "arguments": dict}, "id"?: str}] (arguments given as a JSON string are parsed);
* a `tool` message holds one result as text, with `tool_call_id` and/or `name` when given;
* the record's `tools` (field `tools_field`): a list of {"type": "function", "function":
  {name, description?, parameters?}}, given as a list or as a JSON string.
Calls written inside an assistant's text (Hermes `<tool_call>` blocks, whose payload is
JSON or a Python dict literal, and glaive's `<functioncall> {...}`) are read out of the
text into `tool_calls`; a tool result wrapped in Hermes `<tool_response>` blocks is
unwrapped (one message per block): the target's template adds its own markup.
Unreadable calls, arguments and tool lists are counted skips (`bad_tool_call`,
`bad_tool_arguments`, `bad_tools`), never fatal: one bad record does not stop a mixture.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from eagle3 import tool_calls
from workflows.generate.messages import TEXT_PART_TYPES, Skip, content_text, new_message


def _call(obj: Any, where: str) -> dict:
    """One call in the internal form from an OpenAI `tool_calls` item, an older
    `function_call`, or a bare {"name", "arguments"} object."""
    if not isinstance(obj, dict):
        raise Skip("bad_tool_call", f"{where}: a tool call must be an object")
    fn = obj.get("function", obj)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
        raise Skip("bad_tool_call", f"{where}: a tool call without a function name")
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise Skip("bad_tool_arguments", f"{where}: arguments of {fn['name']!r} are not JSON ({exc.msg})") from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise Skip("bad_tool_arguments", f"{where}: arguments of {fn['name']!r} are not a JSON object")
    out = tool_calls.call(fn["name"], args)
    if isinstance(obj.get("id"), str) and obj["id"]:
        out["id"] = obj["id"]
    return out


def json_calls(text: str, where: str) -> list[dict]:
    """A ShareGPT `function_call` value: one call object, or a list of them, as JSON."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        raise Skip("bad_tool_call", f"{where}: a function_call turn whose value is not JSON") from None
    objs = obj if isinstance(obj, list) else [obj]
    if not objs:
        raise Skip("bad_tool_call", f"{where}: a function_call turn with no call")
    return [_call(o, where) for o in objs]


def _literal(payload: str) -> Any:
    """A call written in a text: JSON, else a Python literal (Hermes' sets write dicts with
    single quotes); literal_eval evaluates no code."""
    try:
        return json.loads(payload)
    except json.JSONDecodeError:
        return ast.literal_eval(payload)


GLAIVE_CALL = "<functioncall>"


def sharegpt_assistant(text: str, where: str) -> dict:
    if GLAIVE_CALL in text:
        before, _, payload = text.partition(GLAIVE_CALL)
        payload = payload.strip().removesuffix("<|endoftext|>").strip()
        try:
            return new_message("assistant", before.rstrip(), tool_calls=[_call(_literal(payload), where)])
        except (ValueError, SyntaxError):
            raise Skip("bad_tool_call", f"{where}: an unreadable {GLAIVE_CALL} call") from None
    try:
        before, payloads = tool_calls.tagged_blocks(text, tool_calls.HERMES_OPEN, tool_calls.HERMES_CLOSE)
        objs = [_literal(p.strip()) for p in payloads]
    except (tool_calls.ToolCallSyntaxError, ValueError, SyntaxError) as exc:
        raise Skip("bad_tool_call", f"{where}: an unreadable <tool_call> block ({exc})") from None
    if not objs:
        return new_message("assistant", text)
    return new_message("assistant", before.rstrip(), tool_calls=[_call(o, where) for o in objs])


def tool_results(text: str) -> list[str]:
    """A tool turn's results: the payloads of its `<tool_response>` blocks when the text is
    made of them, else the text as one result."""
    try:
        before, payloads = tool_calls.tagged_blocks(text, "<tool_response>", "</tool_response>")
    except tool_calls.ToolCallSyntaxError:
        return [text]
    if not payloads or before.strip():
        return [text]
    return [p.strip() for p in payloads]


def openai_assistant(turn: dict, where: str) -> tuple[dict, int]:
    content = turn.get("content")
    calls = turn.get("tool_calls")
    if calls is None and turn.get("function_call") is not None:
        calls = [turn["function_call"]]
    if calls is not None and not isinstance(calls, list):
        raise Skip("bad_tool_call", f"{where}: tool_calls must be a list")
    parsed = [_call(c, f"{where} call {j}") for j, c in enumerate(calls or [])]
    if content is None and parsed:  # OpenAI writes null content beside the calls
        return new_message("assistant", "", tool_calls=parsed), 0
    if isinstance(content, list) and not content and parsed:
        return new_message("assistant", "", tool_calls=parsed), 0
    text, n = content_text(content, where)
    return new_message("assistant", text, tool_calls=parsed), n


def openai_tool(turn: dict, where: str) -> dict:
    content = turn.get("content")
    if isinstance(content, (dict, list)) and not (
        isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PART_TYPES for p in content)
    ):
        content = json.dumps(content, ensure_ascii=False)  # a structured result: its JSON text
    text, _ = content_text(content, where)
    ids = {k: turn[k] for k in ("tool_call_id", "name") if isinstance(turn.get(k), str) and turn[k]}
    return new_message("tool", text, **ids)


def tool_list(value: Any, location: str) -> list[dict] | None:
    """The record's tool definitions in the internal form; None when it has none."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise Skip("bad_tools", f"the tool list is not JSON ({exc.msg})") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise Skip("bad_tools", "the tool list must be a list of function definitions")
    out = []
    for j, tool in enumerate(value):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise Skip("bad_tools", f"tool {j}: a function definition needs a 'name'")
        if isinstance(fn.get("parameters"), str):  # some sets store the schema as a JSON string
            try:
                fn = {**fn, "parameters": json.loads(fn["parameters"])}
            except json.JSONDecodeError:
                raise Skip("bad_tools", f"tool {j}: parameters are not JSON") from None
        out.append({"type": "function", "function": fn})
    return out or None
