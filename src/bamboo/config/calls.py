"""A call written as text: `MODULE:NAME(key=value, ...)`, the form `--optimizer` and
`--lr-schedule` take (and `bamboo.Job` writes for a class, a function or a
`functools.partial` of one), so every process of a run builds the same object by name.

    torch.optim:SGD(lr=0.05, momentum=0.9)
    torch.optim.lr_scheduler:OneCycleLR(max_lr=0.1, total_steps=12)
    /abs/path/train.py:warmup(steps=3)

The target is imported like `--model`'s (a module on the path, or a `.py` file); the
arguments are keywords with Python literal values (numbers, strings, booleans, None,
tuples, lists, dicts of those). Parsed without importing anything.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Call", "parse_call", "check_call"]

_CALL = re.compile(r"^\s*(?P<target>[^()\s][^()]*?)\s*(?:\((?P<args>.*)\))?\s*$", re.S)


@dataclass(frozen=True, slots=True)
class Call:
    """A named callable and the keyword arguments to call it with."""

    target: str
    """`MODULE:NAME` or `path/file.py:NAME`."""
    kwargs: dict[str, Any]

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.target}({args})"


def parse_call(text: str) -> Call:
    """The Call `text` writes; ValueError with what is wrong (one line) otherwise."""
    m = _CALL.match(text)
    if not m:
        raise ValueError(f"'{text}' is not MODULE:NAME(key=value, ...)")
    target = m["target"]
    module, _, name = target.rpartition(":")
    importable = module.endswith(".py") or all(p.isidentifier() for p in module.split("."))
    if not module or not importable or not name.isidentifier():
        raise ValueError(f"'{target}' is not MODULE:NAME: write e.g. torch.optim:SGD(lr=0.05) "
                         f"or path/to/file.py:NAME")
    kwargs: dict[str, Any] = {}
    if m["args"] is not None and m["args"].strip():
        try:
            call = ast.parse(f"f({m['args']})", mode="eval").body
        except SyntaxError:
            raise ValueError(f"'({m['args']})' is not a list of key=value arguments") from None
        assert isinstance(call, ast.Call)
        if call.args or any(k.arg is None for k in call.keywords):
            raise ValueError(f"'{text}': give every argument as key=value")
        for k in call.keywords:
            try:
                kwargs[str(k.arg)] = ast.literal_eval(k.value)
            except ValueError:
                raise ValueError(f"'{text}': {k.arg}= is not a literal (a number, string, "
                                 f"boolean, None, or a tuple, list or dict of those)") from None
    return Call(target, kwargs)


def check_call(value: Any) -> str | None:
    """An option's check (`bamboo.config.options`): None, or what is wrong."""
    if not isinstance(value, str):
        return f"must be MODULE:NAME(key=value, ...) text (got {value!r})"
    try:
        parse_call(value)
    except ValueError as e:
        return f"{e}"
    return None
