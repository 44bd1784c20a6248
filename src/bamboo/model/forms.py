"""Other model forms, converted to a `PipelineModel`: an `nn.Sequential`, a list of
modules or of zero-argument factories, a DeepSpeed `PipelineModule` or its list of
`LayerSpec`s (with its `loss_fn`; bamboo.model.forms_deepspeed), and a transformers
GPT-2, Llama or BERT language model (bamboo.model.hf_object).

A build function (`--model MODULE:FUNCTION`) may return any of them instead of a
`PipelineModel`, and `pipeline_model(obj, context=..., ...)` converts one in Python.
DeepSpeed and transformers are never imported here for the plain forms: their objects are
recognised by their type's module and attributes.

- Modules given by value (the children of an `nn.Sequential`, the modules of a list, the
  modules a built PipelineModule holds, a transformers model's tensors) keep the
  parameters they hold; each layer factory returns a deep copy. A build function runs in
  every process of a run, so `load_model` calls it with torch's generator seeded by a
  constant (`seeded_build`): every node builds the same parameters (the run's `--seed`
  does not change them; factories and `LayerSpec`s are built under the stream of (seed,
  layer index) instead, like every other model).
- The tensors between layers and the last layer's output are found by running a batch of
  one sample through the layers on the meta device (on the CPU if an op has no meta
  kernel), unless `boundary` / `output` are given: zeros of the declared `inputs`, else of
  what a Dataset's first sample hands layer 0 (`data_inputs`, as every process reads it
  from the job: bamboo.data.user.first_inputs), else `[1, context]` int64 token ids. A
  layer may return a tensor, or a tuple or a dict of str to tensors (nesting allowed;
  bamboo.model.structure): its spec is the same structure of `TensorSpec`s. Each holds at
  least one floating-point tensor (the gradient flows back through those; masks and ids
  travel without one). A list, None or any other value is refused; a layer that fails is
  named with its type and what it got.
- `context` (tokens per sample) and `vocab_size` are needed only for token ids fed without
  a Dataset: the keywords, else the object's attributes of that name, else the build
  function's keyword defaults. `inputs`: the keyword, else the object's `inputs` attribute.
- Sent by value (`bamboo.Job(model=<object>)`, bamboo.config.objects): any of these objects
  as its `LayerList` (`layer_list`: the layers listed, their shapes traced in each process),
  or a factory no process can import (a lambda, a closure, a notebook's function); every
  process unpickles the same bytes (`Given`).
"""
from __future__ import annotations

import contextlib
import enum
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from bamboo.model.forms_deepspeed import (
    Ties,
    is_layer_spec,
    is_pipeline_module,
    layer_factories,
    pipeline_module_layers,
)
from bamboo.model.hf_object import hf_object_layers, is_hf_model
from bamboo.model.meta import shapes_only
from bamboo.model.pipeline import (
    Boundary,
    ModelError,
    PipelineModel,
    TensorSpec,
    check_spec,
    describe_spec,
    next_token_loss,
    token_inputs,
    zeros_of,
)
from bamboo.model.spec_text import Unreadable
from bamboo.model.structure import StructureError, describe, flatten, unflatten

__all__ = ["pipeline_model", "seeded_build", "BUILD_SEED", "is_model_object", "Given",
           "LayerList", "layer_list"]

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


@dataclass(frozen=True, kw_only=True)
class LayerList:
    """A model form's layers before their shapes are known: what travels by value
    (`Given`), converted to a `PipelineModel` in each process once the shapes are traced
    (from a Dataset's first sample, or from token ids of `context` positions)."""

    layers: tuple[Callable[[], nn.Module], ...]
    ties: Ties = field(default_factory=dict)
    loss: Loss | None = None
    description: str = ""
    context: int | None = None
    vocab_size: int | None = None
    inputs: Boundary | None = None


def _layer_list(obj: object, by_value: bool = False) -> LayerList:
    """The layers (and ties, loss, sizes it carries) of a model form (`by_value`: an object
    sent by value, whose parameters must all travel); ModelError if `obj` is none."""
    if isinstance(obj, LayerList):
        return obj
    if isinstance(obj, PipelineModel):
        return LayerList(layers=tuple(obj.layers), ties=dict(obj.ties), loss=obj.loss,
                         description=obj.description, context=obj.context,
                         vocab_size=obj.vocab_size, inputs=obj.inputs)
    if is_pipeline_module(obj):
        layers, ties = pipeline_module_layers(obj, strict=by_value)  # type: ignore[arg-type]  # narrowed by is_pipeline_module, which mypy cannot see
        return LayerList(layers=tuple(layers), ties=ties, loss=getattr(obj, "loss_fn", None),
                         description="DeepSpeed PipelineModule")
    if is_hf_model(obj):
        hf = hf_object_layers(obj)  # type: ignore[arg-type]  # narrowed by is_hf_model, which mypy cannot see
        return LayerList(layers=tuple(hf.layers), ties=hf.ties, description=hf.description,
                         context=hf.context, vocab_size=hf.vocab_size)
    if isinstance(obj, nn.Sequential):
        layers, ties = layer_factories(list(obj), deepspeed=False)
        return LayerList(layers=tuple(layers), ties=ties, description="nn.Sequential")
    if isinstance(obj, nn.Module):
        raise ModelError("one nn.Module, which bamboo cannot cut "
                         "into layers: return nn.Sequential(...) of its layers, a list of "
                         "them, or a bamboo.model.api.PipelineModel")
    if isinstance(obj, (list, tuple)):
        if not obj:
            raise ModelError("the layer list is empty: give at least one layer")
        deepspeed = any(is_layer_spec(item) for item in obj)
        layers, ties = layer_factories(obj, deepspeed)
        return LayerList(layers=tuple(layers), ties=ties, description=(
            "list of LayerSpecs" if deepspeed else "list of layers"))
    raise ModelError("not a bamboo.model.api.PipelineModel, an nn.Sequential, a list of modules or of zero-argument "
                     "factories, or a DeepSpeed PipelineModule or list of LayerSpecs")


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
        hints = ([] if _name(obj) in ("list", "tuple") else [f"give PipelineModel({name}=N)"]
                 if isinstance(obj, PipelineModel) else [f"set its `{name}` attribute"])
        if build is not None and not isinstance(build, Given):
            hints.append(f"give the build function a keyword `{name}` with a default")
        if not isinstance(obj, PipelineModel):
            hints.append(f"return bamboo.model.forms.pipeline_model(model, {name}=N)")
        raise ModelError(f"no {name} for the token ids it is fed without a Dataset: train it "
                         f"on a Dataset (dataset=, --dataset), whose first sample gives its "
                         f"shapes, or {', or '.join(hints)}")
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
        kind = "its factory"
        try:
            layer = make()
            kind = type(layer).__name__
            x = layer(x)
        except Exception as e:  # noqa: BLE001 (the user's layer may raise anything)
            raise _Unrunnable(f"layer {i} ({kind}) got {_shapes(x)} and raised "
                              f"{type(e).__name__}: "
                              f"{(str(e).strip().splitlines() or [''])[0]}") from None
        try:
            flatten(x)
        except StructureError as e:
            raise ModelError(f"layer {i} returns {describe(x)} ({e} is not a tensor): a layer "
                             f"returns a tensor, or a tuple or a dict of str to tensors"
                             ) from None
        outputs.append(x)
    return outputs


def _shapes(x: object) -> str:
    """A batch for a message: `float32 [1, 64]`, `(int64 [1, 16], bool [1, 16])`."""
    try:
        flatten(x)
    except StructureError:
        return describe(x)
    return describe_spec(x)


def _fed(inputs: Boundary, declared: bool) -> str:
    """What the trace fed layer 0, for a message."""
    if not declared and isinstance(inputs, TensorSpec):
        return f"a [1, {inputs.shape[0]}] batch of token ids"
    return f"a batch of one sample of its inputs {describe_spec(inputs)}"


class _Fed(enum.Enum):
    """Where the traced inputs came from: what a failure's message tells the user."""

    TOKENS = "tokens"
    DECLARED = "declared"
    DATASET = "dataset"


def _derived_specs(layers: Sequence[Callable[[], nn.Module]], inputs: Boundary,
                   fed: _Fed) -> list[Boundary]:
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
            if fed is _Fed.DATASET:
                raise ModelError(f"the Dataset's first sample ({describe_spec(inputs)} per "
                                 f"sample) does not pass through it: {e}") from None
            hint = ("" if fed is _Fed.DECLARED else
                    ", or train it on a Dataset if layer 0 takes no token ids")
            raise ModelError(f"cannot find the tensors between layers on "
                             f"{_fed(inputs, fed is _Fed.DECLARED)} ({e}): give "
                             f"boundary=TensorSpec(...) and output=TensorSpec(...){hint} to "
                             f"bamboo.model.forms.pipeline_model") from None
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
                   description: str = "", build: Callable | None = None,
                   data_inputs: Boundary | Unreadable | None = None) -> PipelineModel:
    """`obj` (any model form of this module's docstring, or a PipelineModel, returned as
    it is) as a PipelineModel. `loss` defaults to a PipelineModule's `loss_fn`, else
    next-token cross-entropy; `inputs` (what layer 0 takes per sample) to the object's
    `inputs` attribute, else `data_inputs` (what a Dataset's first sample hands it), else
    `[context]` int64 token ids; `build` is the function that returned `obj` (for its
    keyword defaults). ModelError with one line when it cannot be converted."""
    if isinstance(obj, PipelineModel) and not obj.is_open:
        return obj
    if isinstance(obj, PipelineModel):  # what it declares, its other shapes traced
        boundary = boundary if boundary is not None else obj.boundary
        output = output if output is not None else obj.output
    try:
        return _convert(obj, _Said(context, vocab_size, loss, boundary, output, inputs,
                                    description, build), data_inputs)
    except ModelError as e:
        raise ModelError(f"{_name(obj)}, {e}") from None


def _name(obj: object) -> str:
    """What a message calls the model: its type's name (a layer list's own description)."""
    return obj.description.split(" ")[0] if isinstance(obj, LayerList) else type(obj).__name__


@dataclass(frozen=True, slots=True)
class _Said:
    """What `pipeline_model`'s keywords say of the model (None: not said)."""

    context: int | None
    vocab_size: int | None
    loss: Loss | None
    boundary: Boundary | Sequence[Boundary] | None
    output: Boundary | None
    inputs: Boundary | None
    description: str
    build: Callable | None


def _convert(obj: object, said: _Said, data_inputs: Boundary | Unreadable | None
             ) -> PipelineModel:
    model = _layer_list(obj)
    inputs = next((x for x in (said.inputs, getattr(obj, "inputs", None), model.inputs)
                   if x is not None), None)
    fed = _Fed.DECLARED if inputs is not None else _Fed.DATASET if isinstance(
        data_inputs, (TensorSpec, tuple, dict)) else _Fed.TOKENS
    if isinstance(data_inputs, Unreadable):
        if inputs is None:
            raise ModelError(f"its shapes come from the Dataset's first sample, which cannot "
                             f"be read: {data_inputs.reason}")
        data_inputs = None
    inputs = inputs if inputs is not None else data_inputs
    # positions per sample: what token ids need; a model fed a Dataset's or declared inputs
    # may have none (an image classifier: 1), or has the token ids' length
    context = _positive(obj, "context", said.context if said.context is not None
                        else model.context, said.build, required=inputs is None)
    context = context or _token_length(inputs)
    # a model fed token ids has a vocabulary; one fed other inputs may have none
    vocab_size = _positive(obj, "vocab_size", said.vocab_size if said.vocab_size is not None
                           else model.vocab_size, said.build, required=inputs is None)
    if inputs is not None:  # checked before it is fed to the layers
        check_spec(inputs, "inputs")
    boundary, output = said.boundary, said.output
    if boundary is None or output is None:
        specs = _derived_specs(model.layers, inputs if inputs is not None
                               else token_inputs(context), fed)  # type: ignore[arg-type]  # inputs is a spec or a tuple of them; both are accepted
        if boundary is None and len(model.layers) > 1:
            boundary = specs[:-1]
        output = output or specs[-1]
    return PipelineModel(layers=model.layers, boundary=boundary, context=context,
                         vocab_size=vocab_size,
                         loss=said.loss or model.loss or next_token_loss, output=output,
                         inputs=inputs, description=said.description or model.description,
                         ties=model.ties)


def _token_length(inputs: Boundary | None) -> int | None:
    """The positions of token ids (one 1-D integer tensor per sample), else None."""
    if isinstance(inputs, TensorSpec) and len(inputs.shape) == 1 and not (
            inputs.dtype.is_floating_point or inputs.dtype == torch.bool):
        return inputs.shape[0]
    return None


def is_model_object(obj: object) -> bool:
    """Whether `obj` is a model itself (a form this module converts, or a PipelineModel)
    rather than a factory that returns one."""
    return (isinstance(obj, (PipelineModel, LayerList, nn.Module, list, tuple))
            or is_layer_spec(obj))


def layer_list(obj: object) -> PipelineModel | LayerList:
    """A model object as what travels by value: a PipelineModel as it is, any other form
    as its `LayerList` (a DeepSpeed PipelineModule's modules without its process groups, a
    transformers model as bamboo's layers with its weights). ModelError with one line."""
    if isinstance(obj, PipelineModel):
        return obj
    try:
        listed = _layer_list(obj, by_value=True)
    except ModelError as e:
        raise ModelError(f"{type(obj).__name__}, {e}") from None
    return replace(listed, context=getattr(obj, "context", None) or listed.context,
                   vocab_size=getattr(obj, "vocab_size", None) or listed.vocab_size,
                   inputs=getattr(obj, "inputs", None) or listed.inputs,
                   description=f"{type(obj).__name__} sent by value")


class Given:
    """A model object as a build function (what `bamboo.Job(model=<object>)` sends by
    value, bamboo.config.objects): called in each process, it returns the model it holds,
    a PipelineModel or a `LayerList` whose shapes bamboo.model.api traces there (from the
    job's Dataset, or token ids)."""

    def __init__(self, model: object) -> None:
        self.model = model

    def __call__(self) -> object:
        return self.model
