"""Job files: `bamboo train --config job.yaml` (or job.toml), checked field by field.

    bamboo config --example > job.yaml        # a commented example, every field at its default
    bamboo train --config job.yaml --steps 20 # flags the user gives override the file

The schema is JobConfig's own fields (`dataclasses.fields`), grouped into sections so a
file reads well; a field that JobConfig gains later and that no section claims sits at
the top level, so it is accepted and documented without touching this module:

    model: gpt2-tiny                # top level: model, data, redundancy, out (and new fields)
    layout:   {nodes, stages, pipelines, micro_batches, micro_batch_size}
    training: {steps, seed, lr, warmup_steps, weight_decay, grad_clip}
    runtime:  {threads, comm_timeout_s, device}
    faults:   {kills: ["0:2@5", "0:1@8+notice"]}
    checkpointing: {checkpoint_every, ...}     # when JobConfig has these fields
    cluster:  {trace, time_scale, max_nodes, notice_s, ...}

Keys may be written with `-` or `_` (`micro-batches` = `micro_batches`). Relative paths
(`data`, `out`, ...) are taken from the current directory, exactly like the flags. An
unknown key, a value of the wrong type or outside its allowed values is a ConfigError
whose one line names the file, the key's dotted path (`layout.nodes`) and what is
allowed; then `JobConfig.validate()` checks the job as a whole.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from bamboo import config as _config_module
from bamboo.config import COMM_MODES, PRECISIONS, REDUNDANCY_MODES, ConfigError, JobConfig, KillSpec, parse_kill
from bamboo.presets import PRESETS

__all__ = ["load_job_config", "example_config", "field_paths", "SECTIONS"]

SECTIONS: dict[str, tuple[str, ...]] = {
    "layout": ("nodes", "stages", "pipelines", "micro_batches", "micro_batch_size",
               "layer_costs"),
    "training": ("steps", "seed", "lr", "warmup_steps", "weight_decay", "grad_clip"),
    "runtime": ("threads", "comm_timeout_s", "device", "comm", "precision", "exact",
                "activation_checkpointing"),
    "evaluation": ("eval_every", "eval_batches"),
    "logging": ("tensorboard", "wandb"),
    "faults": ("kills",),
    "checkpointing": ("checkpoint_every", "checkpoint_dir", "keep_checkpoints", "recovery",
                      "resume"),
    "cluster": ("trace", "time_scale", "max_nodes", "notice_s", "lease_s", "etcd"),
}
"""Section -> the JobConfig fields it holds (names JobConfig lacks are simply unused)."""

_CHOICES: dict[str, tuple[str, ...]] = {
    "model": tuple(PRESETS),
    "redundancy": REDUNDANCY_MODES,
    "device": ("auto", "cpu", "cuda"),
    "comm": COMM_MODES,
    "precision": PRECISIONS,
    "recovery": ("redundancy", "checkpoint-restart"),
}

_FLAG_ALIASES = {"kills": "kill"}
"""Fields whose flag is not the field's name with '-' for '_' (and no `_s` suffix)."""

_FALLBACK_DOCS: dict[str, str] = {
    "steps": "Optimizer steps to run.",
    "seed": "Seeds the model's parameters and the data.",
    "lr": "Peak learning rate (AdamW).",
    "weight_decay": "Decoupled weight decay on matrices.",
    "kills": "Preemptions to inject: \"D:S@K\" SIGKILLs the holder of stage S of pipeline D "
             "in step K; \"D:S@K+notice\" sends a notice (SIGTERM) first.",
}


# -- the schema ---------------------------------------------------------------------------


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(JobConfig) if f.init}


def field_paths() -> dict[str, str]:
    """JobConfig field name -> its dotted path in a job file (`nodes` -> `layout.nodes`)."""
    home = {name: section for section, names in SECTIONS.items() for name in names}
    return {name: f"{home[name]}.{name}" if name in home else name for name in _fields()}


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(JobConfig, vars(_config_module))


def _key(raw: Any) -> str:
    return str(raw).replace("-", "_")


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        return "a list of " + ("\"D:S@K\" strings" if args and args[0] is KillSpec
                               else _type_name(args[0]) if args else "values")
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """`value` as type `tp`, or ConfigError naming `where` and the expected type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(value, inner[0], where)
    elif origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected {_type_name(tp)}, got {_show(value)}")
        item = args[0] if args else Any
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
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
    elif tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
    else:
        return value  # a type this module does not know: JobConfig.validate() judges it
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {_show(value)}")


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _show(value: Any) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping", type(None): "null"}.get(type(value), type(value).__name__)
    text = repr(value)
    return f"{kind} ({text if len(text) <= 40 else text[:37] + '...'})"


def _check_choice(name: str, value: Any, where: str) -> None:
    allowed = _CHOICES.get(name)
    if name == "model" and isinstance(value, str) and ":" in value:
        return  # hf:... or MODULE:FUNCTION: checked by the preset parser
    if allowed and value is not None and value not in allowed:
        more = (", an hf: model (hf:gpt2, hf:llama, hf:bert, hf:DIR) or MODULE:FUNCTION"
                if name == "model" else "")
        raise ConfigError(f"{where}: '{value}' is not one of {', '.join(allowed)}{more}")


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
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = ": ".join(str(x) for x in (e.context, e.problem) if x)
        raise ConfigError(f"{path}{where}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: YAML error: {' '.join(str(e).split())}") from None


def _unknown(path: Path, dotted: str, allowed: list[str]) -> ConfigError:
    name = dotted.rsplit(".", 1)[-1]
    paths = field_paths()
    if name in paths and paths[name] != dotted:
        hint = f"it belongs at '{paths[name]}'"
    else:
        near = difflib.get_close_matches(name, allowed, n=1)
        hint = (f"did you mean '{near[0]}'? " if near else "") + f"allowed: {', '.join(allowed)}"
    return ConfigError(f"{path}: unknown key '{dotted}': {hint}")


def _flatten(doc: Any, path: Path) -> dict[str, tuple[str, Any]]:
    """The file's values as {field: (dotted path, raw value)}; unknown keys are errors."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, "
                          f"got {_show(doc)}")
    paths = field_paths()
    top = sorted({p.split(".")[0] for p in paths.values()})
    out: dict[str, tuple[str, Any]] = {}
    for raw, value in doc.items():
        key = _key(raw)
        if key in SECTIONS and key in top:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: '{key}' must be a section (a mapping), got {_show(value)}")
            members = sorted(n for n, p in paths.items() if p.startswith(key + "."))
            for raw_name, v in value.items():
                name = _key(raw_name)
                if name not in members:
                    raise _unknown(path, f"{key}.{name}", members)
                out[name] = (f"{key}.{name}", v)
        elif key in paths and paths[key] == key:
            out[key] = (key, value)
        else:
            raise _unknown(path, key, top)
    return out


def load_job_config(path: str | Path, overrides: dict[str, Any] | None = None) -> JobConfig:
    """The validated JobConfig of a job file, with `overrides` (flags given) taking precedence.

    `overrides` maps JobConfig field names (argparse dests) to values already of the
    field's type; it holds only the flags the user actually gave.
    """
    path = Path(path)
    hints, fields = _hints(), _fields()
    values: dict[str, Any] = {}
    for name, (dotted, raw) in _flatten(_read(path), path).items():
        value = _coerce(raw, hints[name], f"{path}: {dotted}")
        _check_choice(name, value, f"{path}: {dotted}")
        values[name] = value
    for name, value in (overrides or {}).items():
        if name not in fields:
            raise ConfigError(f"override '{name}' is not a JobConfig field: known fields are "
                              f"{', '.join(fields)}")
        values[name] = _coerce(value, hints[name], "--" + name.replace("_", "-"))
    from_file = {name for name in values if name not in (overrides or {})}
    try:
        return JobConfig(**values).validate()
    except ConfigError as e:
        raise ConfigError(_locate(str(e), from_file, path)) from None


def _locate(message: str, from_file: set[str], path: Path) -> str:
    """JobConfig.validate() names flags; add where in the file each named value came from."""
    paths = field_paths()
    named = [name for name in sorted(from_file) if any(
        re.search(rf"--{flag}(?![\w-])", message)
        for flag in {name.replace("_", "-"), name.removesuffix("_s").replace("_", "-"),
                     _FLAG_ALIASES.get(name, name)})]
    if not named:
        return message
    return f"{message} (in {path}: {', '.join(paths[n] for n in named)})"


# -- the example --------------------------------------------------------------------------


def _field_docs() -> dict[str, str]:
    """The string literal under each JobConfig field in config.py, by field name."""
    try:
        tree = ast.parse(Path(_config_module.__file__).read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return dict(_FALLBACK_DOCS)
    docs = dict(_FALLBACK_DOCS)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == JobConfig.__name__:
            body = node.body
            for stmt, nxt in zip(body, body[1:]):
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                        and isinstance(nxt.value.value, str)):
                    docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


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


def _entry(f: dataclasses.Field, docs: dict[str, str], indent: str) -> list[str]:
    lines = _comment(docs.get(f.name, ""), indent) if docs.get(f.name) else []
    if f.name in _CHOICES and f.name != "redundancy" and f.name != "device":
        lines += _comment(f"One of: {', '.join(_CHOICES[f.name])}.", indent)
    lines.append(f"{indent}{f.name}: {_yaml_value(_default(f))}")
    if f.name == "kills":
        lines.append(f'{indent}# kills: ["0:2@5", "0:1@8+notice"]')
    return lines


def example_config() -> str:
    """A commented YAML job file with every JobConfig field at its default; it loads as is."""
    fields, docs, paths = _fields(), _field_docs(), field_paths()
    out = ["# A Bamboo job file: bamboo train --config job.yaml [--flag value ...]",
           "# Flags given on the command line override these values. Unknown keys are errors.",
           "# Keys may use '-' or '_'. Relative paths are taken from the current directory.",
           ""]
    for name, f in fields.items():
        if paths[name] == name:
            out += _entry(f, docs, "") + [""]
    for section in SECTIONS:
        members = [fields[n] for n in SECTIONS[section] if n in fields]
        if members:
            out.append(f"{section}:")
            for f in members:
                out += _entry(f, docs, "  ")
            out.append("")
    return "\n".join(out).rstrip() + "\n"
