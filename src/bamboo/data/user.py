"""A user's data, loss and metrics: `--dataset`, `--eval-dataset`, `--collate`, `--loss`,
`--metric` (and `bamboo.Job(dataset=, eval_dataset=, loss=, metrics=)`, which write them).

Every process rebuilds them by name (`MODULE:NAME(ARGS)`, `bamboo.config.calls`): a class
or function named with keyword arguments is called with them to make the Dataset (or the
loss, for a class such as `torch.nn:CrossEntropyLoss(label_smoothing=0.1)`); a function
named with arguments is a loss or metric with those arguments bound.

A Dataset must be map-style (`__len__` and `__getitem__`): sample i is `(inputs, labels)`,
each a tensor, or a tuple or dict of tensors. Bamboo picks the indices of every step
(`bamboo.data.sampling`), so a step can be replayed on any node: an `IterableDataset` or
a `DataLoader`, whose order only its own iteration knows, is refused.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from bamboo.config import ConfigError, JobConfig, objects
from bamboo.config.calls import Call, parse_call
from bamboo.config.metric_spec import parse_metric
from bamboo.config.presets import CustomSizing
from bamboo.data.datasets import Batch, Metric, Samples, Task, make_task, on_device
from bamboo.data.sampling import position_after
from bamboo.model.api import import_object
from bamboo.model.sizing import size_custom_model

__all__ = ["DatasetSamples", "build_dataset", "build_function", "job_task", "check_job_data",
           "first_inputs",
           "data_position", "check_resume_position", "REPLAYABLE"]

REPLAYABLE = ("a step must be replayable: bamboo picks every step's sample indices itself, so "
              "any node can redo it after a failure")


def _build(text: str, flag: str) -> tuple[Any, Call]:
    """The object `text` names (imported, not called yet) and its Call."""
    try:
        call = parse_call(text)
        if objects.is_reference(call.target):  # sent by value: need not be callable
            return objects.resolve(call.target), call
        return import_object(call.target), call
    except ConfigError:
        raise
    except ValueError as e:  # a malformed call or a ModelError: its one line says it
        raise ConfigError(f"{flag} {text}: {str(e).splitlines()[0]}", _key(flag)) from None
    except Exception as e:  # noqa: BLE001 - the user's module: any error is theirs to fix
        raise ConfigError(f"{flag} {text}: {_line(e)}", _key(flag)) from None


def build_dataset(text: str, flag: str = "--dataset") -> Any:
    """The Dataset `text` names, made by calling it with its arguments (a Dataset sent by
    value, `bamboo.config.objects`, is the Dataset itself), and checked."""
    target, call = _build(text, flag)
    if _is_dataset(target) and not call.kwargs:
        return check_dataset(target, f"{flag} {text}")
    try:
        dataset = target(**call.kwargs)
    except Exception as e:  # noqa: BLE001 (the user's code: any error is theirs to fix)
        raise ConfigError(f"{flag} {text}: {_line(e)}", _key(flag)) from None
    return check_dataset(dataset, f"{flag} {text}")


def _is_dataset(obj: Any) -> bool:
    """An object (not a class) with `__len__` and `__getitem__`."""
    return not inspect.isclass(obj) and hasattr(obj, "__len__") and hasattr(obj, "__getitem__")


def check_dataset(dataset: Any, what: str) -> Any:
    """`dataset` when it is a non-empty map-style Dataset; ConfigError (one line) else."""
    from torch.utils.data import DataLoader, IterableDataset
    if isinstance(dataset, DataLoader):
        raise ConfigError(f"{what} gave a DataLoader, which bamboo cannot replay ({REPLAYABLE}): "
                          f"pass its dataset (loader.dataset) and its collate_fn as collate")
    if isinstance(dataset, IterableDataset):
        raise ConfigError(f"{what} gave an IterableDataset, which bamboo cannot replay "
                          f"({REPLAYABLE}): pass a map-style Dataset (__len__ and __getitem__)")
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ConfigError(f"{what} gave {type(dataset).__name__}, not a map-style Dataset: give "
                          f"an object with __len__ and __getitem__(index) -> (inputs, labels)")
    try:
        size = len(dataset)
    except Exception as e:  # noqa: BLE001 - the user's code
        raise ConfigError(f"{what}: len() of the Dataset failed: {_line(e)}") from None
    if size < 1:
        raise ConfigError(f"{what} has no samples: give a Dataset of at least one sample")
    return dataset


def build_function(text: str, flag: str) -> Metric:
    """The loss or metric `text` names: a class called with its arguments, a function with
    them bound."""
    target, call = _build(text, flag)
    if inspect.isclass(target):
        try:
            return target(**call.kwargs)
        except Exception as e:  # noqa: BLE001 (the user's code: any error is theirs to fix)
            raise ConfigError(f"{flag} {text}: {_line(e)}", _key(flag)) from None
    return functools.partial(target, **call.kwargs) if call.kwargs else target


class DatasetSamples(Samples):
    """A user's map-style Dataset (and held-out one) as a Task's samples."""

    def __init__(self, train: Any, held_out: Any | None = None,
                 collate: Callable[[list[Any]], Any] | None = None) -> None:
        from torch.utils.data import default_collate
        self.train, self.held_out = train, held_out
        self.collate = collate or default_collate
        self.size = len(train)
        self.eval_size = len(held_out) if held_out is not None else None

    def batch(self, indices: list[int], val: bool) -> Batch:
        data = self.held_out if val else self.train
        if data is None:
            raise ValueError("no held-out Dataset: give --eval-dataset with --eval-every")
        sample = self.collate([data[i] for i in indices])
        if not isinstance(sample, (tuple, list)) or len(sample) != 2:
            raise ValueError(f"a sample of the Dataset is {type(sample).__name__}, not a pair "
                             f"(inputs, labels)")
        return Batch(_tuples(sample[0]), sample[1])


def _tuples(x: Any) -> Any:
    """The inputs with every list a tuple: torch's `default_collate` turns a sample's tuple
    into a list, and layer 0 takes (and the model declares) a tuple."""
    if isinstance(x, list):
        return tuple(_tuples(v) for v in x)
    if isinstance(x, dict):
        return {k: _tuples(v) for k, v in x.items()}
    return x


def job_task(cfg: JobConfig, preset: Any) -> Task:
    """The job's Task: its Dataset (or bamboo's data for `preset`), loss and metrics."""
    d, t = cfg.data, cfg.training
    kwargs = dict(seed=t.seed, global_micro_batches=cfg.global_micro_batches,
                  micro_batch_size=cfg.layout.micro_batch_size)
    if d.dataset is not None:
        collate = build_function(d.collate, "--collate") if d.collate else None
        held_out = build_dataset(d.eval_dataset, "--eval-dataset") if d.eval_dataset else None
        samples = DatasetSamples(build_dataset(d.dataset), held_out, collate)
        task = Task(samples=samples, **kwargs)
    else:
        task = make_task(preset, data_file=d.path, **kwargs)
    task.loss = build_function(t.loss, "--loss") if t.loss else None
    for text in t.metrics:
        name, call = parse_metric(text)
        task.metrics[name] = build_function(str(call), "--metric")
    return task


def check_job_data(cfg: JobConfig) -> None:
    """Build the job's data, loss and metrics here once and run them on its first
    micro-batch, so a wrong one is one line before any worker starts."""
    d, t = cfg.data, cfg.training
    if d.dataset is None and t.loss is None and not t.metrics:
        return
    if d.dataset is not None and cfg.evaluation.every and d.eval_dataset is None:
        raise ConfigError("--eval-every with --dataset needs --eval-dataset (the held-out "
                          "samples): give one, or --eval-every 0", "eval_every", "eval_dataset")
    task = job_task(cfg, None if d.dataset is not None else cfg.model_preset(_SIZING))
    for what, call in (("--dataset", lambda: task.batch(0, 0)),
                       ("--eval-dataset", lambda: task.eval_batch(0) if d.eval_dataset else None)):
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the user's code
            raise ConfigError(f"{what}: its first micro-batch failed: {_line(e)}",
                              _key(what)) from None
    if d.dataset is not None:
        _check_inputs(cfg, task)
    if task.loss is not None or task.metrics:
        _check_on_outputs(cfg, task)


@functools.cache
def first_inputs(dataset: str, collate: str | None) -> str:
    """What the Dataset `dataset` hands layer 0 per sample, as text (bamboo.model.spec_text):
    its first sample made a micro-batch of one by `collate` (torch's default_collate when
    None). Every process reads the same: the shapes of a model trained on it come from here.
    A Dataset that cannot be read gives why (`unreadable_text`): `check_job_data` says it in
    its own words, and a model that needs the shapes is refused with it."""
    from bamboo.model.pipeline import ModelError
    from bamboo.model.spec_text import sample_spec, spec_text, unreadable_text
    try:
        samples = DatasetSamples(build_dataset(dataset), collate=build_function(
            collate, "--collate") if collate else None)
        return spec_text(sample_spec(samples.batch([0], val=False).inputs))
    except (ConfigError, ModelError) as e:
        return unreadable_text(str(e))
    except Exception as e:  # noqa: BLE001 - the user's code
        return unreadable_text(f"--dataset: its first sample failed: {_line(e)}")


_SIZING = CustomSizing(model=size_custom_model, dataset_inputs=first_inputs)
"""`bamboo.data.sizing.SIZING`'s functions, this module's own (that module reads Datasets
through this one)."""


def _model_inputs(cfg: JobConfig) -> tuple[Any, bool] | None:
    """(what the job's model's layer 0 takes per sample, whether the model declares it), or
    None for bamboo's presets, which declare nothing (a GPT-2 takes token ids up to its
    context, the CNN images of its own): only your model can be told what it takes."""
    from bamboo.model.api import model_of
    p = cfg.model_preset(_SIZING)
    if p.family != "custom":
        return None
    model = model_of(p)
    return model.input_spec, model.inputs is not None


def _check_inputs(cfg: JobConfig, task: Task) -> None:
    """ConfigError (one line naming both) when the first micro-batch's inputs, per sample,
    are not what the model's layer 0 takes (structure, shape, dtype). A model that declares
    no `inputs` takes `[context]` int64 token ids: it is held to that only by a Dataset whose
    inputs are token ids (one integer tensor); other inputs meet its layer 0 in the run."""
    import torch

    from bamboo.model.pipeline import TensorSpec, describe_spec
    from bamboo.model.structure import StructureError, flatten, unflatten
    known = _model_inputs(cfg)
    if known is None:
        return
    spec, declared = known
    d = cfg.data
    for flag, text, batch in (("--dataset", d.dataset, lambda: task.batch(0, 0)),
                              ("--eval-dataset", d.eval_dataset, lambda: task.eval_batch(0))):
        if text is None:
            continue
        inputs = batch().inputs
        tokens = isinstance(inputs, torch.Tensor) and not (
            inputs.dtype.is_floating_point or inputs.dtype.is_complex or inputs.dtype == torch.bool)
        if not (declared or tokens):
            continue
        try:
            items, treedef = flatten(inputs)
        except StructureError:
            items, treedef = [], None
        specs, expected = flatten(spec, leaf=TensorSpec)
        samples = [t[0] if t.dim() else t for t in items]  # one sample's: the batch's first
        if treedef == expected and all((t.shape, t.dtype) == (s.shape, s.dtype)
                                       for t, s in zip(samples, specs)):
            continue
        have = describe_spec(unflatten(treedef, samples)) if treedef else describe_spec(inputs)
        how = ("PipelineModel(inputs=...)" if declared else "token ids, the default: declare "
               "what it takes with PipelineModel(inputs=...)")
        raise ConfigError(f"{flag} {text}: a sample's inputs are {have} but the model's layer 0 "
                          f"takes {describe_spec(spec)} ({how})", _key(flag))


def _check_on_outputs(cfg: JobConfig, task: Task) -> None:
    """The loss and metrics on the first micro-batch's labels and zeros shaped as the model's
    output for its inputs (the layers run on the meta device: shapes only, no memory): a
    loss or metric that does not fit the model's output or the labels is one line now, not
    a failed worker. A model that cannot run on the meta device is not checked here."""
    import torch

    from bamboo.model import build_layer
    from bamboo.model.meta import shapes_only
    batch, p = task.batch(0, 0), cfg.model_preset(_SIZING)
    try:
        with shapes_only(), torch.no_grad():
            x = on_device(batch.inputs, "meta")
            for index in range(p.layers):
                x = build_layer(p, index, cfg.training.seed, device="meta")(x)
    except Exception:  # noqa: BLE001 - checked in the workers, where it runs for real
        return
    if not isinstance(x, torch.Tensor):
        return
    outputs = torch.zeros(x.shape, dtype=torch.float32)
    checks = [("--loss", "loss", task.loss)] if task.loss is not None else []
    checks += [("--metric", f"metric '{name}'", fn) for name, fn in task.metrics.items()]
    for flag, what, fn in checks:
        try:
            with torch.no_grad():
                value = fn(outputs, batch.targets)
        except Exception as e:  # noqa: BLE001 - the user's code
            raise ConfigError(f"{flag}: the {what} failed on the model's output "
                              f"{list(x.shape)} and the labels {_shapes(batch.targets)}: "
                              f"{_line(e)}", _key(flag)) from None
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise ConfigError(f"{flag}: the {what} returned {type(value).__name__} "
                              f"{list(getattr(value, 'shape', []))}, not a scalar tensor",
                              _key(flag))


def _shapes(x: Any) -> str:
    """`[4, 8]`, or the shapes of a tuple or dict of tensors."""
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {_shapes(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(_shapes(v) for v in x) + ")"
    return str(list(getattr(x, "shape", [])))


def _key(flag: str) -> str:
    return {"--metric": "metrics"}.get(flag, flag.lstrip("-").replace("-", "_"))


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (f"{type(e).__name__}: {text[0]}" if text else type(e).__name__)[:300]


@functools.cache
def _dataset_size(text: str) -> int:
    return len(build_dataset(text))


def data_position(cfg: JobConfig, steps: int) -> dict[str, Any] | None:
    """Where the job stands in its Dataset after `steps` steps (`bamboo.data.sampling`):
    checkpoints and summary.json's `data`; None for bamboo's own (unbounded) sources."""
    if cfg.data.dataset is None:
        return None
    n = _dataset_size(cfg.data.dataset)
    here = position_after(steps, cfg.global_micro_batches, cfg.layout.micro_batch_size, n)
    return {"dataset": cfg.data.dataset, **here.to_dict()}


def check_resume_position(cfg: JobConfig, made_with: dict[str, Any], step: int,
                          what: str) -> None:
    """ConfigError when a checkpoint at `step` (its meta `made_with`) stands elsewhere in
    the data than this job would after `step` steps: another dataset, another size, or
    bamboo's own data for a Dataset (or the reverse)."""
    recorded, here = made_with.get("data"), data_position(cfg, step)
    if "losses" not in made_with or recorded == here:
        return
    if recorded is None or here is None:
        had = "bamboo's own data" if recorded is None else f"--dataset {recorded.get('dataset')}"
        has = "bamboo's own data" if here is None else f"--dataset {cfg.data.dataset}"
        raise ConfigError(f"{what} was trained on {had}, this job on {has}: resume with the "
                          f"same data (or another --out for a new run)", "dataset")
    for key in ("dataset", "dataset_size", "epoch", "position"):
        if recorded.get(key) != here[key]:
            raise ConfigError(f"{what} stands at epoch {recorded.get('epoch')} position "
                              f"{recorded.get('position')} of a dataset of "
                              f"{recorded.get('dataset_size')} samples ({recorded.get('dataset')}); "
                              f"this job would be at epoch {here['epoch']} position "
                              f"{here['position']} of {here['dataset_size']} ({here['dataset']}): "
                              f"resume with the same dataset", "dataset")
