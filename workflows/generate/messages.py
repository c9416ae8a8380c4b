"""The normalised message and the counted skip: what every reader of a conversation layout
(plain turns in `ingest`, tool turns in `tool_turns`) builds or raises."""

from __future__ import annotations

from typing import Any


class Skip(Exception):
    """A record left out and counted by `reason` in the accounting table; `detail` says
    where (the first of each reason is logged)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


TEXT_PART_TYPES = {"text", "input_text"}  # the part types SGLang keeps as text
PART_SEPARATOR = " "  # SGLang 0.5.23 joins the text parts of a list content with one space


def content_text(content: Any, where: str) -> tuple[str, int]:
    """(text, number of non-text parts dropped) of one turn's content: a string, or an
    OpenAI list of parts whose text parts are joined with PART_SEPARATOR."""
    if isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        raise Skip("missing_role_or_content", f"{where}: {_json_kind(content)}, not text or a list of parts")
    texts, dropped = [], 0
    for part in content:
        if isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES:
            if not isinstance(part.get("text"), str):
                raise Skip("missing_role_or_content", f"{where}: a text part without a string 'text'")
            texts.append(part["text"])
        else:
            dropped += 1  # image_url, input_audio, file, ...: nothing a text target can read
    if not texts:
        raise Skip("missing_role_or_content", f"{where}: no text part")
    return PART_SEPARATOR.join(texts), dropped


def _json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words (the skip's detail is read by whoever wrote it)."""
    if value is None:
        return "null or missing"
    if isinstance(value, bool):
        return "a boolean"
    return "a number" if isinstance(value, (int, float)) else "an object"


def new_message(role: str, content: str, **extra) -> dict:
    """A normalised message: role, content, reasoning_content, and the tool fields only
    where the turn has them (a conversation without tools is stored as it always was)."""
    return {"role": role, "content": content, "reasoning_content": None, **{k: v for k, v in extra.items() if v}}
