"""Tool calls as a target writes them: which format a chat template uses, and a parser per format.

A conversation carries its tool calls in one internal form, the one Hugging Face chat
templates take: an assistant message with `tool_calls = [{"type": "function", "function":
{"name": str, "arguments": dict}}]`. The target's template turns them into text, and each
template family writes them its own way:

* `hermes` (Hermes, Qwen2.5, Qwen3 and the tiny target's template): one
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block per call, any whitespace
  around the JSON, after the turn's text.
* `kimi_k2` (Kimi-K2 / K2.5): `<|tool_calls_section_begin|>`, then per call
  `<|tool_call_begin|>functions.<name>:<index><|tool_call_argument_begin|>{json}<|tool_call_end|>`,
  then `<|tool_calls_section_end|>`.

The family is told from the template itself (`detect_family`: a probe call rendered through
it), never from the model's name, so a fine-tune that kept its base's template is known.
A template that renders a probe call in any other way is refused by name: parsing a format
by guesswork would let the draft train on calls the rule could not compare.

`parse(family, text)` gives (the turn's text before its calls, the calls); it raises
ToolCallSyntaxError for text that opens a call it cannot read (broken JSON, an unclosed
block), which regeneration counts as a call that differs from the dataset's.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable


class ToolCallSyntaxError(ValueError):
    """Text that starts a tool call in the family's markup but cannot be read as one."""


class UnknownToolFormat(ValueError):
    """The chat template writes tool calls in a format no parser here reads."""


def call(name: str, arguments: dict) -> dict:
    """One call in the internal form."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def signature(calls: list[dict] | None) -> list[tuple[str, str]]:
    """What two lists of calls are compared on: names and arguments, in order (arguments
    as canonical JSON, so key order and spacing do not count)."""
    return [
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True, ensure_ascii=False))
        for c in calls or []
    ]


def _arguments(value: Any, where: str) -> dict:
    if isinstance(value, str):  # some writers give the arguments as a JSON string
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise ToolCallSyntaxError(f"{where}: arguments are not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ToolCallSyntaxError(f"{where}: arguments must be a JSON object, got {type(value).__name__}")
    return value


# ----------------------------------------------------------------------------- hermes

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def tagged_blocks(text: str, open_tag: str, close_tag: str) -> tuple[str, list[str]]:
    """(text before the first block, payload of each `open ... close` block). Raises
    ToolCallSyntaxError for an unclosed block or text between or after the blocks."""
    start = text.find(open_tag)
    if start < 0:
        return text, []
    before, rest, payloads = text[:start], text[start:], []
    while rest.strip():
        rest = rest.lstrip()
        if not rest.startswith(open_tag):
            raise ToolCallSyntaxError(f"text after a tool call: {rest[:40]!r}")
        end = rest.find(close_tag)
        if end < 0:
            raise ToolCallSyntaxError(f"a {open_tag} block is not closed")
        payloads.append(rest[len(open_tag) : end])
        rest = rest[end + len(close_tag) :]
    return before, payloads


def hermes_payload(payload: str, where: str, loads: Callable[[str], Any] = json.loads) -> dict:
    try:
        obj = loads(payload.strip())
    except (ValueError, SyntaxError) as exc:
        raise ToolCallSyntaxError(f"{where}: not a JSON object ({exc})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ToolCallSyntaxError(f"{where}: a call needs a string 'name'")
    return call(obj["name"], _arguments(obj.get("arguments", {}), where))


def parse_hermes(text: str) -> tuple[str, list[dict]]:
    before, payloads = tagged_blocks(text, HERMES_OPEN, HERMES_CLOSE)
    return before, [hermes_payload(p, f"tool call {k}") for k, p in enumerate(payloads)]


# ----------------------------------------------------------------------------- kimi_k2

KIMI_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
KIMI_CALL = re.compile(
    r"\s*<\|tool_call_begin\|>\s*(?P<id>(?:functions\.)?(?P<name>[^\s:<]+):\d+)\s*<\|tool_call_argument_begin\|>"
    r"(?P<args>.*?)<\|tool_call_end\|>",
    re.S,
)


def parse_kimi_k2(text: str) -> tuple[str, list[dict]]:
    before, sections = tagged_blocks(text, *KIMI_SECTION)
    calls = []
    for section in sections:
        pos = 0
        for m in KIMI_CALL.finditer(section):
            if section[pos : m.start()].strip():
                raise ToolCallSyntaxError(
                    f"unreadable text in the tool-call section: {section[pos : m.start()][:40]!r}"
                )
            # The id (`functions.<name>:<k>`) is kept: the template writes the call back by it.
            calls.append({**call(m["name"], _arguments(m["args"], f"tool call {len(calls)}")), "id": m["id"]})
            pos = m.end()
        if section[pos:].strip():
            raise ToolCallSyntaxError(f"unreadable text in the tool-call section: {section[pos:][:40]!r}")
    return before, calls


PARSERS: dict[str, Callable[[str], tuple[str, list[dict]]]] = {"hermes": parse_hermes, "kimi_k2": parse_kimi_k2}
# What a family's rendering of a call holds and no other's does.
MARKERS = {"hermes": HERMES_OPEN, "kimi_k2": "<|tool_call_begin|>"}


def parse(family: str, text: str) -> tuple[str, list[dict]]:
    if family not in PARSERS:
        raise UnknownToolFormat(f"no tool-call parser for template family {family!r} (known: {sorted(PARSERS)})")
    return PARSERS[family](text)


PROBE_NAME = "probe_lookup_weather"
PROBE_ARGUMENTS = {"city": "Oslo", "days": 3}


def family_of_rendering(text: str) -> str | None:
    """The family whose markup a rendered probe call shows; None when the call's name is not
    in the text at all (the template drops tool calls)."""
    if PROBE_NAME not in text:
        return None
    found = [family for family, marker in MARKERS.items() if marker in text]
    if len(found) != 1:
        raise UnknownToolFormat(
            "the template writes tool calls in a format no parser here reads "
            f"(known: {sorted(PARSERS)}); rendered probe: {text[-160:]!r}"
        )
    return found[0]
