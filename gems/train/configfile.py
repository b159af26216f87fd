"""A run's configuration as a TOML file: read and checked against the command's options, written
back, and compared with another.

    values = read(Path("run.toml"), TrainConfig)    # {"batch_size": 4, ...}: every key a known field
    text = dumps(cfg)                               # the resolved configuration, options at None left out
    differences(saved, now)                         # ["lr 0.1 -> 0.05", ...]

Keys are the option names with underscores (``batch_size`` for ``--batch-size``), values of the
option's type: a string, an integer, a float (an integer is taken too), a boolean, or a list of
strings for a repeatable option. ``dumps`` fed back through ``read`` gives the same configuration,
and the same text again.

TOML is read with the standard library's ``tomllib`` (Python 3.11+) or the ``tomli`` package it came
from (Python 3.10); writing needs no library: the values are plain scalars and lists of strings.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any

from gems.errors import GemsError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the install asks for tomli there
    import tomli as tomllib


def value_type(hint: Any) -> Any:
    """The option's value type without ``| None``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(t for t in typing.get_args(hint) if t is not type(None))
    return hint


def _convert(key: str, value: Any, hint: Any, choices: Any, where: str) -> Any:
    """``value`` as the option's type, or a GemsError naming the key and what it should be."""
    kind = value_type(hint)
    if typing.get_origin(kind) is tuple:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise GemsError(f"{where}: {key} should be a list of strings, got {value!r:.60}")
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}[kind](value)
    if not ok:
        name = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
        raise GemsError(f"{where}: {key} should be {name}, got {value!r:.60}")
    if choices and value not in choices:
        raise GemsError(f"{where}: {key} = {value!r} is not one of {', '.join(map(str, choices))}")
    return float(value) if kind is float else value


def read(path: str | Path, config: type) -> dict[str, Any]:
    """The options a TOML file sets, each checked against the field of ``config`` it names."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise GemsError(f"cannot read the config file {str(path)!r} ({error.strerror}): give the path of a TOML "
                        "file") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise GemsError(f"{path} does not parse as TOML: {' '.join(str(error).split())}") from None
    fields = {f.name: f for f in dataclasses.fields(config)}
    hints = typing.get_type_hints(config)
    values = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (the keys are {config.__name__}'s options)"
            raise GemsError(f"{path}: unknown key {key!r}{hint}")
        values[key] = _convert(key, value, hints[key], fields[key].metadata.get("choices"), str(path))
    return values


def as_dict(cfg: Any) -> dict[str, Any]:
    """The resolved configuration, options left at None omitted, tuples as lists (JSON and TOML)."""
    return {f.name: list(v) if isinstance(v, tuple) else v
            for f in dataclasses.fields(cfg) if (v := getattr(cfg, f.name)) is not None}


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else "nan" if math.isnan(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_toml, value)) + "]"
    return json.dumps(value, ensure_ascii=False)   # a TOML basic string: JSON's escapes are TOML's


def dumps(cfg: Any) -> str:
    """The resolved configuration as TOML, one ``key = value`` line per option set, in field order."""
    return "".join(f"{key} = {_toml(value)}\n" for key, value in as_dict(cfg).items())


def differences(before: dict[str, Any], now: dict[str, Any], ignore: tuple[str, ...] = ()) -> list[str]:
    """``key old -> new`` for every option whose value differs between two ``as_dict`` results
    (a key missing on one side reads as unset)."""
    keys = [k for k in dict.fromkeys([*before, *now]) if k not in ignore]
    return [f"{k} {_shown(before.get(k))} -> {_shown(now.get(k))}" for k in keys if before.get(k) != now.get(k)]


def _shown(value: Any) -> str:
    return "unset" if value is None else _toml(value)
