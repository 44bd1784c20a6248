"""What is wrong with a JSON value, in words: its every missing or mistyped key against the
shape it must have (a file bamboo wrote and reads back, e.g. a checkpoint's manifest).

    SHAPE = Record({"step": int, "layers": ListOf(int), "files": MapOf(int)},
                   optional={"meta": dict})
    problems(json.loads(text), SHAPE)
    # ["'step' is missing", "layers[2] is a string, not an integer"]

A shape is `int` (never a boolean), `float` (any number), `str`, `bool`, `dict` (any
object), `list` (any list), or a `Record`, `ListOf` or `MapOf` of shapes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Record", "ListOf", "MapOf", "Shape", "problems", "described"]


@dataclass(frozen=True)
class Record:
    """An object with these keys (each with its shape); `optional` keys may be absent."""

    keys: dict[str, Shape]
    optional: dict[str, Shape] = field(default_factory=dict)


@dataclass(frozen=True)
class ListOf:
    """A list whose every item has the shape `item`."""

    item: Shape


@dataclass(frozen=True)
class MapOf:
    """An object with any string keys, whose every value has the shape `value`."""

    value: Shape


Shape = type | Record | ListOf | MapOf

_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
          dict: "an object", list: "a list"}


def described(value: Any) -> str:
    """What a JSON value is, in words ("a string", "null")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    return _NAMES.get(type(value), type(value).__name__)


def _expected(shape: Shape) -> str:
    if isinstance(shape, Record):
        return "an object"
    if isinstance(shape, ListOf):
        return f"a list of {_plural(shape.item)}"
    if isinstance(shape, MapOf):
        return f"an object of {_plural(shape.value)}"
    return _NAMES.get(shape, shape.__name__)


def _plural(shape: Shape) -> str:
    word = _expected(shape)
    if word.startswith("a list"):
        return "lists" + word[6:]
    if word.startswith("an object"):
        return "objects" + word[9:]
    return word.split(" ", 1)[1] + "s"


def _fits(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def problems(value: Any, shape: Shape, where: str = "") -> list[str]:
    """Every way `value` differs from `shape`, one phrase each naming where (a key path
    like `tensors[0].sha256`); empty when it fits."""
    if isinstance(shape, Record):
        return _record(value, shape, where)
    if isinstance(shape, (ListOf, MapOf)):
        container = list if isinstance(shape, ListOf) else dict
        if not isinstance(value, container):
            return [_mistyped(value, shape, where)]
        if isinstance(shape, ListOf):
            items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
            return [p for at, v in items for p in problems(v, shape.item, at)]
        return [p for k, v in value.items() for p in problems(v, shape.value, f"{where}[{json.dumps(k)}]")]
    return [] if _fits(value, shape) else [_mistyped(value, shape, where)]


def _record(value: Any, shape: Record, where: str) -> list[str]:
    if not isinstance(value, dict):
        return [_mistyped(value, shape, where)]
    out = []
    for key, kind in shape.keys.items():
        at = f"{where}.{key}" if where else key
        if key not in value:
            out.append(f"'{at}' is missing")
        else:
            out += problems(value[key], kind, at)
    for key, kind in shape.optional.items():
        if key in value:
            out += problems(value[key], kind, f"{where}.{key}" if where else key)
    return out


def _mistyped(value: Any, shape: Shape, where: str) -> str:
    return f"{f'{where!r} is ' if where else 'it is '}{described(value)}, not {_expected(shape)}"
