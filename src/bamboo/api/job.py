"""`bamboo.Job`: a training job built in Python, checked like the command line's.

    job = bamboo.Job(model=build, nodes=4, stages=2, steps=12, kill=["0:1@5"])

The options are the job's flat keys as `bamboo train` has them (the flag without `--`,
`-` written `_`: `micro_batches`, `checkpoint_every`, `kill`), each checked by the same
declaration as the flag (`bamboo.config.sections`) and the same `JobConfig.validate()`,
so a bad job is one line (`JobError`) before any worker starts.

`model` is a preset's name, a `MODULE:FUNCTION` string, the function itself (which
every process then imports by its derived path, `bamboo.api.paths`), or what no process
can import (the model object, a lambda, a closure, a notebook's function), sent by value
(`bamboo.config.objects`). `dataset`,
`eval_dataset` and `loss` (and the options `metrics={"name": fn}` and `collate`) are
functions or classes taken the same way, a `functools.partial` of one, or
'MODULE:NAME(ARGS)' text, as `--dataset`, `--eval-dataset`, `--loss`, `--metric` and
`--collate` take them (`bamboo.data.user`).
"""
from __future__ import annotations

import difflib
import inspect
import sys
from typing import Any

from bamboo.api.data_options import data_options
from bamboo.api.job_options import JobOptions
from bamboo.api.paths import LOADED_BY_PATH
from bamboo.config import ConfigError, JobConfig, KillSpec, all_options, options_by_key, parse_kill
from bamboo.config.jobfile import coerce
from bamboo.config.sections import SCHEDULE_NAMES
from bamboo.data.sizing import SIZING

__all__ = ["Job", "JobError", "config_of", "option_names", "guard_worker_import"]


class JobError(ConfigError):
    """A job that cannot run as given; str() is the one line to show (a ValueError)."""


def option_names() -> dict[str, str]:
    """Every name an option may be given by -> its flat key: the key (`kills`), the flag's
    name (`kill`, `lease`), and `pipeline_schedule` for `--schedule` (whose name the
    learning-rate `schedule` takes)."""
    names: dict[str, str] = {}
    for f in all_options():
        names[f.key] = f.key
        names.setdefault(f.flag.removeprefix("--").replace("-", "_"), f.key)
    names["pipeline_schedule"] = "schedule"
    return names


def config_of(values: dict[str, Any], *, where: str | None = "Job") -> JobConfig:
    """The validated JobConfig of options given by name (`option_names`); each value
    checked against its option's declared type as a job file's is. `where` prefixes every
    error (None: the error as the command line says it)."""
    prefix = f"{where}: " if where else ""
    try:
        return JobConfig.of(**_flat(values, prefix, where is not None)).validate(SIZING)
    except JobError:
        raise
    except ConfigError as e:
        raise JobError(f"{prefix}{e}", *e.options) from None


def _flat(values: dict[str, Any], prefix: str, by_name: bool) -> dict[str, Any]:
    """{flat key: value of its declared type} of options given by name."""
    names, by_key = option_names(), options_by_key()
    flat: dict[str, Any] = {}
    for raw, value in values.items():
        name = raw.replace("-", "_")
        if name not in names:
            near = difflib.get_close_matches(name, list(names), n=1)
            hint = f"did you mean '{near[0]}'? " if near else ""
            raise JobError(f"{prefix}unknown option '{raw}': {hint}options are bamboo train's "
                           f"flags with _ for - (nodes, stages, micro_batches, steps, kill, ...)")
        f = by_key[names[name]]
        if isinstance(value, (str, KillSpec)) and _is_list(f.type):
            value = [value]
        if isinstance(value, tuple):
            value = list(value)
        if f.key == "kills" and isinstance(value, list):  # its own one-line error
            value = [parse_kill(k) if isinstance(k, str) else k for k in value]
        if _is_str(f.type) and hasattr(value, "__fspath__"):
            value = str(value)
        flat[f.key] = coerce(value, f.type, name if by_name else f.flag)
    return flat


def _is_list(tp: Any) -> bool:
    import typing
    return typing.get_origin(tp) is list


def _is_str(tp: Any) -> bool:
    import types
    import typing
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return str in args


def guard_worker_import(what: str) -> None:
    """JobError when `what` is called from a script's top level while a worker (or the
    coordinator) imports that script to build its model: the script must start its run
    under `if __name__ == "__main__":`, as multiprocessing's spawn asks too."""
    frame = inspect.currentframe()  # this function's; its caller's is `what`'s
    caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
    module = caller.f_globals.get("__name__", "") if caller is not None else ""
    del frame, caller
    if isinstance(module, str) and module.startswith(LOADED_BY_PATH):
        raise JobError(f"{what} ran while bamboo imported your script to build its model: put "
                       f"the script's bamboo calls under `if __name__ == \"__main__\":`")


class Job(JobOptions):
    """One training job: the model, and the options `bamboo train` takes as flags.

    `Job(...)` lists every option with its type, default and help (`help(bamboo.Job)`; the
    signature is `JobOptions.__init__`, generated from the options' declaration)."""

    def _build(self, model: Any = None, dataset: Any = None, loss: Any = None,
               optimizer: Any = None, schedule: Any = None, eval_dataset: Any = None,
               **options: Any) -> None:
        """The job of the arguments and the options the caller gave (only those:
        `bamboo.api.keywords.given_only`)."""
        if isinstance(schedule, str) and schedule in SCHEDULE_NAMES:
            options.setdefault("pipeline_schedule", schedule)  # `--schedule 1f1b|zb-h1`
            schedule = None
        options = dict(options)
        try:
            values = data_options(dataset, eval_dataset, loss, options) | options
        except ConfigError as e:
            raise JobError(f"Job: {e}", *e.options) from None
        if model is not None:
            values["model"] = model_name(model)
        if optimizer is not None or schedule is not None:
            from bamboo.api.optimizers import optimizer_options
            try:
                values.update(optimizer_options(optimizer, schedule))
            except ConfigError as e:
                raise JobError(f"Job: {e}", *e.options) from None
        self.model = model
        self.optimizer, self.schedule = optimizer, schedule
        self.dataset, self.eval_dataset, self.loss = dataset, eval_dataset, loss
        self.config: JobConfig = _placed_later(values)
        """The validated job, as `bamboo train` would have built it from the same flags."""
        if self.config.training.optimizer or self.config.training.lr_schedule:
            from bamboo.api.start import check_optimizer
            try:
                check_optimizer(self.config)
            except ConfigError as e:
                raise JobError(f"Job: {e}", *e.options) from None

    def options(self) -> dict[str, Any]:
        """Every option of the job by its flat key (summary.json's names)."""
        return self.config.to_dict()

    def __repr__(self) -> str:
        from bamboo.config import objects
        c = self.config
        name = objects.short(c.model.name) if objects.is_reference(c.model.name) else c.model.name
        return (f"bamboo.Job(model={name!r}, nodes={c.layout.nodes}, "
                f"stages={c.layout.stages}, steps={c.training.steps}, seed={c.training.seed})")


def _placed_later(values: dict[str, Any]) -> JobConfig:
    """`_config_of_model(values)`; a `resume="auto"` without `out` is checked without it and
    kept: the run directory it continues comes with the run (`bamboo.train(job, out=DIR)`,
    `bamboo.api.run.run_config`), which refuses it when none comes."""
    if values.get("resume") != "auto" or values.get("out") is not None:
        return _config_of_model(values)
    return _config_of_model({k: v for k, v in values.items() if k != "resume"}).replace(
        resume="auto")


def _config_of_model(values: dict[str, Any]) -> JobConfig:
    """`config_of(values)`, a model sent by value named in its errors as `model=` (what the
    model's own errors say) or by its hash's head rather than its whole reference."""
    from bamboo.config import objects
    ref = values.get("model")
    try:
        return config_of(values)
    except JobError as e:
        if not objects.is_reference(ref):
            raise
        text = str(e).replace(f"--model '{ref}': ", "model=")
        text = text.replace(f"'{ref}'", objects.short(ref)).replace(ref, objects.short(ref))
        text = text.replace(f"sha256_{objects.digest_of(ref)}()", "the factory")
        raise JobError(text, *e.options) from None


def model_name(model: Any) -> str:
    """The `--model` value of `model`: a name as it is, an importable function by its
    import path, anything else sent by value (`bamboo.api.paths.reference`)."""
    if isinstance(model, str):
        return model
    from bamboo.api.paths import reference
    if inspect.isfunction(model) or inspect.isclass(model) or inspect.isbuiltin(model):
        try:
            return reference(model, "model")
        except ConfigError as e:
            raise JobError(f"Job: {e}", "model") from None
    if callable(model) or _model_object(model):
        if _model_object(model):
            model = _given(model)
        try:
            return reference(model, "model", by_value=True)
        except ConfigError as e:
            raise JobError(f"Job: {e}", "model") from None
    raise JobError(f"Job: model= takes a preset name ('gpt2-mini'), 'MODULE:FUNCTION', a "
                   f"function that returns a model, or the model itself (a PipelineModel, an "
                   f"nn.Sequential, a list of layers, a DeepSpeed PipelineModule, a transformers model; got "
                   f"{type(model).__name__})", "model")


def _model_object(model: Any) -> bool:
    """Whether `model` is a model object (checked without importing torch for others)."""
    if not isinstance(model, (list, tuple)) and "torch" not in sys.modules:
        return False
    from bamboo.model.forms import is_model_object
    return is_model_object(model)


def _given(model: Any) -> Any:
    """A model object as the build function the workers call (`bamboo.model.forms.Given`):
    its layers listed here once (a DeepSpeed PipelineModule travels as its modules and
    loss, without its process groups; a transformers model as bamboo's layers with its
    weights), their shapes traced in each process from the job's Dataset (or token ids)."""
    from bamboo.model.api import ModelError
    from bamboo.model.forms import Given, layer_list
    try:
        listed = layer_list(model)
    except ModelError as e:
        raise JobError(f"Job: model={e}", "model") from None
    return Given(listed)
