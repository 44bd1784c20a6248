"""`bamboo.Job(dataset=, eval_dataset=, loss=, metrics=, collate=)`: the job's own data,
loss and metrics, written as the calls every process makes again (`--dataset`,
`--eval-dataset`, `--loss`, `--metric`, `--collate`; `bamboo.data.user` builds them).

    dataset=make_train_set                           # def f() -> a map-style Dataset
    dataset=functools.partial(MyDataset, n=1000)     # a class with keyword arguments
    dataset="mydata:MyDataset(n=1000)"               # as --dataset takes it
    loss=functools.partial(torch.nn.CrossEntropyLoss, label_smoothing=0.1)
    metrics={"accuracy": accuracy}                   # def f(outputs, labels) -> scalar

A function or class must be importable by name (`bamboo.api.paths`). A Dataset object is
refused (the workers rebuild it by name), and so are a DataLoader and an IterableDataset,
whose order only their own iteration knows: a step must be replayable. Importable without
torch (types are told apart by name).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from bamboo.config import ConfigError

__all__ = ["data_options"]

_REPLAYABLE = ("a step must be replayable: bamboo picks every step's sample indices itself, "
               "so any node can redo it after a failure")


def data_options(dataset: Any, eval_dataset: Any, loss: Any,
                 options: dict[str, Any]) -> dict[str, Any]:
    """The job options (`dataset`, `eval_dataset`, `loss`, `metrics`, `collate`) of the API's
    data, loss and metric arguments, each written as the call every process makes again;
    `options` loses the `metrics` and `collate` it gave. ConfigError (one line) for what
    the workers could not rebuild."""
    from bamboo.api.optimizers import call_text
    out: dict[str, Any] = {}
    for name, value in (("dataset", dataset), ("eval_dataset", eval_dataset)):
        if value is not None:
            _refuse_unreplayable(name, value)
            out[name] = call_text(_by_name(value, name, _DATASET), name)
    if loss is not None:
        out["loss"] = call_text(_by_name(loss, "loss", _FUNCTION), "loss")
    if callable(options.get("collate")):
        out["collate"] = call_text(_by_name(options.pop("collate"), "collate", _FUNCTION),
                                   "collate")
    metrics = options.get("metrics", options.get("metric"))
    if isinstance(metrics, dict):
        options.pop("metrics", None), options.pop("metric", None)
        out["metrics"] = []
        for name, fn in metrics.items():
            what = f"metrics[{name!r}]"
            out["metrics"].append(f"{name}={call_text(_by_name(fn, what, _FUNCTION), what)}")
    return out


_DATASET = "a function or class that returns the Dataset"
_FUNCTION = "a function (outputs, labels) -> scalar tensor, or a class making one"


def _by_name(value: Any, name: str, kind: str) -> Any:
    """`value` when the workers can rebuild it by name (a function, class, partial of one,
    or call text); ConfigError naming what `name=` takes otherwise."""
    if isinstance(value, (str, functools.partial)) or inspect.isclass(value) or \
            inspect.isfunction(value) or inspect.isbuiltin(value):
        return value
    raise ConfigError(f"{name}= takes {kind}, defined at module level, a functools.partial "
                   f"of one, or 'MODULE:NAME(ARGS)' text (got {type(value).__name__}): the "
                   f"workers rebuild it by name", name.split("[")[0])


def _refuse_unreplayable(name: str, value: Any) -> None:
    """ConfigError for a DataLoader or an IterableDataset (checked by type name: no torch)."""
    kinds = {f"{c.__module__}.{c.__qualname__}" for c in type(value).__mro__}
    if any(k.startswith("torch.utils.data") and k.endswith(".DataLoader") for k in kinds):
        raise ConfigError(f"{name}= is a DataLoader, which bamboo cannot replay ({_REPLAYABLE}): "
                      f"pass a function returning its map-style dataset, and collate= its "
                      f"collate_fn", name)
    if any(k.startswith("torch.utils.data") and k.endswith(".IterableDataset") for k in kinds):
        raise ConfigError(f"{name}= is an IterableDataset, which bamboo cannot replay "
                      f"({_REPLAYABLE}): pass a function returning a map-style Dataset "
                      f"(__len__ and __getitem__)", name)
    if any(k.startswith("torch.utils.data") and k.endswith(".Dataset") for k in kinds):
        raise ConfigError(f"{name}= is a Dataset object, which the workers cannot rebuild: "
                      f"pass the function (or class) that returns it, defined at module level, "
                      f"or 'MODULE:NAME(ARGS)'", name)
