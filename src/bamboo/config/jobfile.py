"""Job files: `bamboo train --config job.yaml` (or job.toml), checked key by key.

    bamboo config --example > job.yaml        # a commented example, every option at its default
    bamboo train --config job.yaml --steps 20 # flags the user gives override the file

The schema is JobConfig's own sections and the options they declare:

    model:    {name: gpt2-tiny, precision: fp32, ...}   # or just `model: gpt2-tiny`
    data:     {path: corpus/}                           # or just `data: corpus/`
    layout:   {nodes: 8, stages: 4, micro_batches: 4}
    training: {steps: 100, lr: 3e-3}
    redundancy: {mode: lazy}                            # or just `redundancy: lazy`
    cluster:  {kills: ["0:2@5", "0:1@8+notice"]}
    checkpoints: {every: 10}                            # `checkpoint_every: 10` works too

Keys may be written with `-` or `_`, and an option may be named by its field or by its
flat key (`every` or `checkpoint_every`). Relative paths are taken from the current
directory, exactly like the flags. An unknown key, a value of the wrong type or outside
its choices is a ConfigError whose one line names the file, the key's dotted path
(`layout.nodes`) and what is allowed; `JobConfig.validate()` then checks the job, and its
error says where in the file each value it names came from.
"""
from __future__ import annotations

import difflib
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from bamboo.config.job import SECTIONS, JobConfig, all_options, options_by_key
from bamboo.config.options import ConfigError, OptionField
from bamboo.config.presets import CustomSizing
from bamboo.config.sections import KillSpec, parse_kill

__all__ = ["load_job_config", "example_config", "field_paths"]

_SHORTHAND = {"model": "name", "data": "path", "redundancy": "mode"}
"""Sections a file may give as one value: that of this option (`model: gpt2-mini`)."""


def field_paths() -> dict[str, str]:
    """Option key -> its dotted path in a job file (`nodes` -> `layout.nodes`)."""
    return {f.key: f.dotted for f in all_options()}


def _members(section: str) -> dict[str, OptionField]:
    """The names a section accepts (field names and flat keys) -> their option."""
    out: dict[str, OptionField] = {}
    for f in all_options():
        if f.section == section:
            out[f.name] = f
            out.setdefault(f.key, f)
    return out


def _key(raw: Any) -> str:
    return str(raw).replace("-", "_")


# -- values -------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if origin is list:
        return "a list of " + ("\"D:S@K\" strings" if args and args[0] is KillSpec
                               else _type_name(args[0]) if args else "values")
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp)))


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def coerce(value: Any, tp: Any, where: str) -> Any:
    """`value` as type `tp`, or ConfigError naming `where` and the expected type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return coerce(value, inner[0], where)
        for kind in inner:  # `int | Literal["auto"]`: the first kind that takes the value
            try:
                return coerce(value, kind, where)
            except ConfigError:
                pass
    elif origin is typing.Literal:
        if value in args and not isinstance(value, bool):
            return value
    elif origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected {_type_name(tp)}, got {_show(value)}")
        item = args[0] if args else Any
        return [coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    elif tp is KillSpec:
        if isinstance(value, KillSpec):
            return value
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a \"D:S@K\" string, got {_show(value)}")
        try:
            return parse_kill(value)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT.match(value.strip()):
            return float(value)  # PyYAML (YAML 1.1) reads `3e-3`, without a dot, as a string
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        return value  # a type this module does not know: JobConfig.validate() judges it
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {_show(value)}")


def _show(value: Any) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping", type(None): "null"}.get(type(value), type(value).__name__)
    text = repr(value)
    return f"{kind} ({text if len(text) <= 40 else text[:37] + '...'})"


def _check_choice(f: OptionField, value: Any, where: str) -> None:
    allowed = f.option.choices
    if allowed and value is not None and value not in allowed:
        raise ConfigError(f"{where}: '{value}' is not one of {', '.join(allowed)}")


# -- reading a file -----------------------------------------------------------------------


def _read(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--config file '{path}' does not exist: give the path of a YAML or "
                          f"TOML job file (bamboo config --example writes one)") from None
    except IsADirectoryError:
        raise ConfigError(f"--config '{path}' is a directory: give the path of a job file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config file '{path}' cannot be read: {e}") from None
    if path.suffix.lower() == ".toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: TOML syntax error: {e}") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKey as e:
        raise ConfigError(f"{path}, line {e.line}: key '{e.key}' is given twice (first on line "
                          f"{e.first}): keep one of them") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = ": ".join(str(x) for x in (e.context, e.problem) if x)
        raise ConfigError(f"{path}{where}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: YAML error: {' '.join(str(e).split())}") from None


class _DuplicateKey(Exception):
    def __init__(self, key: str, line: int, first: int) -> None:
        super().__init__(key)
        self.key, self.line, self.first = key, line, first


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (the
    plain loader keeps the last silently, so a job file could say two things at once)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):
                continue  # an unhashable key: the base loader says what is wrong with it
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(str(key), line, seen[key])
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _unknown(path: Path, dotted: str, allowed: list[str]) -> ConfigError:
    name = dotted.rsplit(".", 1)[-1]
    home = options_by_key().get(name) or next(
        (f for f in all_options() if f.name == name and f.dotted != dotted), None)
    if home is not None and home.dotted != dotted:
        hint = f"it belongs at '{home.dotted}'"
    else:
        near = difflib.get_close_matches(name, allowed, n=1)
        hint = (f"did you mean '{near[0]}'? " if near else "") + f"allowed: {', '.join(allowed)}"
    return ConfigError(f"{path}: unknown key '{dotted}': {hint}")


def _flatten(doc: Any, path: Path) -> dict[str, tuple[str, Any]]:
    """The file's values as {option key: (dotted path, raw value)}; unknown keys are errors."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, "
                          f"got {_show(doc)}")
    out: dict[str, tuple[str, Any]] = {}
    for raw, value in doc.items():
        section = _key(raw)
        if section not in SECTIONS:
            raise _unknown(path, section, list(SECTIONS))
        if value is None:
            continue
        members = _members(section)
        if not isinstance(value, dict):
            if section not in _SHORTHAND:
                raise ConfigError(f"{path}: '{section}' must be a section (a mapping), "
                                  f"got {_show(value)}")
            value = {_SHORTHAND[section]: value}
            f = members[_SHORTHAND[section]]
            out[f.key] = (section, value[f.name])
            continue
        for raw_name, v in value.items():
            name = _key(raw_name)
            if name not in members:
                names = sorted({f.name for f in members.values()})
                raise _unknown(path, f"{section}.{name}", names)
            f = members[name]
            out[f.key] = (f.dotted, v)
    return out


def load_job_config(path: str | Path, overrides: dict[str, Any] | None = None,
                    sizing: CustomSizing | None = None) -> JobConfig:
    """The validated JobConfig of a job file, with `overrides` (flags given) taking precedence.

    `overrides` maps option keys (argparse dests) to values; it holds only the flags the
    user actually gave.
    """
    path = Path(path)
    by_key = options_by_key()
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    for key, (dotted, raw) in _flatten(_read(path), path).items():
        f = by_key[key]
        value = coerce(raw, f.type, f"{path}: {dotted}")
        _check_choice(f, value, f"{path}: {dotted}")
        values[key], where[key] = value, dotted
    for key, value in (overrides or {}).items():
        if key not in by_key:
            raise ConfigError(f"override '{key}' is not an option: known options are "
                              f"{', '.join(by_key)}")
        values[key] = coerce(value, by_key[key].type, by_key[key].flag)
        where.pop(key, None)
    try:
        return JobConfig.of(**values).validate(sizing)
    except ConfigError as e:
        named = [where[k] for k in e.options if k in where]
        if not named:
            raise
        raise ConfigError(f"{e} (in {path}: {', '.join(named)})", *e.options) from None


# -- the example --------------------------------------------------------------------------


def _yaml_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    if isinstance(value, (KillSpec, Path)):
        value = str(value)
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _comment(text: str, indent: str, width: int = 88) -> list[str]:
    words, lines, line = text.split(), [], ""
    for w in words:
        if line and len(indent) + 2 + len(line) + 1 + len(w) > width:
            lines.append(f"{indent}# {line}")
            line = w
        else:
            line = f"{line} {w}".strip()
    if line:
        lines.append(f"{indent}# {line}")
    return lines


def _entry(f: OptionField, indent: str) -> list[str]:
    lines = _comment(f.option.help, indent)
    if f.option.choices and not f.option.help.startswith(f.option.choices[0]):
        lines += _comment(f"One of: {', '.join(f.option.choices)}.", indent)
    lines += _comment(f"Flag: {f.flag}.", indent) if f.option.cli else []
    lines.append(f"{indent}{f.name}: {_yaml_value(f.default)}")
    if f.key == "kills":
        lines.append(f'{indent}# kills: ["0:2@5", "0:1@8+notice"]')
    return lines


def example_config() -> str:
    """A commented YAML job file with every option at its default; it loads as is."""
    out = ["# A Bamboo job file: bamboo train --config job.yaml [--flag value ...]",
           "# Flags given on the command line override these values. Unknown keys are errors.",
           "# Keys may use '-' or '_'. Relative paths are taken from the current directory.",
           ""]
    for section, cls in SECTIONS.items():
        out += _comment(cls.__doc__ or "", "")
        out.append(f"{section}:")
        for f in all_options():
            if f.section == section:
                out += _entry(f, "  ")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
