"""The documentation stays true to the code: a README a newcomer reads in minutes, links
that resolve, and a configuration reference generated from the schema that cannot drift
(a new setting without a line, or without a comment, fails here)."""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from eagle3.schema import NOT_OUTPUT
from workflows.core.config import FullConfig
from workflows.tools import config_doc

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def without_code(text: str) -> str:
    """The text outside fenced blocks, with code spans blanked (a link is never inside code;
    `[T, H]` in a code span is no link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "code", text)


def links(text: str) -> list[str]:
    """The targets of the inline links `[text](target)` of a Markdown text."""
    return re.findall(r"\[[^\]\n]*\]\(([^)\s]+)\)", without_code(text))


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text (a repeated one gets -1, -2)."""
    found, seen = set(), {}
    body = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", body, flags=re.M):
        slug = config_doc.github_anchor(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(file: Path) -> list[str]:
    """The relative links of `file` whose file is missing or whose #anchor names no heading."""
    problems = []
    for target in links(file.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not checked here
            continue
        path, _, anchor = target.partition("#")
        dest = (file.parent / path).resolve() if path else file
        if not dest.exists():
            problems.append(f"{file.name}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            problems.append(f"{file.name}: {target}: no heading #{anchor} in {dest.name}")
    return problems


# ------------------------------------------------------------------------------- the README


def test_the_readme_is_read_in_minutes():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"
    )


def test_every_link_of_the_readme_and_docs_resolves():
    files = markdown_files()
    assert len(files) > 5 and any(links(f.read_text(encoding="utf-8")) for f in files)
    assert [problem for f in files for problem in broken_links(f)] == []


def test_each_docs_file_starts_with_the_question_it_answers():
    for file in sorted(DOCS.glob("*.md")):
        title, question = [p.strip() for p in file.read_text(encoding="utf-8").split("\n\n")[:2]]
        assert title.startswith("# "), f"{file.name} starts with {title[:40]!r}, not a title"
        assert question.startswith("*") and question.endswith("?*"), f"{file.name}: no question under its title"


def test_the_readme_links_every_docs_file():
    named = {Path(target.partition("#")[0]).name for target in links(README.read_text(encoding="utf-8"))}
    assert {f.name for f in DOCS.glob("*.md")} - named == set()


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## The GPU proof: `python -m bench.gpu_suite`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Sweeps: shared corpus and store, W&B sweeps\n\n"
        "[a](other.md#the-gpu-proof-python--m-benchgpu_suite) [b](#sweeps-shared-corpus-and-store-wb-sweeps) "
        "[c](https://example.org/x) `[code](nowhere.md)`\n"
    )
    assert broken_links(page) == []
    page.write_text(page.read_text() + "[d](missing.md) [e](other.md#no-such-heading) [f](#nor-here)\n")
    assert broken_links(page) == [
        "page.md: missing.md: no such file",
        "page.md: other.md#no-such-heading: no heading #no-such-heading in other.md",
        "page.md: #nor-here: no heading #nor-here in page.md",
    ]


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("Sweeps: shared corpus and store, W&B sweeps", "sweeps-shared-corpus-and-store-wb-sweeps"),
        ("The GPU proof: `python -m bench.gpu_suite`", "the-gpu-proof-python--m-benchgpu_suite"),
        ("`mixture.<name>`", "mixturename"),
        (
            "The same store: draft vocab 16384, `lr=5e-4`, the prompt fade",
            "the-same-store-draft-vocab-16384-lr5e-4-the-prompt-fade",
        ),
        ("[Linked](x.md) heading", "linked-heading"),
    ],
)
def test_anchors_follow_githubs_rule(heading, anchor):
    assert config_doc.github_anchor(heading) == anchor


# --------------------------------------------------------------- the configuration reference


def schema_keys(cls: type = FullConfig, prefix: str = "") -> list[str]:
    """Every dotted key a Hydra override can set, walked here apart from the generator."""
    keys = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        key = f"{prefix}{f.name}"
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            keys += schema_keys(tp, key + ".")
        elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(args[1]):
            keys += schema_keys(args[1], key + ".<name>.")
        else:
            keys.append(key)
    return keys


def test_the_committed_configuration_reference_is_current():
    assert config_doc.DOC_PATH == DOCS / "configuration.md"
    committed = config_doc.DOC_PATH.read_text(encoding="utf-8")
    assert committed == config_doc.render(), (
        "docs/configuration.md is out of date: run python -m workflows.tools.config_doc"
    )
    assert config_doc.main(["--check"]) == 0


def test_every_schema_field_has_its_line_and_a_description():
    assert config_doc.undescribed(config_doc.walk()) == [], "describe these fields in a comment at their definition"
    text = config_doc.render()
    keys = schema_keys()
    assert len(keys) > 100 and "train.ttt.noise.std" in keys and "mixture.<name>.path" in keys
    missing = [key for key in keys if not re.search(rf"^\| `{re.escape(key)}` \|", text, flags=re.M)]
    assert missing == []
    rows = re.findall(r"^\| `([^`]+)` \|", text, flags=re.M)
    assert sorted(rows) == sorted(keys), "one row per setting, no other"


def test_a_row_says_type_default_marks_and_comment():
    text = config_doc.render()
    assert "| `train.ttt.noise.std` | float | `0.05` | yes | absolute, on the captured target states" in text
    assert "| `capture.engine_timeout_s` | float | `3600.0` | no | SGLang: seconds its capture worker" in text
    assert "| `target.name` | str | required | yes |" in text
    assert "| `shared_dir` | str \\| null | `null` | yes |" in text
    assert "| `data.backend` | one of 'hf', 'sglang' | `'hf'` | yes |" in text
    assert "| `evaluate.length_buckets` | list[int] | `[64, 128, 256, 512]` | yes |" in text
    # a field redefined by a subclass takes its comment from there, an inherited one from its class
    assert "| `train.steps` | int | `60` | yes | the embedded default's budget" in text
    assert "| `train.dropout` | float | `0.0` | yes | Residual dropout in the draft layer" in text


@dataclass
class Inner:
    """A nested section."""

    # above, on two
    # lines
    rate: float = field(
        default=0.5,
        metadata=NOT_OUTPUT,
    )  # and on the closing line
    bare: int = 3


@dataclass
class Base:
    size: int  # the base's comment
    kept: str = "x"  # inherited as it is


@dataclass
class Toy(Base):
    size: int = 4  # redefined, with its own comment
    inner: Inner = field(default_factory=Inner)
    named: dict[str, Inner] = field(default_factory=dict)  # sections by name
    choice: typing.Literal["a", "b"] | None = None  # a choice or null


def test_the_generator_reads_comments_types_defaults_and_marks():
    sections = config_doc.walk(Toy)
    rows = {s.key: s for section in sections for s in section.settings}
    assert list(rows) == [
        "size",
        "kept",
        "choice",
        "inner.rate",
        "inner.bare",
        "named.<name>.rate",
        "named.<name>.bare",
    ]
    assert rows["size"].description == "redefined, with its own comment" and rows["size"].default == "4"
    assert rows["kept"].description == "inherited as it is" and rows["kept"].default == "'x'"
    assert rows["choice"].type == "one of 'a', 'b' | null" and rows["choice"].default == "null"
    assert rows["inner.rate"].description == "above, on two lines and on the closing line"
    assert rows["inner.rate"].affects_output is False and rows["inner.bare"].affects_output is True
    assert config_doc.undescribed(sections) == ["inner.bare", "named.<name>.bare"]
    assert [s.description for s in sections] == ["", "", "sections by name"]
    assert "A nested section." in config_doc.render(sections)


def test_check_fails_on_a_stale_file_and_names_the_command(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    assert config_doc.main(["--output", str(stale)]) == 0
    assert config_doc.main(["--check", "--output", str(stale)]) == 0
    stale.write_text(stale.read_text().replace("| `seed` | int | `0` |", "| `seed` | int | `1` |"))
    capsys.readouterr()
    assert config_doc.main(["--check", "--output", str(stale)]) == 1
    assert capsys.readouterr().out == ("configuration.md is out of date: run python -m workflows.tools.config_doc\n")
