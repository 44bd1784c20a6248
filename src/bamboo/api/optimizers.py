"""`bamboo.Job(optimizer=..., schedule=...)`: the job's own optimizer and learning-rate
schedule, written as the calls every process makes again (`bamboo.config.calls`).

    optimizer=torch.optim.SGD                                  # the class: its defaults, lr=--lr
    optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    optimizer="torch.optim:SGD(lr=0.05, momentum=0.9)"         # as --optimizer takes it
    schedule=warmup_then_constant                              # def f(step) -> multiplier
    schedule=functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=0.1, total_steps=12)

A class or function is named by its import path (`bamboo.api.paths`), or sent by value when
it has none (a lambda, a closure, a notebook's function: `bamboo.config.objects`;
`call_text(..., by_value=True)`, which the optimizer and schedule use); a
partial's arguments must be keywords with literal values (numbers, strings, booleans, None,
tuples, lists, dicts), which the call's text carries to every worker. Anything else is
refused in one line.
"""
from __future__ import annotations

import ast
import functools
import inspect
from typing import Any

from bamboo.api.paths import import_path, reference
from bamboo.config import ConfigError
from bamboo.config.calls import Call, parse_call

__all__ = ["optimizer_options", "call_text"]


def optimizer_options(optimizer: Any, schedule: Any) -> dict[str, str]:
    """The job options (`optimizer`, `lr_schedule`) of the API's arguments."""
    out: dict[str, str] = {}
    if optimizer is not None:
        out["optimizer"] = call_text(optimizer, "optimizer", by_value=True)
    if schedule is not None:
        out["lr_schedule"] = call_text(schedule, "schedule", by_value=True)
    return out


def call_text(obj: Any, what: str, *, by_value: bool = False) -> str:
    """`MODULE:NAME(key=value, ...)` for a call text, a class or function, or a
    `functools.partial` of one; ConfigError (one line) for anything else. `by_value`: a
    class or function without an import path is sent by value (its reference the call's
    target), else refused."""
    name_of = (lambda f: reference(f, what)) if by_value else (lambda f: import_path(f, what))
    if isinstance(obj, str):
        try:
            return str(parse_call(obj))
        except ValueError as e:
            raise ConfigError(f"{what}: {e}", what) from None
    if isinstance(obj, functools.partial):
        if obj.args:
            raise ConfigError(f"{what}: functools.partial with positional arguments "
                              f"{obj.args!r}: give them by keyword", what)
        for key, value in obj.keywords.items():
            if not _literal(value):
                raise ConfigError(f"{what}: {key}={_short(value)} is not a literal (a number, "
                                  f"string, boolean, None, or a tuple, list or dict of those): "
                                  f"the workers get the arguments as text", what)
        return str(Call(name_of(obj.func), dict(obj.keywords)))
    if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return str(Call(name_of(obj), {}))
    raise ConfigError(f"{what}= takes an optimizer class, a function, a functools.partial of "
                      f"one, or 'MODULE:NAME(ARGS)' text (got {type(obj).__name__}: "
                      f"{_short(obj)}); an instance cannot reach the workers", what)


def _literal(value: Any) -> bool:
    try:
        return ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False


def _short(value: Any) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 40 else text[:37] + "..."
