"""Other model forms, converted to a `PipelineModel`: an `nn.Sequential`, a list of
modules or of zero-argument factories, and a DeepSpeed `PipelineModule` or its list of
`LayerSpec`s (with its `loss_fn`).

A build function (`--model MODULE:FUNCTION`) may return any of them instead of a
`PipelineModel`, and `pipeline_model(obj, context=..., ...)` converts one in Python.
DeepSpeed is never imported here: its objects are recognised by their type's module and
their attributes, so the plain forms work without it installed.

- Modules given by value (the children of an `nn.Sequential`, the modules of a list) were
  initialised when the build function made them; each layer factory returns a deep copy.
  The build function runs in every process of a run, so `load_model` calls it with
  torch's generator seeded by a constant (`seeded_build`): every node builds the same
  parameters (the run's `--seed` does not change them; factories and `LayerSpec`s are
  built under the stream of (seed, layer index) instead, like every other model).
- Factories and `LayerSpec`s (`spec.build()`) are called for the layers a node holds.
- A `TiedLayerSpec` ties its `tied_weight_attr` to the same attribute of every other
  TiedLayerSpec of its key (bamboo.model.ties), and runs through its `forward_fn` when it
  has one. Only those attributes are shared: where DeepSpeed gives the uses on one stage
  one module, bamboo gives each use its own and ties the named parameters, which is the
  same computation for a `forward_fn` that uses only them (the usual tied head).
- A plain callable in a DeepSpeed layer list is a forward function (as in DeepSpeed);
  in a bamboo list it is a zero-argument factory.
- The tensors between layers and the last layer's output are found by running a batch of
  one sample of what layer 0 takes (zeros of `inputs`: `[1, context]` int64 token ids by
  default) through the layers on the meta device (on the CPU if an op has no meta
  kernel), unless `boundary` / `output` are given. A layer may return a tensor, or a
  tuple or a dict of str to tensors (nesting allowed; bamboo.model.structure): its spec
  is the same structure of `TensorSpec`s, as bamboo.model.api's start-up trace checks.
  Each holds at least one floating-point tensor (the gradient flows back through those;
  masks and ids travel without one). A list, None or any other value is refused.
- `context` (tokens per sample; a model whose `inputs` are declared may have none) and
  `vocab_size` come from the keywords, else from the object's attributes of that name, else
  from the build function's keyword defaults;
  `inputs` from the keyword, else the object's `inputs` attribute. A model fed token ids
  (no `inputs`) needs a `vocab_size`; one whose `inputs` are declared may have none.
- Sent by value (`bamboo.Job(model=<object>)`, bamboo.config.objects): any of these
  objects, or a factory no process can import (a lambda, a closure, a notebook's
  function); every process unpickles the same bytes (`Given`), so a module's
  parameters are the ones it had when the job was made.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from bamboo.model.meta import shapes_only
from bamboo.model.pipeline import (Boundary, ModelError, PipelineModel, TensorSpec,
                                   check_spec, describe_spec, next_token_loss, token_inputs,
                                   zeros_of)
from bamboo.model.structure import StructureError, describe, flatten, unflatten

__all__ = ["pipeline_model", "seeded_build", "BUILD_SEED", "is_model_object", "Given"]

BUILD_SEED = 0
"""The seed of torch's generator while a build function runs (`seeded_build`)."""

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@contextlib.contextmanager
def seeded_build() -> Iterator[None]:
    """Torch's CPU generator seeded by `BUILD_SEED`, and put back after: a build function
    that makes modules by value makes the same ones in every process."""
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(BUILD_SEED)
        yield


class _Copy:
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


def _from_deepspeed(obj: object) -> bool:
    return type(obj).__module__.split(".")[0] == "deepspeed"


def _is_layer_spec(obj: object) -> bool:
    """DeepSpeed's `LayerSpec` (or one with its interface), recognised without importing it."""
    names = {cls.__name__ for cls in type(obj).__mro__}
    return ("LayerSpec" in names and callable(getattr(obj, "build", None))
            and hasattr(obj, "typename") and hasattr(obj, "module_args"))


def _is_tied(obj: object) -> bool:
    return "TiedLayerSpec" in {cls.__name__ for cls in type(obj).__mro__} or (
        hasattr(obj, "tied_weight_attr") and hasattr(obj, "key"))


def _is_pipeline_module(obj: object) -> bool:
    return isinstance(obj, nn.Module) and _from_deepspeed(obj) and hasattr(obj, "_layer_specs")


class _TiedForward(nn.Module):
    """A TiedLayerSpec's module run through its `forward_fn(module, x)`."""

    def __init__(self, module: nn.Module, forward_fn: Callable) -> None:
        super().__init__()
        self.module, self.forward_fn = module, forward_fn

    def forward(self, x: object) -> object:
        return self.forward_fn(self.module, x)


class _TiedFactory:
    def __init__(self, spec: object) -> None:
        self.spec = spec

    def __call__(self) -> nn.Module:
        module = self.spec.build()  # type: ignore[attr-defined]
        forward_fn = getattr(self.spec, "forward_fn", None)
        return module if forward_fn is None else _TiedForward(module, forward_fn)


Ties = dict[str, list[tuple[int, str]]]


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


def _factories(items: Sequence[object], deepspeed: bool
               ) -> tuple[list[Callable[[], nn.Module]], Ties]:
    """One zero-argument factory per item of a layer list, and the ties of its
    TiedLayerSpecs (a key used once ties nothing, as in DeepSpeed)."""
    factories: list[Callable[[], nn.Module]] = []
    ties: Ties = {}
    attrs_of: dict[str, list[str]] = {}
    for i, item in enumerate(items):
        if _is_layer_spec(item):
            if _is_tied(item):
                factories.append(_TiedFactory(item))
                _tie_uses(item, i, ties, attrs_of)
            else:
                factories.append(item.build)  # type: ignore[attr-defined]
        elif isinstance(item, nn.Module):
            factories.append(_Copy(item))
        elif callable(item):
            factories.append(_FunctionFactory(item) if deepspeed else item)
        else:
            raise ModelError(f"layer {i} is {type(item).__name__}: a layer list holds "
                             f"nn.Modules, zero-argument factories returning one, or "
                             f"DeepSpeed LayerSpecs")
    return factories, {key: uses for key, uses in ties.items() if len(uses) > 1}


def _layers(obj: object) -> tuple[list[Callable[[], nn.Module]], Ties, Loss | None, str]:
    """(factories, ties, the object's own loss, what it is) of a model form; ModelError if
    `obj` is none."""
    if _is_pipeline_module(obj):
        return (*_factories(list(obj._layer_specs), deepspeed=True),  # type: ignore[attr-defined]
                getattr(obj, "loss_fn", None), "DeepSpeed PipelineModule")
    if isinstance(obj, nn.Sequential):
        return *_factories(list(obj), deepspeed=False), None, "nn.Sequential"
    if isinstance(obj, nn.Module):
        raise ModelError("one nn.Module, which bamboo cannot cut "
                         f"into layers: return nn.Sequential(...) of its layers, a list of "
                         f"them, or a bamboo.model.api.PipelineModel")
    if isinstance(obj, (list, tuple)):
        if not obj:
            raise ModelError("the layer list is empty: give at least one layer")
        deepspeed = any(_is_layer_spec(item) for item in obj)
        return (*_factories(obj, deepspeed), None,
                "list of LayerSpecs" if deepspeed else "list of layers")
    raise ModelError("not a bamboo.model.api.PipelineModel, an nn.Sequential, a list of modules or of zero-argument "
                     f"factories, or a DeepSpeed PipelineModule or list of LayerSpecs")


def _positive(obj: object, name: str, given: int | None, build: Callable | None,
              required: bool = True) -> int | None:
    """`name` (context or vocab_size): the keyword, the object's attribute, or the build
    function's keyword default; ModelError saying where to give it (None when it is not
    `required` and nothing gives it)."""
    value = given if given is not None else getattr(obj, name, None)
    if value is None and build is not None:
        try:
            parameter = inspect.signature(build).parameters.get(name)
        except (TypeError, ValueError):
            parameter = None
        if parameter is not None and parameter.default is not inspect.Parameter.empty:
            value = parameter.default
    if value is None and not required:
        return None
    if value is None:
        where = ("" if isinstance(obj, (list, tuple)) else f"set its `{name}` attribute, ")
        raise ModelError(f"no {name}: {where}give the build "
                         f"function a keyword `{name}` with a default, or return "
                         f"bamboo.model.forms.pipeline_model(model, {name}=N)")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelError(f"{name}={value!r} is not a positive integer")
    return value


class _Unrunnable(Exception):
    """A factory or forward that raised while the shapes were traced."""


def _run(layers: Sequence[Callable[[], nn.Module]], inputs: Boundary) -> list[object]:
    """Every layer's output for a batch of one sample of `inputs` (zeros; token ids by
    default): a tensor, or a tuple or dict of tensors (the next layer gets it as its one
    argument)."""
    x: object = zeros_of(inputs)
    outputs: list[object] = []
    for i, make in enumerate(layers):
        try:
            layer = make()
            x = layer(x)
        except Exception as e:
            raise _Unrunnable(f"layer {i} failed: {type(e).__name__}: "
                              f"{(str(e).strip().splitlines() or [''])[0]}") from None
        try:
            flatten(x)
        except StructureError as e:
            raise ModelError(f"layer {i} returns {describe(x)} ({e} is not a tensor): a layer "
                             f"returns a tensor, or a tuple or a dict of str to tensors"
                             ) from None
        outputs.append(x)
    return outputs


def _fed(inputs: Boundary, declared: bool) -> str:
    """What the trace fed layer 0, for a message."""
    if not declared and isinstance(inputs, TensorSpec):
        return f"a [1, {inputs.shape[0]}] batch of token ids"
    return f"a batch of one sample of its inputs {describe_spec(inputs)}"


def _derived_specs(layers: Sequence[Callable[[], nn.Module]], inputs: Boundary,
                   declared: bool) -> list[Boundary]:
    """The output spec of every layer (no batch dimension; a structure of TensorSpecs for a
    tuple or dict), traced on the meta device, on the CPU where that fails."""
    try:
        with shapes_only(), torch.no_grad():
            outputs = _run(layers, inputs)
    except _Unrunnable:
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                outputs = _run(layers, inputs)
        except _Unrunnable as e:
            hint = "" if declared else ", or inputs=TensorSpec(...) if layer 0 takes no token ids"
            raise ModelError(f"cannot find the tensors between layers on {_fed(inputs, declared)}"
                             f" ({e}): give boundary=TensorSpec(...) and output=TensorSpec(...)"
                             f"{hint} to bamboo.model.forms.pipeline_model") from None
    return [_spec_of(i, out, last=i == len(outputs) - 1) for i, out in enumerate(outputs)]


def _spec_of(i: int, out: object, last: bool) -> Boundary:
    """The per-sample spec of layer `i`'s output `out`: a TensorSpec, or the same tuple or
    dict of TensorSpecs. ModelError when no tensor of it is floating point (gradients flow
    back through the floating ones; masks and ids travel forward only)."""
    items, treedef = flatten(out)
    specs = [TensorSpec(tuple(t.shape[1:]) or (1,), t.dtype) for t in items]
    if not any(t.dtype.is_floating_point for t in items):
        what = "outputs" if last else "hands on"
        dtypes = ", ".join(str(t.dtype) for t in items) or "no tensor"
        raise ModelError(f"layer {i} {what} {dtypes}, not floating point: gradients flow "
                         f"back through it (end the layer in a float"
                         f"{'' if treedef.kind == 'tensor' else ', or add one'})")
    return unflatten(treedef, specs)


def pipeline_model(obj: object, *, context: int | None = None, vocab_size: int | None = None,
                   loss: Loss | None = None, boundary: Boundary | Sequence[Boundary] | None
                   = None, output: Boundary | None = None, inputs: Boundary | None = None,
                   description: str = "", build: Callable | None = None) -> PipelineModel:
    """`obj` (any model form of this module's docstring, or a PipelineModel, returned as
    it is) as a PipelineModel. `loss` defaults to a PipelineModule's `loss_fn`, else
    next-token cross-entropy; `inputs` (what layer 0 takes per sample) to the object's
    `inputs` attribute, else `[context]` int64 token ids; `build` is the function that
    returned `obj` (for its keyword defaults). ModelError with one line when it cannot be
    converted."""
    if isinstance(obj, PipelineModel):
        return obj
    try:
        return _convert(obj, context, vocab_size, loss, boundary, output, inputs, description,
                        build)
    except ModelError as e:
        raise ModelError(f"{type(obj).__name__}, {e}") from None


def _convert(obj: object, context: int | None, vocab_size: int | None, loss: Loss | None,
             boundary: Boundary | Sequence[Boundary] | None, output: Boundary | None,
             inputs: Boundary | None, description: str, build: Callable | None
             ) -> PipelineModel:
    layers, ties, own_loss, what = _layers(obj)
    inputs = inputs if inputs is not None else getattr(obj, "inputs", None)
    # positions per sample: what token ids need; a model whose inputs are declared may
    # leave it out (an image classifier: 1)
    context = _positive(obj, "context", context, build, required=inputs is None)
    # a model fed token ids has a vocabulary; one whose inputs are declared may have none
    vocab_size = _positive(obj, "vocab_size", vocab_size, build, required=inputs is None)
    if inputs is not None:  # checked before it is fed to the layers
        check_spec(inputs, "inputs")
    if boundary is None or output is None:
        specs = _derived_specs(layers, inputs if inputs is not None else token_inputs(context),
                               declared=inputs is not None)
        if boundary is None and len(layers) > 1:
            boundary = specs[:-1]
        output = output or specs[-1]
    return PipelineModel(layers=layers, boundary=boundary, context=context,
                         vocab_size=vocab_size, loss=loss or own_loss or next_token_loss,
                         output=output, inputs=inputs, description=description or what,
                         ties=ties)


def is_model_object(obj: object) -> bool:
    """Whether `obj` is a model itself (a form this module converts, or a PipelineModel)
    rather than a factory that returns one."""
    return isinstance(obj, (PipelineModel, nn.Module, list, tuple)) or _is_layer_spec(obj)


class Given:
    """A model object as a build function (what `bamboo.Job(model=<object>)` sends by
    value, bamboo.config.objects): called in each process, it returns the model it holds
    (converted by `pipeline_model` when it is another form, with the object's own `context`
    and `vocab_size`)."""

    def __init__(self, model: object) -> None:
        self.model = model

    def __call__(self, vocab_size: int | None = None) -> PipelineModel:
        kind = type(self.model).__name__
        return pipeline_model(self.model, description=f"{kind} sent by value")
