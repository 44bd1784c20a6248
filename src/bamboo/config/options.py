"""Options declared once, and every view of them derived from that declaration.

A config section is a `kw_only, slots` dataclass whose fields are made with `option()`:
the field's type and default, its help text, its flag, its choices and its check live in
that one place. From the declarations come

- the command-line flags (`add_flags`: argparse arguments, grouped by section),
- the job-file schema and the commented example (`bamboo.config.jobfile`),
- summary.json's `config` block and the `run_start` event's (`flat_values`),
- the one-line errors (`check_section`): `--flag 'value' is not one of ...` for a choice,
  `--flag <what the check says>` for a check; each ConfigError names the options it is
  about, so a job file can say where in the file the value came from.

Each option has a flat `key`, unique across all sections: the name flags are parsed into,
overrides are given by, and summary.json reports (`micro_batches`, `checkpoint_every`).
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, field
from typing import Any

__all__ = ["ConfigError", "Option", "OptionField", "option", "option_fields", "add_flags",
           "check_section", "flat_values", "positive_int", "non_negative_int"]


class ConfigError(ValueError):
    """A user error in the job's configuration; str() is the one line to show.

    `options` are the keys of the options the message is about (may be empty)."""

    def __init__(self, message: str, *options: str) -> None:
        super().__init__(message)
        self.options = options

    def __reduce__(self) -> Any:
        return (type(self), (str(self), *self.options))


Check = Callable[[Any], "str | None"]
"""A check of one value alone: None when it is fine, else what is wrong and how to fix it,
written to follow the flag (`must be a positive integer (got 0)`)."""


@dataclass(frozen=True, slots=True)
class Option:
    """What a field declares besides its type and default."""

    help: str
    flag: str | None = None
    """The command-line flag; default `--` + the key with `-` for `_`."""
    key: str | None = None
    """The flat name; default the field's name."""
    choices: tuple[str, ...] = ()
    check: Check | None = None
    metavar: str | None = None
    summary: bool | Callable[[Any], Any] = True
    """In summary.json's config block: True (the value), False, or a function of the job."""
    cli: bool = True
    """False: a job-file key only, no flag."""


def option(default: Any = MISSING, *, factory: Callable[[], Any] | None = None, help: str,
           **meta: Any) -> Any:
    """A dataclass field carrying its `Option` (see the module's docstring)."""
    opt = Option(help=" ".join(help.split()), **meta)
    if factory is not None:
        return field(default_factory=factory, metadata={"option": opt})
    return field(default=default, metadata={"option": opt})


@dataclass(frozen=True, slots=True)
class OptionField:
    """One declared option, where it lives, and its derived names."""

    section: str
    name: str
    type: Any
    default: Any
    option: Option

    @property
    def key(self) -> str:
        return self.option.key or self.name

    @property
    def flag(self) -> str:
        return self.option.flag or "--" + self.key.replace("_", "-")

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def option_fields(section: str, cls: type) -> Iterator[OptionField]:
    """The options a section class declares, in order."""
    hints = typing.get_type_hints(cls, vars(__import__(cls.__module__, fromlist=["_"])))
    for f in dataclasses.fields(cls):
        opt = f.metadata.get("option")
        if opt is not None:
            yield OptionField(section, f.name, hints[f.name], _default(f), opt)


def scalar_type(tp: Any) -> Any:
    """`int | None` -> int; other types as they are."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return tp


def add_flags(parser: argparse.ArgumentParser, fields: list[OptionField], *,
              given_only: bool = False, titles: dict[str, str] | None = None) -> None:
    """One argument per option, in a group per section; with `given_only` an option the
    user did not type is absent from the namespace (a job file's value then stands)."""
    groups: dict[str, Any] = {}
    for f in fields:
        if not f.option.cli:
            continue
        if f.section not in groups:
            title = (titles or {}).get(f.section, f.section)
            groups[f.section] = parser.add_argument_group(title)
        tp = scalar_type(f.type)
        kw: dict[str, Any] = {"dest": f.key, "help": _help(f)}
        if f.option.metavar or f.option.choices:
            kw["metavar"] = f.option.metavar or "|".join(f.option.choices)
        if tp is bool:
            kw["action"] = "store_true"
        elif typing.get_origin(tp) is list:
            kw["action"] = "append"
        elif tp in (int, float):
            kw["type"] = tp
        elif int in typing.get_args(tp):
            kw["type"] = _int_or_words(tp)
        kw["default"] = argparse.SUPPRESS if given_only else (
            [] if typing.get_origin(tp) is list else f.default)
        groups[f.section].add_argument(f.flag, **kw)


def _int_or_words(tp: Any) -> Callable[[str], Any]:
    """The argparse type of `int | Literal["auto", ...]`: one of the words, else an int
    (argparse's one-line error names both: `invalid int or auto value: 'many'`)."""
    words = [w for a in typing.get_args(tp) if typing.get_origin(a) is typing.Literal
             for w in typing.get_args(a)]

    def parse(text: str) -> Any:
        return text if text in words else int(text)
    parse.__name__ = " or ".join(["int", *words])
    return parse


def _help(f: OptionField) -> str:
    text = f.option.help
    if f.option.choices and not text.startswith(f.option.choices[0]):
        text = f"{' | '.join(f.option.choices)}: {text}"
    if f.default not in (None, False, [], "") and "(default" not in text:
        text += f" (default {f.default})"
    return text.replace("%", "%%")


def check_section(section: Any, fields: list[OptionField]) -> None:
    """Every option's choices and check, in declaration order (ConfigError, one line)."""
    for f in fields:
        value = getattr(section, f.name)
        if f.option.choices and value is not None and value not in f.option.choices:
            raise ConfigError(f"{f.flag} '{value}' is not one of {', '.join(f.option.choices)}",
                              f.key)
        if f.option.check is not None and value is not None:
            problem = f.option.check(value)
            if problem:
                raise ConfigError(f"{f.flag} {problem}", f.key)


def flat_values(job: Any, fields: list[OptionField], *, summary: bool = False) -> dict[str, Any]:
    """{key: value} of every option (with `summary`, as summary.json's config block)."""
    out: dict[str, Any] = {}
    for f in fields:
        value = getattr(getattr(job, f.section), f.name)
        if summary:
            how = f.option.summary
            if how is False:
                continue
            if callable(how):
                value = how(job)
        if isinstance(value, list):
            value = [str(v) if not isinstance(v, (int, float, str, bool)) else v for v in value]
        out[f.key] = value
    return out


# -- checks shared by many options --------------------------------------------------------


def positive_int(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"must be a positive integer (got {value})"
    return None


def non_negative_int(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return f"must be an integer >= 0 (got {value})"
    return None
