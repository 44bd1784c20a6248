"""Writes `bamboo/api/job_options.py`: `bamboo.Job(...)`'s typed signature and its docstring,
made from the one declaration of the options (`bamboo.config.sections`).

    python -m bamboo.api.gen_job_options          # rewrite the module
    python -m bamboo.api.gen_job_options --check  # exit 1 when it is stale

Editors and type checkers read signatures from source, so the signature is source: every
option as a keyword-only parameter with its type (its choices as a `Literal`), its default
and its help text under `Args:`. An option is named as its flag is, without `--` and with
`_` for `-` (`kill`, `lease`, `comm_timeout`), save the pipeline's `--schedule`, which is
`pipeline_schedule` (`schedule=` is the learning-rate schedule's), and `--metric`, which is
`metrics={"name": fn}`. The arguments before the options (the model, the data, the loss, the
optimizer and its schedule) take Python objects; their text is here. tests/unit/api/
test_job_signature.py fails when the module is stale.
"""
from __future__ import annotations

import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

from bamboo.config import all_options, options_by_key
from bamboo.config.options import OptionField

__all__ = ["render", "TARGET", "REGENERATE"]

TARGET = Path(__file__).with_name("job_options.py")
REGENERATE = "python -m bamboo.api.gen_job_options"

_LEADING: tuple[tuple[str, str, str], ...] = (
    ("model", '"str | Callable[..., Any] | PipelineModel | Module | Sequence[Any] | None"',
     "What is trained: a preset's name or 'MODULE:FUNCTION' (as --model: {model_help}); a "
     "function returning a model; or the model itself (a PipelineModel, an nn.Sequential, a "
     "list of modules, a DeepSpeed PipelineModule), sent by value. Default: gpt2-tiny."),
    ("dataset", "Any", "Your map-style Dataset (sample i is (inputs, labels)), a function or "
     "class returning one, a functools.partial of one, or 'MODULE:NAME(ARGS)' text. Default: "
     "bamboo's own data."),
    ("loss", "Callable[..., Any] | str | None", "loss(outputs, labels) -> the micro-batch's "
     "mean loss: a function, a class with its arguments (functools.partial), or such an "
     "object. Default: the model's own."),
    ("optimizer", "Callable[..., Any] | str | None", "A factory taking the parameters: a "
     "torch.optim class, or functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9). "
     "Default: AdamW."),
    ("schedule", "Callable[..., Any] | str | None", "The learning-rate schedule: a function "
     "step -> multiplier, or a functools.partial of a torch.optim.lr_scheduler class. "
     "Default: warm-up, then cosine decay."),
    ("eval_dataset", "Any", "The held-out Dataset for eval_every, in the forms dataset takes."),
)
_GIVEN_BY_LEADING = {"model", "dataset", "eval_dataset", "loss", "optimizer", "lr_schedule"}
_NAMES = {"schedule": "pipeline_schedule", "metrics": "metrics"}
_TYPES = {"metrics": "Mapping[str, Callable[..., Any]] | Sequence[str] | str",
          "collate": "Callable[..., Any] | str | None"}
_PATHS = ("DIR", "FILE", "PATH")
_WIDTH = 96

_HEAD = '''"""`bamboo.Job(...)`'s typed signature: every option with its type, default and help.

GENERATED from the options' declaration (bamboo.config.sections) by
`{regenerate}`: do not edit; rerun it after changing an option. `Job`
(bamboo.api.job) takes its `__init__` from `JobOptions`; the call goes to `Job._build` with
only the options given (bamboo.api.keywords). No `from __future__ import annotations`:
`help()` shows the annotations as types, not as strings.
"""
from collections.abc import Callable, Mapping, Sequence
from os import PathLike
from typing import TYPE_CHECKING, Any, Literal

from bamboo.api.keywords import given_only
from bamboo.config import KillSpec

if TYPE_CHECKING:
    from torch.nn import Module

    from bamboo.model.api import PipelineModel

__all__ = ["JobOptions"]


class JobOptions:
    """The signature of `bamboo.Job`: the model, its data, loss and optimizer, and every
    option `bamboo train` takes as a flag."""

    @given_only("_build")
    def __init__(
'''


def name_of(f: OptionField) -> str:
    """The option's keyword in the signature."""
    return _NAMES.get(f.key, f.flag.removeprefix("--").replace("-", "_"))


def options() -> list[OptionField]:
    """The options the signature lists as keywords (those the leading arguments do not give)."""
    return [f for f in all_options() if f.key not in _GIVEN_BY_LEADING]


def annotation(f: OptionField) -> str:
    """The type a Python caller may give the option, as source."""
    if f.key in _TYPES:
        return _TYPES[f.key]
    parts = [_render(a, f) for a in _members(f.type)]
    return " | ".join(sorted(parts, key=lambda p: p == "None"))


def _members(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _render(tp: Any, f: OptionField) -> str:
    if tp is type(None):
        return "None"
    if typing.get_origin(tp) is typing.Literal:
        return f"Literal[{', '.join(repr(v) for v in typing.get_args(tp))}]"
    if typing.get_origin(tp) is list:
        item = _render(typing.get_args(tp)[0], f)
        single = item if item == "str" else f"{item} | str"
        return f"{single} | Sequence[{single}]"
    if tp is str and f.option.choices:
        return f"Literal[{', '.join(repr(c) for c in f.option.choices)}]"
    if tp is str and any(p in (f.option.metavar or "") for p in _PATHS):
        auto = "Literal['auto'] | " if "auto" in (f.option.metavar or "").split("|") else ""
        return f"{auto}str | PathLike[str]"
    return tp.__name__


def default(f: OptionField) -> str:
    """The default as source (a list's as an empty tuple: never a mutable default)."""
    return "()" if isinstance(f.default, list) else repr(f.default)


def _arg_doc(name: str, kind: str, text: str) -> str:
    return textwrap.fill(f"{name} ({kind}): {text}", _WIDTH, initial_indent=" " * 12,
                         subsequent_indent=" " * 16, break_on_hyphens=False)


def _docstring() -> str:
    text = options_by_key()["model"].option.help.rstrip(".")
    model_help = text[:1].lower() + text[1:]
    lines = ['        """Make a training job: the model, and the options `bamboo train` takes '
             'as flags.', "",
             "        Long because it lists every option, generated from their declaration.",
             "", *textwrap.wrap(
                 "Options are keyword-only, named as the flag without `--`, `-` written `_`; "
                 "an option left out keeps its default, as on the command line, and each value "
                 "is checked as its flag's is, when the job is made (bamboo.JobError, one "
                 "line). An unknown name is refused naming the nearest known one; an option's "
                 "summary.json key is taken too (`kills`, `lease_s`).", _WIDTH,
                 initial_indent=" " * 8, subsequent_indent=" " * 8),
             "", "        Args:"]
    for name, kind, text in _LEADING:
        lines.append(_arg_doc(name, kind.strip('"'), text.format(model_help=model_help)))
    for f in options():
        lines.append(_arg_doc(name_of(f), f"{annotation(f)}, default {default(f)}",
                              f"{f.option.help} (--{f.flag.removeprefix('--')})"))
    return "\n".join(lines) + '\n        """\n'


def render() -> str:
    """The whole module's source."""
    params = ["        self,"]
    params += [f"        {name}: {kind} = None," for name, kind, _ in _LEADING]
    params.append("        *,")
    section = None
    for f in options():
        if f.section != section:
            section = f.section
            params.append(f"        # -- {section} --")
        params.append(f"        {name_of(f)}: {annotation(f)} = {default(f)},")
    return (_HEAD.format(regenerate=REGENERATE) + "\n".join(params) + "\n    ) -> None:\n"
            + _docstring())


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        stale = not TARGET.is_file() or TARGET.read_text() != text
        if stale:
            # A script's own answer (`python -m ...`, not library output): printed, not logged.
            print(f"{TARGET} is stale: run `{REGENERATE}`", file=sys.stderr)
        return 1 if stale else 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
