"""DeepSpeed's model forms as layer factories: a list of `LayerSpec`s (and `TiedLayerSpec`s,
nn.Modules and forward functions), and a built `PipelineModule`, whose layers keep the
parameters the object holds (loaded weights included).

DeepSpeed is never imported here: its objects are recognised by their type's module and
their attributes, so the plain forms work without it installed (bamboo.model.forms).

- A `LayerSpec` is built (`spec.build()`) by the node that holds its layer, under the
  stream of (seed, layer index), like every other factory.
- A built `PipelineModule` already holds its layers: the module DeepSpeed registered for
  layer i (its attribute `str(i)`) and the one module of each tied key (`tied_modules`).
  Each becomes a layer given by value (a deep copy, as an nn.Sequential's children), so
  the run starts from the object's own parameters. A PipelineModule built for several
  stages holds only its own stage's layers: sent by value it is refused, naming the fix;
  a build function's gives its LayerSpecs, built anew.
- A `TiedLayerSpec` ties its `tied_weight_attr` to the same attribute of every other
  TiedLayerSpec of its key (bamboo.model.ties), and runs through its `forward_fn` when it
  has one. Only those attributes are shared: where DeepSpeed gives the uses on one stage
  one module, bamboo gives each use its own and ties the named parameters, which is the
  same computation for a `forward_fn` that uses only them (the usual tied head).
- A plain callable in a DeepSpeed layer list is a forward function (as in DeepSpeed).
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from bamboo.model.pipeline import ModelError

__all__ = ["Ties", "Copy", "from_deepspeed", "is_layer_spec", "is_pipeline_module",
           "layer_factories", "pipeline_module_layers"]

Ties = dict[str, list[tuple[int, str]]]
Factory = Callable[[], nn.Module]


class Copy:
    """A layer given by value: each call returns a deep copy (on the meta device when
    that is the default device, as during the shape check)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self) -> nn.Module:
        if torch.get_default_device().type == "meta":
            return copy.deepcopy(self.module).to("meta")
        return copy.deepcopy(self.module)


class _Function(nn.Module):
    """A plain function of a DeepSpeed layer list (`lambda x: x.float()`), as a layer."""

    def __init__(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x)


class _FunctionFactory:
    def __init__(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.function = function

    def __call__(self) -> nn.Module:
        return _Function(self.function)


class _TiedForward(nn.Module):
    """A TiedLayerSpec's module run through its `forward_fn(module, x)`."""

    def __init__(self, module: nn.Module, forward_fn: Callable) -> None:
        super().__init__()
        self.module, self.forward_fn = module, forward_fn

    def forward(self, x: object) -> object:
        return self.forward_fn(self.module, x)


class _TiedFactory:
    """A TiedLayerSpec's layer: built from the spec, or (`built`) a copy of the module a
    built PipelineModule holds for its key."""

    def __init__(self, spec: object, built: nn.Module | None = None) -> None:
        self.spec, self.built = spec, built

    def __call__(self) -> nn.Module:
        module = (self.spec.build() if self.built is None  # type: ignore[attr-defined]  # a DeepSpeed LayerSpec, typed Any: DeepSpeed is optional
                  else Copy(self.built)())
        forward_fn = getattr(self.spec, "forward_fn", None)
        return module if forward_fn is None else _TiedForward(module, forward_fn)


def from_deepspeed(obj: object) -> bool:
    return type(obj).__module__.split(".")[0] == "deepspeed"


def is_layer_spec(obj: object) -> bool:
    """DeepSpeed's `LayerSpec` (or one with its interface), recognised without importing it."""
    names = {cls.__name__ for cls in type(obj).__mro__}
    return ("LayerSpec" in names and callable(getattr(obj, "build", None))
            and hasattr(obj, "typename") and hasattr(obj, "module_args"))


def _is_tied(obj: object) -> bool:
    return "TiedLayerSpec" in {cls.__name__ for cls in type(obj).__mro__} or (
        hasattr(obj, "tied_weight_attr") and hasattr(obj, "key"))


def is_pipeline_module(obj: object) -> bool:
    return isinstance(obj, nn.Module) and from_deepspeed(obj) and hasattr(obj, "_layer_specs")


def _tie_uses(item: object, i: int, ties: Ties, attrs_of: dict[str, list[str]]) -> None:
    """Add TiedLayerSpec `item` (layer `i`) to `ties`: one tie per tied attribute. As in
    DeepSpeed, a key's attributes are its first spec's `tied_weight_attr` (a name or a list
    of them; an empty list ties nothing), and each is read with getattr (a property that
    returns a parameter will do)."""
    key = str(getattr(item, "key", ""))
    if key not in attrs_of:
        attrs = getattr(item, "tied_weight_attr", ["weight"])
        attrs_of[key] = [attrs] if isinstance(attrs, str) else list(attrs)
    attrs = attrs_of[key]
    prefix = "" if getattr(item, "forward_fn", None) is None else "module."
    for attr in attrs:
        ties.setdefault(key if len(attrs) == 1 else f"{key}.{attr}", []).append(
            (i, prefix + attr))


def layer_factories(items: Sequence[object], deepspeed: bool,
                    built: dict[int, nn.Module] | None = None,
                    tied: dict[str, nn.Module] | None = None) -> tuple[list[Factory], Ties]:
    """One zero-argument factory per item of a layer list, and the ties of its
    TiedLayerSpecs (a key used once ties nothing, as in DeepSpeed). `built` and `tied` are
    a built PipelineModule's modules by layer index and by tied key: those layers are
    copies of them, not built anew."""
    factories: list[Factory] = []
    ties: Ties = {}
    attrs_of: dict[str, list[str]] = {}
    built, tied = built or {}, tied or {}
    for i, item in enumerate(items):
        if i in built:
            factories.append(Copy(built[i]))
        elif is_layer_spec(item) and _is_tied(item):
            factories.append(_TiedFactory(item, tied.get(str(getattr(item, "key", "")))))
            _tie_uses(item, i, ties, attrs_of)
        elif is_layer_spec(item):
            factories.append(item.build)  # type: ignore[attr-defined]  # a DeepSpeed LayerSpec, recognised by is_layer_spec
        elif isinstance(item, nn.Module):
            factories.append(Copy(item))
        elif callable(item):
            factories.append(_FunctionFactory(item) if deepspeed else item)
        else:
            raise ModelError(f"layer {i} is {type(item).__name__}: a layer list holds "
                             f"nn.Modules, zero-argument factories returning one, or "
                             f"DeepSpeed LayerSpecs")
    return factories, {key: uses for key, uses in ties.items() if len(uses) > 1}


def pipeline_module_layers(obj: nn.Module, strict: bool) -> tuple[list[Factory], Ties]:
    """The layers of a built PipelineModule, each a copy of the module it holds for it
    (its own parameters, loaded weights included). One built for several stages holds only
    its own stage's layers: ModelError when `strict` (an object sent by value, whose
    parameters are the point), else its LayerSpecs, built anew (a build function's, which
    every process calls)."""
    specs = list(obj._layer_specs)  # type: ignore[attr-defined]  # a PipelineModule's private list of specs
    modules = dict(obj.named_children())
    built = {i: modules[str(i)] for i in range(len(specs)) if str(i) in modules}
    tied = dict(getattr(obj, "tied_modules", None) or {})
    for i, item in enumerate(specs):
        missing = (i not in built if (is_layer_spec(item) and not _is_tied(item))
                   or isinstance(item, nn.Module)
                   else _is_tied(item) and str(getattr(item, "key", "")) not in tied)
        if missing and strict:
            raise ModelError(f"it was built for several stages and holds only its own "
                             f"stage's layers (not layer {i}), so its parameters cannot all "
                             f"be sent: build it with num_stages=1 (bamboo cuts the stages), "
                             f"or give a function that builds it")
        if missing:
            return layer_factories(specs, deepspeed=True)
    return layer_factories(specs, deepspeed=True, built=built, tied=tied)
