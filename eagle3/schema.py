"""Strict conversion of plain dicts (e.g. Hydra's) into small config dataclasses.

Unknown keys are refused and wrong types are named by their dotted path, so a typo in
an override (`train.ttt_lenght=5`) fails loudly instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, unknown, or contradicts another artefact."""


def _check_type(value: Any, annotation: Any, path: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(value, arg, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{path}: bad value {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{path}={value!r} is not one of {list(args)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {type(value).__name__} {value!r}")
        item = args[0] if args else Any
        return [_check_type(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path} must be a mapping, got {value!r}")
        item = args[1] if len(args) == 2 else Any  # typed values (dict[str, Spec]) are checked too
        return {k: _check_type(v, item, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value, path)
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} must be a number, got {value!r}")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} must be an integer, got {value!r}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path} must be true or false, got {value!r}")
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string, got {value!r}")
        return value
    return value


def from_dict(cls: type[T], data: Mapping[str, Any] | None, path: str = "") -> T:
    """Build dataclass `cls` from `data`, refusing unknown keys and wrong types."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or cls.__name__} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = path or cls.__name__
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known keys are {sorted(fields)}")
    kwargs = {}
    for name, field in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in data:
            kwargs[name] = _check_type(data[name], hints[name], sub)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{sub} is required")
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if callable(check):
        check(path or cls.__name__)
    return obj


def check_ranges(obj: Any, where: str, **rules: str) -> None:
    """Refuse numeric fields outside their range, naming the dotted field.

    A rule is `>=1`, `>0`, or an interval such as `[0,1)` or `(0,1]`; a field whose value
    is None (an optional setting left unset) is not checked. Lists are checked item by item.
    """
    for name, rule in rules.items():
        value = getattr(obj, name)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and not _within(v, rule):
                raise ConfigError(f"{where}.{name}={value!r} is out of range: it must be {_describe(rule)}")


def _within(v: float, rule: str) -> bool:
    if rule.startswith(">="):
        return v >= float(rule[2:])
    if rule.startswith(">"):
        return v > float(rule[1:])
    lo, hi = rule[1:-1].split(",")
    above = v >= float(lo) if rule[0] == "[" else v > float(lo)
    below = v <= float(hi) if rule[-1] == "]" else v < float(hi)
    return above and below


def _describe(rule: str) -> str:
    if rule.startswith(">="):
        return f">= {rule[2:]}"
    return f"> {rule[1:]}" if rule.startswith(">") else f"in {rule}"


def to_dict(obj: Any) -> dict:
    """A plain, JSON-ready dict of a config dataclass (for provenance records)."""
    return dataclasses.asdict(obj)


# The mark of a setting that changes how fast a stage runs, where it writes or how it is
# watched, never what it writes: `field(default=..., metadata=NOT_OUTPUT)`. Every stage's
# hashes and done-keys are made of `output_dict`, so changing such a setting reuses the
# finished work (a raised timeout must not re-capture a store of terabytes).
NOT_OUTPUT = {"affects_output": False}


def affects_output(f: dataclasses.Field) -> bool:
    return f.metadata.get("affects_output", True)


def output_dict(obj: Any) -> Any:
    """`to_dict` without the fields marked NOT_OUTPUT, at every depth (nested sections, and
    maps or lists of them)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: output_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if affects_output(f)}
    if isinstance(obj, dict):
        return {k: output_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [output_dict(v) for v in obj]
    return obj
