"""Chat templates and assistant loss masks (pure logic over a HF tokenizer, no I/O).

A conversation is rendered with the target tokenizer's *own* chat template and tokenized
once, whole, so the tokens are exactly those the target sees when serving. The loss mask is
1 on the tokens of every assistant turn and 0 elsewhere (system, user, template markup).

Where the assistant text sits in the rendered string is found from the template itself:
for assistant message `i`, rendering `messages[:i]` with the generation prompt must give a
prefix of the whole rendering, and the assistant text must follow it verbatim. Tokens are
then mapped to those character spans through the fast tokenizer's offsets.

End of turn: the mask also covers the single token the template emits right after the
assistant text when it is a special token (ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`),
because the draft must learn when the target stops. Callers may leave it out per turn (an
answer cut at max_new_tokens never produced it).

Round trip: the masked tokens of each turn must decode back to exactly the assistant text
(plus the end-of-turn token when included). A template for which this fails (it rewrites
the text, a token straddles the turn boundary, the generation prompt is not a prefix) is
refused with an error naming the template and the first mismatching turn.

Tool turns: a conversation's `tools` go to the template as `tools=`, an assistant turn's
`tool_calls` (eagle3.tool_calls' internal form) and `tool` results as messages, so the
template writes them as the target is served them. What an assistant turn with calls
writes (its text, then its calls in the template's markup) is not known beforehand: it is
the template's rendering of that turn, from the end of the generation prompt to the
closing markup the template puts after any assistant text (found by rendering the same
history with a sentinel answer). It is masked whole, with its end-of-turn token; the tool
list in the system turn and the tool results are never masked. The round trip covers them:
the written text must parse back (eagle3.tool_calls, the template's family) to the turn's
text and calls, each tool result must appear verbatim after the call it answers, and each
tool's name must appear in the prompt. A template that cannot (it drops the calls, the
results or the tool list, or raises) is refused naming the turn.

Reasoning: when kept, an assistant turn's `reasoning_content` is placed before its
content as `<think>\\n{reasoning}\\n</think>\\n\\n{content}` and masked with it.
TODO: templates that render `reasoning_content` natively (Qwen3, DeepSeek-R1) and drop it
from earlier turns are not special-cased; they are checked (and refused) by the round trip.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from eagle3 import tool_calls as tc

THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"


class TemplateError(ValueError):
    """The chat template cannot give an exact assistant mask for this conversation."""


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    # Per assistant turn: [start, end) token span of its masked tokens (end-of-turn included).
    turn_spans: list[tuple[int, int]]


def template_name(tokenizer) -> str:
    """A readable handle for error messages: the tokenizer's name plus the template hash."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates: the default one is used
        template = template.get("default", "")
    digest = hashlib.sha256(template.encode()).hexdigest()[:12]
    return f"{getattr(tokenizer, 'name_or_path', '?')} (chat template sha256 {digest})"


def assistant_text(message: dict, keep_reasoning: bool = True) -> str:
    """The text an assistant turn contributes, reasoning first when kept."""
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content")
    if keep_reasoning and reasoning:
        return f"{THINK_OPEN}{reasoning}{THINK_CLOSE}{content}"
    return content


TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")


def _plain(messages: Sequence[dict], keep_reasoning: bool) -> list[dict]:
    """Messages as the template sees them: role and content (reasoning inlined), plus the
    tool fields a turn has.

    Calls without an id get `functions.<name>:<k>` (k counts the conversation's calls), and
    results without a `tool_call_id` the id of the call they answer, in order, as a client
    hands them back when served: some templates write a call by its id (Kimi-K2's does,
    in that very form) or a result by its call's id; the others ignore ids."""
    out, pending, k = [], [], 0
    for m in messages:
        text = assistant_text(m, keep_reasoning) if m["role"] == "assistant" else m["content"]
        message = {"role": m["role"], "content": text, **{f: m[f] for f in TOOL_FIELDS if m.get(f)}}
        if message.get("tool_calls"):
            calls = []
            for c in message["tool_calls"]:
                calls.append(c if c.get("id") else {**c, "id": f"functions.{c['function']['name']}:{k}"})
                k += 1
            message["tool_calls"], pending = calls, [c["id"] for c in calls]
        elif m["role"] == "tool" and pending:
            answered = pending.pop(0)
            message.setdefault("tool_call_id", answered)
        out.append(message)
    return out


def render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = False, **template_kwargs: Any) -> str:
    if not template_kwargs.get("tools"):
        template_kwargs.pop("tools", None)  # only a conversation with tools hands them over
    try:
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
    except Exception as exc:  # noqa: BLE001 - jinja raises many types; say which turn it choked on
        if not any(m["role"] == "tool" or m.get("tool_calls") for m in messages) and not template_kwargs.get("tools"):
            raise
        k = _first_failing(tokenizer, messages, template_kwargs)
        raise TemplateError(
            f"{template_name(tokenizer)}: the template cannot render tool turns (message {k}, "
            f"{messages[k]['role']}: {type(exc).__name__}: {str(exc)[:120]})"
        ) from None


def _first_failing(tokenizer, messages: Sequence[dict], template_kwargs: dict) -> int:
    """The first message whose rendering (with those before it) raises: the turn to name."""
    for k in range(len(messages)):
        try:
            tokenizer.apply_chat_template(list(messages[: k + 1]), tokenize=False, **template_kwargs)
        except Exception:  # noqa: BLE001 - as in render
            return k
    return len(messages) - 1


def generation_prompt_ids(tokenizer, messages: Sequence[dict], **template_kwargs: Any) -> list[int]:
    """Token ids of `messages` followed by the template's assistant header (what to generate from)."""
    text = render(tokenizer, _plain(messages, keep_reasoning=True), add_generation_prompt=True, **template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assistant_char_spans(
    tokenizer, messages: Sequence[dict], keep_reasoning: bool = True, **template_kwargs: Any
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of each assistant
    text (for a turn with tool calls: its text and the calls as the template writes them)."""
    plain = _plain(messages, keep_reasoning)
    full = render(tokenizer, plain, **template_kwargs)
    name = template_name(tokenizer)
    _check_tool_list(tokenizer, plain, full, template_kwargs.get("tools"))
    spans = []
    for i, m in enumerate(plain):
        if m["role"] == "tool":
            _check_tool_result(tokenizer, plain, i, spans[-1][1] if spans else 0, full, template_kwargs)
        if m["role"] != "assistant":
            continue
        turn = len(spans)
        prefix = render(tokenizer, plain[:i], add_generation_prompt=True, **template_kwargs)
        if not full.startswith(prefix):
            raise TemplateError(
                f"{name}: assistant turn {turn} (message {i}): the rendering of the "
                f"messages before it plus the generation prompt is not a prefix of the whole conversation; "
                f"cannot locate the assistant text"
            )
        written = m["content"]
        if m.get("tool_calls"):
            written = written_with_calls(tokenizer, plain, i, prefix, template_kwargs)
            family = tool_family(tokenizer, **template_kwargs)
            _check_calls(name, turn, i, family, written, m)
        start, end = len(prefix), len(prefix) + len(written)
        if full[start:end] != written:
            raise TemplateError(
                f"{name}: assistant turn {turn} (message {i}): the template does not "
                f"render the assistant text verbatim (expected {written[:60]!r}, "
                f"found {full[start:end][:60]!r})"
            )
        spans.append((start, end))
    return full, spans


SENTINEL = "\u2063sentinel answer\u2063"  # text no template rewrites and no conversation holds


def template_messages(messages: Sequence[dict], keep_reasoning: bool = True) -> list[dict]:
    """Messages as they are handed to the template (see _plain)."""
    return _plain(messages, keep_reasoning)


def written_with_calls(tokenizer, plain: list[dict], i: int, prefix: str, template_kwargs: dict) -> str:
    """What assistant message i (one with tool calls) writes: its rendering after the
    generation prompt, less the closing markup the template puts after a plain answer
    (`plain`: messages as template_messages gives them)."""
    name = template_name(tokenizer)
    upto = render(tokenizer, plain[: i + 1], **template_kwargs)
    probe = render(tokenizer, [*plain[:i], {"role": "assistant", "content": SENTINEL}], **template_kwargs)
    if not upto.startswith(prefix) or not probe.startswith(prefix + SENTINEL):
        raise TemplateError(
            f"{name}: assistant message {i} with tool calls: the generation prompt is not a prefix of its "
            "rendering; cannot locate what the assistant writes"
        )
    closing = probe[len(prefix) + len(SENTINEL) :]
    written = upto[len(prefix) :]
    if closing and not written.endswith(closing):
        raise TemplateError(
            f"{name}: assistant message {i} with tool calls does not end with the template's closing "
            f"markup {closing[:40]!r}; cannot locate what the assistant writes"
        )
    return written[: len(written) - len(closing)]


def _check_calls(name: str, turn: int, i: int, family: str, written: str, m: dict) -> None:
    try:
        before, calls = tc.parse(family, written)
    except tc.ToolCallSyntaxError as exc:
        raise TemplateError(
            f"{name}: assistant turn {turn} (message {i}): the rendered tool calls do not parse back ({exc})"
        ) from None
    if tc.signature(calls) != tc.signature(m["tool_calls"]) or before.strip() != (m["content"] or "").strip():
        raise TemplateError(
            f"{name}: assistant turn {turn} (message {i}): the template does not render the turn's text and "
            f"tool calls faithfully (rendered {written[:80]!r})"
        )


def _check_tool_result(tokenizer, plain: list[dict], i: int, after: int, full: str, template_kwargs: dict) -> None:
    """Tool result i must be in the rendering, verbatim, after the call it answers."""
    content = plain[i]["content"]
    if content and full.find(content, after) < 0:
        raise TemplateError(
            f"{template_name(tokenizer)}: tool message {i}: the template does not render the tool result "
            f"verbatim ({content[:60]!r} is not in the rendering after the call)"
        )


def _check_tool_list(tokenizer, plain: list[dict], full: str, tools: list[dict] | None) -> None:
    """Every tool the conversation offers must be named in what the target is shown before
    its first answer (not only in the calls it later makes)."""
    if not tools:
        return
    first_user = next((k for k, m in enumerate(plain) if m["role"] == "user"), len(plain) - 1)
    shown = render(tokenizer, plain[: first_user + 1], add_generation_prompt=True, tools=tools)
    for tool in tools:
        fn = tool.get("function", tool)
        if fn["name"] not in shown:
            raise TemplateError(
                f"{template_name(tokenizer)}: the template does not render the tool list "
                f"(tool {fn['name']!r} is not in the rendering)"
            )


TOOL_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": tc.PROBE_NAME,
            "description": "Forecast of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]
_FAMILIES: dict[str, str] = {}


def tool_family(tokenizer, **template_kwargs: Any) -> str:
    """The tool-call family (eagle3.tool_calls) of the tokenizer's template, from a probe
    call rendered through it; TemplateError when it drops calls or writes an unknown format."""
    name = template_name(tokenizer)
    if name in _FAMILIES:
        return _FAMILIES[name]
    kwargs = {**template_kwargs, "tools": TOOL_PROBE_TOOLS}
    plain = _plain(
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [tc.call(tc.PROBE_NAME, tc.PROBE_ARGUMENTS)]},
        ],
        keep_reasoning=True,
    )
    prefix = render(tokenizer, plain[:1], add_generation_prompt=True, **kwargs)
    written = written_with_calls(tokenizer, plain, 1, prefix, kwargs)
    try:
        family = tc.family_of_rendering(written)
    except tc.UnknownToolFormat as exc:
        raise TemplateError(f"{name}: {exc}") from None
    if family is None:
        raise TemplateError(
            f"{name}: the template cannot render tool calls (an assistant turn calling {tc.PROBE_NAME!r} "
            f"renders as {written[:60]!r}); use a target whose template renders tools, or drop the tool datasets"
        )
    _FAMILIES[name] = family
    return family


def tokenize_conversation(
    tokenizer,
    messages: Sequence[dict],
    keep_reasoning: bool = True,
    end_of_turn: Sequence[bool] | bool = True,
    **template_kwargs: Any,
) -> Tokenized:
    """Token ids and assistant loss mask of a whole conversation, checked by round trip.

    `end_of_turn`: per assistant turn (or for all), whether its end-of-turn token is masked.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TemplateError(f"{template_name(tokenizer)}: a fast tokenizer (with offsets) is needed for loss masks")
    full, spans = assistant_char_spans(tokenizer, messages, keep_reasoning, **template_kwargs)
    eot_flags = [end_of_turn] * len(spans) if isinstance(end_of_turn, bool) else list(end_of_turn)
    if len(eot_flags) != len(spans):
        raise ValueError(f"end_of_turn has {len(eot_flags)} flags for {len(spans)} assistant turns")
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    special = set(tokenizer.all_special_ids)
    mask = [0] * len(ids)
    turn_spans = []
    texts = [full[cs:ce] for cs, ce in spans]  # each checked to be the turn's text (and calls)
    for turn, ((cs, ce), with_eot) in enumerate(zip(spans, eot_flags)):
        inside = []
        eot_index = None
        for j, (s, e) in enumerate(offsets):
            if e <= s:
                continue
            if s < cs < e or s < ce < e:
                raise TemplateError(
                    f"{template_name(tokenizer)}: assistant turn {turn}: token {j} "
                    f"({tokenizer.decode([ids[j]])!r}) straddles the boundary of the assistant text"
                )
            if cs <= s and e <= ce:
                inside.append(j)
            elif s == ce and eot_index is None:
                eot_index = j
        chosen = list(inside)
        eot_text = ""
        if with_eot and eot_index is not None and ids[eot_index] in special:
            chosen.append(eot_index)
            eot_text = tokenizer.decode([ids[eot_index]])
        decoded = tokenizer.decode(
            [ids[j] for j in chosen], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        if decoded != texts[turn] + eot_text:
            raise TemplateError(
                f"{template_name(tokenizer)}: assistant turn {turn}: masked tokens decode to {decoded[:80]!r}, "
                f"expected {(texts[turn] + eot_text)[:80]!r}"
            )
        if chosen and chosen != list(range(chosen[0], chosen[-1] + 1)):
            raise TemplateError(f"{template_name(tokenizer)}: assistant turn {turn}: masked tokens are not contiguous")
        for j in chosen:
            mask[j] = 1
        turn_spans.append((chosen[0], chosen[-1] + 1) if chosen else (0, 0))
    return Tokenized(list(ids), mask, turn_spans)


PROBE_CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "Seven is prime.", "reasoning_content": "Small primes: 2, 3, 5, 7."},
    {"role": "user", "content": "And an even one?"},
    {"role": "assistant", "content": " Two, the only even prime!\n"},
]


def check_template(tokenizer, **template_kwargs: Any) -> None:
    """Refuse a template that cannot give exact assistant masks (raises TemplateError)."""
    for keep in (True, False):
        tokenize_conversation(tokenizer, PROBE_CONVERSATION, keep_reasoning=keep, **template_kwargs)


TOOL_PROBE_CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Weather in Oslo for three days?"},
    {"role": "assistant", "content": "", "tool_calls": [tc.call(tc.PROBE_NAME, tc.PROBE_ARGUMENTS)]},
    {"role": "tool", "content": '{"forecast": ["rain", "sun", "snow"]}'},
    {"role": "assistant", "content": "Rain, then sun, then snow."},
    {"role": "user", "content": "And Rome tomorrow?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [tc.call(tc.PROBE_NAME, {"city": "Rome", "days": 1}), tc.call(tc.PROBE_NAME, {"city": "Bari"})],
    },
    {"role": "tool", "content": '{"forecast": ["sun"]}'},
    {"role": "tool", "content": "no data"},
    {"role": "assistant", "content": "Sun in Rome."},
]


def check_tool_template(tokenizer, **template_kwargs: Any) -> str:
    """Refuse a template that cannot render tool turns with exact masks; -> its family."""
    family = tool_family(tokenizer, **template_kwargs)
    kwargs = {**template_kwargs, "tools": TOOL_PROBE_TOOLS}
    for keep in (True, False):
        tokenize_conversation(tokenizer, TOOL_PROBE_CONVERSATION, keep_reasoning=keep, **kwargs)
    return family


def apply_length_policy(
    tok: Tokenized, max_length: int, policy: Literal["truncate", "drop"]
) -> tuple[Tokenized | None, str | None]:
    """(sample, None) if it fits or was truncated, else (None, skip reason).

    A truncated sample keeps its first `max_length` tokens; if no assistant token is left
    it is dropped too (nothing to learn from it)."""
    if len(tok.input_ids) <= max_length:
        return tok, None
    if policy == "drop":
        return None, "overlong_dropped"
    if policy != "truncate":
        raise ValueError(f"overlong policy must be 'truncate' or 'drop', got {policy!r}")
    mask = tok.loss_mask[:max_length]
    if not any(mask):
        return None, "overlong_no_answer_left"
    spans = [(s, min(e, max_length)) for s, e in tok.turn_spans if s < max_length]
    return Tokenized(tok.input_ids[:max_length], mask, spans), None
