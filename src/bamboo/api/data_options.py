"""`bamboo.Job(dataset=, eval_dataset=, loss=, metrics=, collate=)`: the job's own data,
loss and metrics, written as the calls every process makes again (`--dataset`,
`--eval-dataset`, `--loss`, `--metric`, `--collate`; `bamboo.data.user` builds them).

    dataset=make_train_set                           # def f() -> a map-style Dataset
    dataset=functools.partial(MyDataset, n=1000)     # a class with keyword arguments
    dataset="mydata:MyDataset(n=1000)"               # as --dataset takes it
    loss=functools.partial(torch.nn.CrossEntropyLoss, label_smoothing=0.1)
    metrics={"accuracy": accuracy}                   # def f(outputs, labels) -> scalar

A function or class is taken by its import path (`bamboo.api.paths`); one without (a
lambda, a closure, a notebook's function) and an object (a small Dataset, a loss module
such as `nn.CrossEntropyLoss(label_smoothing=0.1)`) are sent by value
(`bamboo.config.objects`: cloudpickle, every process loading it whole; a large Dataset is
given as the function that builds it). A DataLoader and an IterableDataset are refused: their order only
their own iteration knows, and a step must be replayable. Importable without torch (types
are told apart by name).
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
    out: dict[str, Any] = {}
    for name, value in (("dataset", dataset), ("eval_dataset", eval_dataset)):
        if value is not None:
            _refuse_unreplayable(name, value)
            out[name] = _text(value, name, _DATASET)
    if loss is not None:
        out["loss"] = _text(loss, "loss", _FUNCTION)
    if callable(options.get("collate")):
        out["collate"] = _text(options.pop("collate"), "collate", _FUNCTION)
    metrics = options.get("metrics", options.get("metric"))
    if isinstance(metrics, dict):
        options.pop("metrics", None), options.pop("metric", None)
        out["metrics"] = [f"{name}={_text(fn, f'metrics[{name!r}]', _FUNCTION)}"
                          for name, fn in metrics.items()]
    return out


_DATASET = "a map-style Dataset, or a function or class that returns one"
_FUNCTION = "a function (outputs, labels) -> scalar tensor, a class making one, or such an object"


def _text(value: Any, name: str, kind: str) -> str:
    """The call text every process rebuilds `value` by: a function, class or partial by its
    import path (sent by value when it has none: a lambda, a closure, a notebook's); an
    object (a Dataset, an `nn.CrossEntropyLoss(...)`) sent by value
    (`bamboo.config.objects`); call text as it is."""
    from bamboo.api.optimizers import call_text
    from bamboo.api.paths import reference
    if isinstance(value, (str, functools.partial)) or inspect.isclass(value) or \
            inspect.isfunction(value) or inspect.isbuiltin(value):
        return call_text(value, name, by_value=True)
    dataset = kind == _DATASET and hasattr(value, "__getitem__") and hasattr(value, "__len__")
    if dataset or (kind == _FUNCTION and callable(value)):
        return reference(value, name, by_value=True)
    raise ConfigError(f"{name}= takes {kind}, or 'MODULE:NAME(ARGS)' text (got "
                      f"{type(value).__name__})", name.split("[")[0])


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
