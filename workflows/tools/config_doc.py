"""docs/configuration.md, generated from the schema, so the reference cannot drift from it.

    python -m workflows.tools.config_doc            # write docs/configuration.md
    python -m workflows.tools.config_doc --check    # exit 1 when the committed file is not current

The schema (`workflows.core.config.FullConfig` and the sections it composes, some of them
defined in `eagle3/`) is walked field by field: nested sections become dotted keys
(`train.ttt.noise.std`), a map of sections a placeholder (`mixture.<name>.path`). Each key's
line gives its type, its default, whether it is marked NOT_OUTPUT (`eagle3.schema`: changing
it reuses finished stages) and its description: the comment lines directly above the field
and the comments on its own lines, read from the source of the class that defines it. A
field without any comment is refused, naming it: every setting says what it does.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from eagle3.schema import affects_output
from workflows.core.config import PROJECT_ROOT, FullConfig

DOC_PATH = PROJECT_ROOT / "docs" / "configuration.md"
COMMAND = "python -m workflows.tools.config_doc"


@dataclass(frozen=True)
class Setting:
    """One leaf of the schema: a key a Hydra override can set."""

    key: str  # dotted, e.g. train.ttt.noise.std
    type: str
    default: str
    affects_output: bool
    description: str


@dataclass(frozen=True)
class Section:
    """One dataclass of the schema, reached at `key` (empty for the root)."""

    key: str
    cls: type
    description: str  # the comment on the field that holds it, in the enclosing section
    settings: list[Setting]


# ------------------------------------------------------------------------- reading the source


def _class_node(cls: type) -> tuple[ast.ClassDef, list[str], int]:
    """The class's AST, its source lines, and the file line of its first source line."""
    lines, first = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef), cls
    return node, source.splitlines(), first


def _comments(source_lines: list[str]) -> dict[int, tuple[str, bool]]:
    """line (1-based) -> (comment text, whether the line holds nothing but the comment)."""
    found = {}
    readline = io.StringIO("\n".join(source_lines) + "\n").readline
    for tok in tokenize.generate_tokens(readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            text = tok.string.lstrip("#").strip()
            found[line] = (text, not source_lines[line - 1][: tok.start[1]].strip())
    return found


def own_field_comments(cls: type) -> dict[str, str]:
    """The description of each field `cls` itself annotates: the comment lines directly
    above it (no blank line between), then the comments on its own lines."""
    node, source_lines, _ = _class_node(cls)
    comments = _comments(source_lines)
    found = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above = []
        line = stmt.lineno - 1
        while line in comments and comments[line][1]:
            above.insert(0, comments[line][0])
            line -= 1
        trailing = [comments[n][0] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
        found[stmt.target.id] = _join([" ".join(above), " ".join(trailing)])
    return found


def _join(parts: list[str]) -> str:
    """Comment parts as one text; a part that follows a finished sentence starts a new one."""
    text = ""
    for part in filter(None, parts):
        if text.endswith((".", ")")) and part[0].islower():
            part = part[0].upper() + part[1:]
        text = f"{text} {part}" if text else part
    return text


def defining_class(cls: type, name: str) -> type:
    """The class of `cls`'s MRO whose own body annotates field `name` (a subclass that
    redefines a field owns it)."""
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass) and name in own_field_comments(klass):
            return klass
    raise LookupError(f"{cls.__name__}.{name} is annotated in no class of its MRO")


def class_docstring(cls: type) -> str:
    """The docstring written in the class (not the signature dataclasses put in `__doc__`)."""
    node, _, _ = _class_node(cls)
    return " ".join((ast.get_docstring(node) or "").split())


def source_path(cls: type) -> str:
    return Path(inspect.getsourcefile(cls)).resolve().relative_to(PROJECT_ROOT).as_posix()


# ------------------------------------------------------------------------------ the walk


def type_name(tp: Any) -> str:
    """A type as a reader of YAML overrides thinks of it: `int | null`, `one of 'hf', 'sglang'`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (list, tuple):
        return f"list[{type_name(args[0]) if args else 'any'}]"
    if origin is dict:
        return f"map[{type_name(args[0])}, {type_name(args[1])}]" if args else "map"
    if dataclasses.is_dataclass(tp):
        return tp.__name__
    return getattr(tp, "__name__", str(tp))


def yaml_value(value: Any) -> str:
    """A default as it would be written in a YAML preset or an override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def default_of(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return yaml_value(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return yaml_value(f.default_factory())
    return "required"


def _section_type(tp: Any) -> tuple[type | None, str]:
    """(the dataclass a field holds, the key part after the field's name): a section, or a
    map of sections by name (`mixture.<name>`); (None, '') for a leaf."""
    if dataclasses.is_dataclass(tp):
        return tp, ""
    if typing.get_origin(tp) is dict:
        args = typing.get_args(tp)
        if len(args) == 2 and dataclasses.is_dataclass(args[1]):
            return args[1], ".<name>"
    return None, ""


def walk(cls: type = FullConfig, key: str = "", description: str = "") -> list[Section]:
    """Every section of the schema below `cls`, depth first, each with its leaf settings."""
    hints = typing.get_type_hints(cls)
    settings, below = [], []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        comment = own_field_comments(defining_class(cls, f.name)).get(f.name, "")
        dotted = f"{key}.{f.name}" if key else f.name
        section, suffix = _section_type(hints[f.name])
        if section is not None:
            below += walk(section, dotted + suffix, comment)
        else:
            settings.append(Setting(dotted, type_name(hints[f.name]), default_of(f), affects_output(f), comment))
    return [Section(key, cls, description, settings), *below]


def undescribed(sections: list[Section]) -> list[str]:
    """The keys whose field carries no comment at all."""
    return [s.key for section in sections for s in section.settings if not s.description]


# ------------------------------------------------------------------------------- rendering


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation other than
    `-` and `_` removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower())
    return text.replace(" ", "-")


def _text(text: str) -> str:
    """Comment text for Markdown, outside code spans: `<` escaped (GitHub would take `<name>`
    for an HTML tag and drop it), and `*` (`conf/*.yaml` is no emphasis)."""
    parts = text.split("`")
    parts[::2] = [part.replace("<", "&lt;").replace("*", "\\*") for part in parts[::2]]
    return "`".join(parts)


def _cell(text: str) -> str:
    return _text(text).replace("|", "\\|")


def _heading(section: Section) -> str:
    return f"`{section.key}`" if section.key else "Top level"


INTRO = f"""\
# Configuration reference

*What does each setting do, what is its default, and does changing it rebuild what a stage
wrote?*

Generated from the schema by `{COMMAND}`; do not edit it by hand.
CI fails when this file differs from what the command writes (`tests/test_docs.py`), and
the command refuses a setting whose field carries no comment.

Every key is set as a Hydra override, `python -m workflows.full key=value` (or in a preset
under `conf/`). The schema's defaults below are what a section gets when no preset sets it;
`conf/full.yaml` sets `run_dir` (`runs/<target name>`), `cache_dir` (`$EAGLE3_CACHE` or
`.cache`), the target preset (`target=smollm2_135m`, whose fields have no schema default)
and the mixture (`mixture=default`). Hydra refuses an unknown key or a wrong type while
composing, and every range is checked when the config loads.

The column *output* says whether a setting changes what a stage writes. `no` marks the
settings of `metadata=NOT_OUTPUT` (`eagle3/schema.py`): they change how fast a stage runs,
where it writes or how it is watched, and changing one on a finished run reuses its stages
(no stage key or shared-folder hash reads them).
"""


def render(sections: list[Section] | None = None) -> str:
    sections = walk() if sections is None else sections
    out = [INTRO, "## Sections\n"]
    for section in sections:
        heading = _heading(section)
        out.append(f"- [{heading}](#{github_anchor(heading)}) ({len(section.settings)})")
    for section in sections:
        out.append(f"\n## {_heading(section)}\n")
        where = f"`{section.cls.__name__}` in `{source_path(section.cls)}`."
        text = " ".join(part for part in (section.description, class_docstring(section.cls)) if part)
        out.append(f"{_text(text)} {where}\n" if text else f"{where}\n")
        if not section.settings:
            continue
        out.append("| key | type | default | output | description |")
        out.append("|---|---|---|---|---|")
        for s in section.settings:
            default = s.default if s.default == "required" else f"`{s.default}`"
            cells = (f"`{s.key}`", s.type, default, "yes" if s.affects_output else "no", s.description)
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed file is not current")
    parser.add_argument("--output", type=Path, default=DOC_PATH, help="the file to write or check")
    args = parser.parse_args(argv)
    sections = walk()
    missing = undescribed(sections)
    if missing:
        print(f"error: schema fields without a comment: {', '.join(missing)}; describe each in the source")
        return 2
    text = render(sections)
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else None
        if current != text:
            print(f"{args.output.name} is out of date: run {COMMAND}")
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output} ({sum(len(s.settings) for s in sections)} settings)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
