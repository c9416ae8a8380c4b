"""Regeneration: multi-turn order, length policy, the Ray Data stage, kill/resume, SGLang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3.chat_template import generation_prompt_ids
from tests.helpers import corpus_rows, kill_run
from workflows import full
from workflows.core.config import compose
from workflows.core.engine_spec import EngineSpec
from workflows.core.engines import HFEngine
from workflows.generate import stage as generate
from workflows.generate.ingest import split_of
from workflows.generate.regenerate import Settings, regenerate_conversations

ROOT = Path(__file__).resolve().parents[1]


def tiny_cfg(tiny_target, run_dir, *extra):
    return compose(
        [
            "target=tiny",
            f"cache_dir={tiny_target.parent.parent}",
            f"run_dir={run_dir}",
            "data.max_new_tokens=8",
            "data.shard_size=4",
            "data.batch_size=4",
            "data.dtype=float32",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def engine(tiny_target):
    return HFEngine(EngineSpec(str(tiny_target), threads=2))


@pytest.mark.parametrize("is_neox", [True, False])
def test_sglang_shim_rotary_matches_reference(is_neox):
    from workflows.core.sglang import SHIM_DIR as SHIM

    sys.path.insert(0, str(SHIM))
    try:
        from vllm._custom_ops import rotary_embedding
    finally:
        sys.path.remove(str(SHIM))
    torch.manual_seed(0)
    tokens, heads, head = 5, 3, 8
    query, key = torch.randn(tokens, heads * head), torch.randn(tokens, 2, head)
    positions = torch.tensor([0, 3, 1, 7, 2])
    freqs = torch.outer(torch.arange(16).float(), 1 / 10000 ** (torch.arange(0, head, 2).float() / head))
    cos, sin = freqs.cos()[positions][:, None], freqs.sin()[positions][:, None]

    def reference(x):
        x = x.reshape(tokens, -1, head)
        a, b = (x[..., : head // 2], x[..., head // 2 :]) if is_neox else (x[..., 0::2], x[..., 1::2])
        ra, rb = a * cos - b * sin, b * cos + a * sin
        return torch.cat((ra, rb), -1) if is_neox else torch.stack((ra, rb), -1).flatten(-2)

    want_q, want_k = reference(query), reference(key)
    rotary_embedding(positions, query, key, head, torch.cat([freqs.cos(), freqs.sin()], -1), is_neox)
    torch.testing.assert_close(query.view(tokens, heads, head), want_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(key, want_k, rtol=0, atol=1e-6)  # in place, 3-d layout too


def test_every_turn_is_regenerated_from_the_regenerated_history(engine):
    tok = engine.tokenizer
    conv = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "The river"},
        {"role": "assistant", "content": "ORIGINAL ANSWER"},
        {"role": "user", "content": "and then?"},
    ]
    single = [{"role": "user", "content": "A story about a cat"}]
    s = Settings(max_new_tokens=8, max_length=512)
    two_turn, one_turn = regenerate_conversations(engine, tok, [conv, single], s)
    assert two_turn["status"] == "ok" and one_turn["status"] == "ok"
    msgs = two_turn["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert "ORIGINAL ANSWER" not in json.dumps(msgs)
    # Turn 2 is what greedy generation gives after the *regenerated* turn 1.
    prompt = generation_prompt_ids(tok, msgs[:4])
    [(answer, _)] = engine.generate([prompt], s.max_new_tokens)
    assert msgs[4]["content"] == tok.decode(answer, skip_special_tokens=True)
    # The tokenized conversation starts with that prompt, the mask covers both answers only.
    ids, mask = two_turn["input_ids"], two_turn["loss_mask"]
    assert ids[: len(prompt)] == prompt and len(ids) == len(mask)
    masked = tok.decode([t for t, m in zip(ids, mask) if m])
    assert masked == msgs[2]["content"] + msgs[4]["content"]  # cut at max_new_tokens: no end-of-turn token
    assert two_turn["finish"] == "length" and two_turn["turns_cut"] == 0


def test_length_policies_are_applied_and_reported(engine):
    tok = engine.tokenizer
    conv = [
        {"role": "user", "content": "Tell me about the sea"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "more please, about the sea and the sky"},
    ]
    prompt_len = len(generation_prompt_ids(tok, conv[:1]))
    cut = regenerate_conversations(engine, tok, [conv], Settings(max_new_tokens=8, max_length=prompt_len + 4))[0]
    assert cut["status"] == "ok" and cut["truncated"] and len(cut["input_ids"]) == prompt_len + 4
    assert cut["turns_cut"] == 1  # the second prompt did not fit: its turn was not generated
    dropped = regenerate_conversations(
        engine, tok, [conv], Settings(max_new_tokens=8, max_length=prompt_len + 4, overlong="drop")
    )[0]
    assert dropped["status"] == "overlong_dropped" and dropped["input_ids"] == []
    none = regenerate_conversations(engine, tok, [conv], Settings(max_new_tokens=8, max_length=prompt_len))[0]
    assert none["status"] == "prompt_overlong"


@pytest.mark.slow
def test_stage_regenerates_mixture_and_resumes_after_a_crash(tiny_target, tmp_path):
    """Default mixture (bundled + three offline corpora) on Ray Data; crash after the first
    committed shard; the rerun regenerates only the missing shards: no duplicate, no loss.
    Actors commit their own shards, so others may finish before the driver stops."""
    cfg = tiny_cfg(tiny_target, tmp_path, "data.limit=3", "data.heldout_fraction=0.3", "data.shard_size=2")
    commits = []

    def crash_after_first(k):
        commits.append(k)
        raise KeyboardInterrupt("simulated kill")

    with pytest.raises(KeyboardInterrupt):
        generate.run(cfg, tiny_target, on_commit=crash_after_first)
    folder = tmp_path / "generate" / "shards"

    def committed():
        return {int(m.name.split(".")[0]): m.stat().st_mtime_ns for m in folder.glob("*.done.json")}

    # The actor may still be finishing the shard it was on when the driver stopped: wait until
    # the committed set settles (as after a kill, when nothing runs any more).
    done, deadline = committed(), time.time() + 60
    while time.time() < deadline:
        time.sleep(3)
        if committed() == done:
            break
        done = committed()
    if len(done) == 6:  # a fast actor committed everything: take the last back, as if killed before it
        last = max(done)
        (folder / f"{last:05d}.done.json").unlink()
        del done[last]
    assert commits[0] in done and 1 <= len(done) < 6 and not (tmp_path / "generate" / "DONE.json").exists()
    missing = sorted(set(range(6)) - set(done))
    (folder / f".{missing[-1]:05d}.parquet.tmp-999").write_bytes(b"half-written by a killed run")
    (folder / f"{missing[-1]:05d}.parquet").write_bytes(b"renamed but never marked committed")

    commits.clear()
    out = generate.run(cfg, tiny_target, on_commit=commits.append)
    assert sorted(commits) == missing  # exactly the missing shards, each once
    assert {k: (folder / f"{k:05d}.done.json").stat().st_mtime_ns for k in done} == done  # not regenerated
    prompts, ingest_counts = generate.ingest_mixture(cfg.mixture, cfg.data, cfg.cache_path)
    samples = corpus_rows(tmp_path)
    assert sorted(r["id"] for r in samples) == sorted(r["id"] for r in prompts)  # no duplicate, no loss
    assert len(samples) == 12 and {r["dataset"] for r in samples} == {
        "bundled",
        "chatterbot_english",
        "human_eval",
        "python_faq",
    }
    assert all(r["split"] == split_of(r["id"], 0.3) for r in samples)
    assert {r["split"] for r in samples} == {"train", "heldout"}
    for r in samples:
        assert len(r["input_ids"]) == len(r["loss_mask"]) and sum(r["loss_mask"]) > 0
    table = json.loads((out / "accounting.json").read_text())
    assert sum(c["conversations"] for c in table.values()) == 12
    assert table["human_eval"]["answer_tokens"] == sum(
        sum(r["loss_mask"]) for r in samples if r["dataset"] == "human_eval"
    )
    assert (
        table["chatterbot_english"].get("skipped_duplicate", 0)
        == ingest_counts["chatterbot_english"]["skipped_duplicate"]
    )
    text = (out / "accounting.txt").read_text()
    assert "TOTAL" in text and "python_faq" in text
    marker = json.loads((out / "DONE.json").read_text())
    assert marker["summary"]["conversations"] == 12 and marker["summary"]["shards"] == 6
    # Same config again: reused as is.
    assert generate.run(cfg, tiny_target) == out and json.loads((out / "DONE.json").read_text()) == marker


def _wait_for(predicate, timeout, proc):
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def _run_generate(tiny_target, run_dir, *extra, **popen):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    args = [
        sys.executable,
        "-m",
        "workflows.generate",
        "target=tiny",
        f"cache_dir={tiny_target.parent.parent}",
        f"run_dir={run_dir}",
        "data.max_new_tokens=8",
        *extra,
    ]
    return subprocess.Popen(
        args,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **popen,
    )


@pytest.mark.slow
def test_sigkill_halfway_then_rerun(tiny_target, tmp_path):
    """A real kill -9 of the whole process group (driver, Ray, actors) after one shard."""
    # One engine, one row at a time: shards commit about a second apart (measured here), so
    # the kill lands with most of them still to do. With two engines and batches of 2 the
    # six shards committed within 0.6 s of each other and a fast machine finished them all.
    extra = [
        "mixture=bundled",
        "data.limit=16",
        "data.shard_size=2",
        "data.batch_size=1",
        "data.num_engines=1",
        "data.max_new_tokens=64",
    ]
    proc = _run_generate(tiny_target, tmp_path, *extra)
    folder = tmp_path / "generate" / "shards"
    try:
        assert _wait_for(lambda: any(folder.glob("*.done.json")), 300, proc), proc.communicate()[0][-3000:]
    finally:
        kill_run(proc)
    before = {p.name: p.read_bytes() for p in folder.glob("*.done.json")}
    assert 1 <= len(before) < 8
    proc = _run_generate(tiny_target, tmp_path, *extra)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log[-3000:]
    assert f"{len(before)} already committed" in log
    for name, data in before.items():
        assert (folder / name).read_bytes() == data
    samples = corpus_rows(tmp_path)
    assert sorted(r["id"] for r in samples) == sorted(f"bundled:default-{i:03d}" for i in range(16))


@pytest.mark.slow
@pytest.mark.sglang
def test_sglang_backend_on_cpu_matches_hf(tiny_target, tmp_path):
    """SGLang Engine per Ray actor (CPU, torch_native attention, the vllm shim), in a child
    process because a failing SGLang scheduler SIGKILLs its caller. Greedy text must match HF's."""
    pytest.importorskip("sglang")
    extra = ["mixture=bundled", "data.limit=4", "data.shard_size=4"]
    proc = _run_generate(tiny_target, tmp_path / "sglang", *extra, "data.backend=sglang")
    log = proc.communicate(timeout=420)[0]
    assert proc.returncode == 0, log[-4000:]
    # HF in this process (no child, no second Ray start): the same stage and settings.
    full.run(
        compose(
            [
                "target=tiny",
                f"cache_dir={tiny_target.parent.parent}",
                f"run_dir={tmp_path / 'hf'}",
                "data.max_new_tokens=8",
                "stages=[target,generate]",
                *extra,
            ]
        )
    )
    by_sglang = {r["id"]: r for r in corpus_rows(tmp_path / "sglang")}
    by_hf = {r["id"]: r for r in corpus_rows(tmp_path / "hf")}
    assert by_sglang.keys() == by_hf.keys() and len(by_hf) == 4
    same = sum(by_sglang[i]["input_ids"] == by_hf[i]["input_ids"] for i in by_hf)
    assert same >= 3, [(by_sglang[i]["answer"], by_hf[i]["answer"]) for i in by_hf]


@pytest.mark.slow
def test_a_shard_that_cannot_be_written_ends_in_one_line_and_the_rest_is_kept(tiny_target, tmp_path):
    """A worker's write fails (here: a directory where the shard's file must go, as a full
    disk or a read-only mount would): the stage ends with the project's error naming the
    shard, its cause and what to do; the other shards stay committed and a rerun after the
    fix regenerates only the failed one."""
    from workflows.core.errors import USER_ERRORS, StageFailure
    from workflows.core.markers import clear_done

    cfg = tiny_cfg(
        tiny_target,
        tmp_path,
        "mixture=bundled",
        "data.limit=6",
        "data.heldout_fraction=0",
        "data.shard_size=2",
        "data.num_engines=1",
    )
    generate.run(cfg, tiny_target)
    folder = tmp_path / "generate" / "shards"
    # Shard 1 is lost (its files removed, the stage no longer done) and cannot be written again.
    clear_done(tmp_path / "generate")
    (folder / "00001.done.json").unlink()
    (folder / "00001.parquet").unlink()
    (folder / "00001.parquet").mkdir()
    stamps = {m.name: m.stat().st_mtime_ns for m in folder.glob("*.done.json")}
    with pytest.raises(
        StageFailure,
        match=r"generate: shard\(s\) \[1\] of .*shards did not finish: .*Is a "
        r"directory.*rerun, which regenerates only the others",
    ) as failure:
        generate.run(cfg, tiny_target)
    assert isinstance(failure.value, USER_ERRORS) and "\n" not in str(failure.value)
    assert {m.name: m.stat().st_mtime_ns for m in folder.glob("*.done.json")} == stamps  # kept, untouched
    (folder / "00001.parquet").rmdir()
    generate.run(cfg, tiny_target)
    assert sorted(m.name for m in folder.glob("*.done.json")) == [
        "00000.done.json",
        "00001.done.json",
        "00002.done.json",
    ]
    assert all(folder.joinpath(n).stat().st_mtime_ns == t for n, t in stamps.items())


# ----------------------------------------------------------------------------- tool calls

TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {}}}},
    }
]


def call(city):
    return {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


def written(city, order=("name", "arguments")):
    """A call as the tiny target's template writes it (or with its keys in another order)."""
    obj = {"name": json.dumps("get_weather"), "arguments": json.dumps({"city": city})}
    return "<tool_call>\n{" + ", ".join(f'"{k}": {obj[k]}' for k in order) + "}\n</tool_call>"


class ScriptedEngine:
    """A test double for the engine's output only: the answer to a prompt is the script's
    entry whose key occurs last in the rendered prompt (what the turn answers), tokenized;
    the rule under test is the product code's."""

    def __init__(self, tokenizer, script: dict[str, str]):
        self.tokenizer, self.script, self.prompts = tokenizer, script, []

    def generate(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0):
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            self.prompts.append(text)
            key = max(self.script, key=lambda k: text.rfind(k))
            assert key in text, text
            out.append((self.tokenizer(self.script[key], add_special_tokens=False)["input_ids"], "eos"))
        return out


def tool_conversation(city, final="Noted."):
    return [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [call(city)]},
        {"role": "tool", "content": f"{city}: 3 degrees"},
        {"role": "assistant", "content": "DATASET ANSWER"},
        {"role": "user", "content": f"Thanks about {city}"},
        {"role": "assistant", "content": final},
    ]


def test_tool_call_rule_matched_calls_go_on_differing_ones_are_cut(engine):
    tok = engine.tokenizer
    script = {
        "Weather in Oslo?": written("Oslo"),  # the dataset's call, as its template writes it
        "Oslo: 3 degrees": "Cold in Oslo.",
        "Thanks about Oslo": "You are welcome.",
        "Weather in Rome?": written("Milan"),  # another call
        "Weather in Bari?": written("Bari", order=("arguments", "name")),  # same call, other text
        "Weather in Pisa?": "I cannot look that up.",  # no call where the dataset made one
        "Hello there": written("Oslo"),  # a call where the dataset answered in words
    }
    fake = ScriptedEngine(tok, script)
    plain = [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "Bye"},
    ]
    convs = [tool_conversation(c) for c in ("Oslo", "Rome", "Bari", "Pisa")] + [plain]
    s = Settings(max_new_tokens=64, max_length=1024)
    oslo, rome, bari, pisa, unexpected = regenerate_conversations(fake, tok, convs, s, tools=[TOOLS] * 5)
    # Matched: the call is kept as a call, the dataset's result follows, every turn is the target's.
    assert oslo["status"] == "ok" and oslo["cut"] is None and oslo["turns_cut"] == 0
    assert oslo["tool_outcomes"] == {"tool_call_matched": 1}
    assert oslo["messages"] == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call("Oslo")]},
        {"role": "tool", "content": "Oslo: 3 degrees"},
        {"role": "assistant", "content": "Cold in Oslo."},
        {"role": "user", "content": "Thanks about Oslo"},
        {"role": "assistant", "content": "You are welcome."},
    ]
    ids, mask = oslo["input_ids"], oslo["loss_mask"]
    runs, run = [], []
    for t, m in zip(ids, mask):  # the masked tokens, run by run
        if m:
            run.append(t)
        elif run:
            runs, run = runs + [tok.decode(run)], []
    assert runs == [written("Oslo") + "<|im_end|>", "Cold in Oslo.<|im_end|>", "You are welcome.<|im_end|>"]
    assert "Oslo: 3 degrees" in tok.decode([t for t, m in zip(ids, mask) if not m])  # the result: context only
    assert "DATASET ANSWER" not in tok.decode(ids)
    # The second generation saw the dataset's result after the target's own call.
    assert any(p.endswith("Oslo: 3 degrees\n</tool_response><|im_end|>\n<|im_start|>assistant\n") for p in fake.prompts)
    # Differs: the conversation ends with the target's own turn; the two turns after it are cut.
    for result, outcome, text in [
        (rome, "tool_call_differs_cut", written("Milan")),
        (bari, "tool_call_text_differs_cut", written("Bari", order=("arguments", "name"))),
        (pisa, "tool_call_differs_cut", "I cannot look that up."),
    ]:
        assert result["status"] == "ok" and result["cut"] == outcome and result["tool_outcomes"] == {outcome: 1}
        assert result["messages"][-1] == {"role": "assistant", "content": text}
        assert len(result["messages"]) == 2 and result["turns_cut"] == 2
        masked = [t for t, m in zip(result["input_ids"], result["loss_mask"]) if m]
        assert tok.decode(masked) == text + "<|im_end|>"
    assert unexpected["cut"] == "tool_call_unexpected_cut" and unexpected["turns_cut"] == 1
    assert unexpected["messages"][-1] == {"role": "assistant", "content": written("Oslo")}


def test_tool_outcomes_are_counted_in_the_shard_record(tmp_path):
    from workflows.generate.regenerate import commit_shard_files

    base = {"dataset": "agent", "split": "train", "shard": 0, "error": None, "finish": "eos", "truncated": False}
    base.update(messages_json="[]", tools_json=None, input_ids=[1, 2], loss_mask=[0, 1], prompt_tokens=1)
    rows = [
        {
            **base,
            "id": "a",
            "status": "ok",
            "turns_cut": 0,
            "cut": None,
            "tool_outcomes_json": '{"tool_call_matched": 2}',
        },
        {
            **base,
            "id": "b",
            "status": "ok",
            "turns_cut": 3,
            "cut": "tool_call_differs_cut",
            "tool_outcomes_json": '{"tool_call_matched": 1, "tool_call_differs_cut": 1}',
        },
        {**base, "id": "c", "status": "ok", "turns_cut": 1, "cut": "overlong", "tool_outcomes_json": None},
    ]
    for r in rows:
        r["answer_tokens"] = 1
    record = commit_shard_files(tmp_path, 0, rows)
    c = record["counts"]["agent"]
    assert c["tool_call_matched"] == 3 and c["tool_call_differs_cut"] == 1
    assert c["turns_cut_tool_call"] == 3 and c["turns_cut_overlong"] == 1 and c["conversations"] == 3
    line = generate.format_accounting({"agent": {**c, "records": 3, "tool_conversations": 2}}).splitlines()[1]
    assert line.endswith("  -  tools: call_differs_cut=1, call_matched=3, conversations=2, turns_cut_tool_call=3")


@pytest.mark.slow
def test_a_mixture_of_only_tool_conversations_gives_a_clear_accounting(tiny_target, tmp_path):
    """Through the real tiny target on Ray Data: it never writes a call, so every
    conversation whose first answer should call a tool ends on the target's answer
    (tool_call_differs_cut, the later turns counted as cut); a bad record is a counted skip."""
    records = [
        {
            "tools": TOOLS,
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "1", "content": "3 degrees"},
                {"role": "assistant", "content": "Cold."},
            ],
        },
        {
            "tools": json.dumps([TOOLS[0]["function"]]),
            "conversations": [
                {"from": "human", "value": "Weather in Rome?"},
                {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Rome"}}'},
                {"from": "observation", "value": "19 degrees"},
                {"from": "gpt", "value": "Warm."},
                {"from": "human", "value": "Thanks"},
            ],
        },
        {"tools": TOOLS, "messages": [{"role": "user", "content": "What can you look up?"}]},
        {
            "messages": [
                {"role": "user", "content": "Weather in Bari?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"function": {"name": "get_weather", "arguments": "{bad"}}],
                },
            ]
        },
    ]
    path = tmp_path / "agent.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    cfg = tiny_cfg(
        tiny_target,
        tmp_path / "run",
        "mixture=bundled",
        "~mixture.bundled",
        "+dataset@mixture.agent=sharegpt",
        f"mixture.agent.path={path}",
        "mixture.agent.format=auto",
        "data.heldout_fraction=0",
        "data.num_engines=1",
    )
    out = generate.run(cfg, tiny_target)
    table = json.loads((out / "accounting.json").read_text())
    c = table["agent"]
    assert c["records"] == 4 and c["conversations"] == 3 and c["skipped_bad_tool_arguments"] == 1
    assert c["tool_conversations"] == 3 and c["tool_call_differs_cut"] == 2
    assert c["turns_cut_tool_call"] == 1 + 2 and c.get("tool_call_matched", 0) == 0
    text = (out / "accounting.txt").read_text()
    assert "bad_tool_arguments=1  tools: call_differs_cut=2, conversations=3, turns_cut_tool_call=3" in text
    rows = {r["messages"][0]["content"]: r for r in corpus_rows(tmp_path / "run")}
    assert [m["role"] for m in rows["Weather in Oslo?"]["messages"]] == ["user", "assistant"]
    assert [m["role"] for m in rows["What can you look up?"]["messages"]] == ["user", "assistant"]
    for r in rows.values():  # the target's own answer is trained on; the tool list never is
        masked = [t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]
        assert sum(r["loss_mask"]) > 0 and json.loads(r["tools_json"]) == TOOLS
        assert "get_weather" not in engine_decode(tiny_target, masked)


def engine_decode(target, ids):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target)).decode(ids)


def test_a_target_template_without_tools_is_refused_before_any_engine_starts(tiny_target, tmp_path):
    from transformers import AutoTokenizer

    from eagle3.chat_template import TemplateError
    from workflows.core.errors import USER_ERRORS

    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    tok.chat_template = (  # SmolLM2's shape: ChatML writing only `content`
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    tok.save_pretrained(tmp_path / "plain")
    cfg = tiny_cfg(tiny_target, tmp_path / "run")
    rows = [
        {"dataset": "chat", "messages": [{"role": "user", "content": "Hi"}]},
        {"dataset": "agent", "messages": tool_conversation("Oslo"), "tools": TOOLS},
    ]
    generate.check_tool_rendering(cfg.target, cfg.data, tmp_path / "plain", rows[:1])  # no tool turn: nothing to check
    with pytest.raises(
        TemplateError,
        match=r"generate: the mixture holds tool conversations \(agent \(1\)\) but .*"
        r"cannot render tool calls .* drop those datasets \(~mixture.<name>\)",
    ) as err:
        generate.check_tool_rendering(cfg.target, cfg.data, tmp_path / "plain", rows)
    assert isinstance(err.value, USER_ERRORS) and "\n" not in str(err.value)
    generate.check_tool_rendering(
        cfg.target, cfg.data, tiny_target, rows
    )  # the tiny target's own template renders them


def test_tool_call_rule_on_a_kimi_shaped_template(engine):
    """The same rule where the template writes calls by id (Kimi-K2's shape): the target's
    call `functions.get_weather:0` is the dataset's, kept by its id, and the conversation
    goes on; a call with other arguments ends it."""
    from transformers import AutoTokenizer

    from tests.test_chat_template import KIMI_SHAPED, kimi_call

    kimi = AutoTokenizer.from_pretrained(engine.tokenizer.name_or_path)
    kimi.chat_template = KIMI_SHAPED
    section = "<|tool_calls_section_begin|>{}<|tool_calls_section_end|>"
    script = {
        "Weather in Oslo?": section.format(kimi_call(0, "Oslo")),
        "Oslo: 3 degrees": "Cold.",
        "Thanks about Oslo": "Welcome.",
        "Weather in Rome?": section.format(kimi_call(0, "Roma")),
    }
    s = Settings(max_new_tokens=64, max_length=1024)
    oslo, rome = regenerate_conversations(
        ScriptedEngine(kimi, script), kimi, [tool_conversation("Oslo"), tool_conversation("Rome")], s, [TOOLS] * 2
    )
    assert oslo["tool_outcomes"] == {"tool_call_matched": 1} and oslo["cut"] is None
    assert oslo["messages"][1]["tool_calls"] == [{**call("Oslo"), "id": "functions.get_weather:0"}]
    assert "## Return of functions.get_weather:0\nOslo: 3 degrees" in kimi.decode(oslo["input_ids"])
    assert rome["cut"] == "tool_call_differs_cut" and rome["turns_cut"] == 2
