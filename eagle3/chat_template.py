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

Reasoning: when kept, an assistant turn's `reasoning_content` is placed before its
content as `<think>\\n{reasoning}\\n</think>\\n\\n{content}` and masked with it.
TODO: templates that render `reasoning_content` natively (Qwen3, DeepSeek-R1) and drop it
from earlier turns are not special-cased; they are checked (and refused) by the round trip.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal, Sequence

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


def _plain(messages: Sequence[dict], keep_reasoning: bool) -> list[dict]:
    """Messages as the template sees them: role and content only (reasoning inlined)."""
    out = []
    for m in messages:
        text = assistant_text(m, keep_reasoning) if m["role"] == "assistant" else m["content"]
        out.append({"role": m["role"], "content": text})
    return out


def render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = False, **template_kwargs: Any) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )


def generation_prompt_ids(tokenizer, messages: Sequence[dict], **template_kwargs: Any) -> list[int]:
    """Token ids of `messages` followed by the template's assistant header (what to generate from)."""
    text = render(tokenizer, _plain(messages, keep_reasoning=True), add_generation_prompt=True, **template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assistant_char_spans(
    tokenizer, messages: Sequence[dict], keep_reasoning: bool = True, **template_kwargs: Any
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of each assistant text."""
    plain = _plain(messages, keep_reasoning)
    full = render(tokenizer, plain, **template_kwargs)
    spans = []
    for i, m in enumerate(plain):
        if m["role"] != "assistant":
            continue
        turn = len(spans)
        prefix = render(tokenizer, plain[:i], add_generation_prompt=True, **template_kwargs)
        if not full.startswith(prefix):
            raise TemplateError(
                f"{template_name(tokenizer)}: assistant turn {turn} (message {i}): the rendering of the "
                f"messages before it plus the generation prompt is not a prefix of the whole conversation; "
                f"cannot locate the assistant text"
            )
        start, end = len(prefix), len(prefix) + len(m["content"])
        if full[start:end] != m["content"]:
            raise TemplateError(
                f"{template_name(tokenizer)}: assistant turn {turn} (message {i}): the template does not "
                f"render the assistant text verbatim (expected {m['content'][:60]!r}, "
                f"found {full[start:end][:60]!r})"
            )
        spans.append((start, end))
    return full, spans


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
    texts = [
        m["content"] if m["role"] != "assistant" else assistant_text(m, keep_reasoning)
        for m in messages
        if m["role"] == "assistant"
    ]
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
