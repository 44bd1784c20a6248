"""The model type: `PipelineModel`, an ordered list of layer factories, the `TensorSpec`s of
what layer 0 takes and of what travels between the layers, and a loss (`bamboo.model.api`
is where a user imports them)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bamboo.model.structure import BoundarySpec, StructuredSpec, StructureError, flatten, unflatten
from bamboo.model.ties import TieError, check_ties

__all__ = ["ModelError", "next_token_loss", "TensorSpec", "Boundary", "PipelineModel",
           "boundary_spec", "token_inputs", "describe_spec", "zeros_of", "check_spec"]


class ModelError(ValueError):
    """A model that cannot be used as declared; the message is one line."""


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `[B, T, V]` logits against `[B, T]` targets (-100 ignored)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=-100)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape of one sample (no batch dimension) and dtype of a tensor between layers."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        shape = self.shape
        if (not isinstance(shape, (tuple, list)) or not shape
                or not all(type(n) is int and n > 0 for n in shape)):
            raise ModelError(f"TensorSpec shape {shape!r} is not a tuple of positive integers "
                             f"(one sample, no batch dimension), e.g. TensorSpec((context, d))")
        if not isinstance(self.dtype, torch.dtype) or self.dtype.is_complex:
            raise ModelError(f"TensorSpec dtype {self.dtype!r} is not a real torch dtype "
                             f"(torch.float32 for what takes gradients; torch.bool or "
                             f"torch.int64 for masks and ids)")
        object.__setattr__(self, "shape", tuple(shape))


Boundary = TensorSpec | tuple | dict
"""What one layer hands the next, per sample: a TensorSpec, or a tuple or a dict of str to
TensorSpecs (nesting allowed), the structure of what the layer returns."""


def _structure(spec: object, what: str, needs_float: bool) -> Boundary:
    """`spec` checked as a boundary's structure of TensorSpecs (one line when it is not)."""
    try:
        items, _ = flatten(spec, leaf=TensorSpec)
    except StructureError as e:
        raise ModelError(f"PipelineModel {what} must be a TensorSpec, or a tuple or a dict "
                         f"of str to TensorSpecs (got {e} in {spec!r})") from None
    if not items:
        raise ModelError(f"PipelineModel {what} {spec!r} holds no TensorSpec")
    if needs_float and not any(s.dtype.is_floating_point for s in items):
        dtypes = ", ".join(str(s.dtype) for s in items)
        raise ModelError(f"PipelineModel {what} holds no floating tensor ({dtypes} is not a "
                         f"floating torch dtype): gradients flow back through the floating "
                         f"tensors between layers, so at least one must be (torch.float32)")
    return spec  # type: ignore[return-value]  # a structure of TensorSpecs, checked above


def check_spec(spec: object, what: str) -> Boundary:
    """`spec` (a model's `inputs` or `output`) when it is a TensorSpec, or a tuple or dict
    of them, of any dtypes; ModelError with one line else."""
    if not isinstance(spec, (TensorSpec, tuple, dict)):
        raise ModelError(f"PipelineModel {what} is {type(spec).__name__}, not a TensorSpec, "
                         f"or a tuple or a dict of them")
    if isinstance(spec, tuple) and spec and all(type(n) is int for n in spec):
        raise ModelError(f"PipelineModel {what} {spec!r} is a shape, not a TensorSpec: write "
                         f"TensorSpec({spec!r}), with its dtype unless torch.float32")
    return _structure(spec, what, needs_float=False)


@dataclass(frozen=True, kw_only=True)
class PipelineModel:
    """A model bamboo can cut into pipeline stages between any two of its layers."""

    layers: Sequence[Callable[[], nn.Module]]
    """One zero-argument factory per pipeline layer, in order; each returns an nn.Module."""
    boundary: Boundary | list[Boundary] | None = None
    """What travels between layers, per sample: a TensorSpec, or a tuple or dict of them
    (one structure for every boundary), or a list of them, one per boundary."""
    context: int | None = None
    """Positions per sample (tokens, patches): the default `inputs` and `output` are per
    token, and the memory estimate counts activations per position. A model that declares
    both its `inputs` and its `output` (an image classifier) may leave it out: it is then 1;
    one trained on a Dataset may too (its shapes come from the first sample)."""
    vocab_size: int | None = None
    """Token ids are 0..vocab_size-1; needed for the default `output` (next-token logits),
    and for bamboo's own byte-token data (the synthetic language, text files)."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = next_token_loss
    """(last layer's output, `[B, context]` int64 targets) -> scalar mean loss."""
    output: Boundary | None = None
    """The last layer's output per sample; `[context, vocab_size]` float32 logits if None."""
    inputs: Boundary | None = None
    """What layer 0 receives per sample: a TensorSpec, or a tuple or dict of them (a
    Dataset's inputs as its collate makes them); `[context]` int64 token ids if None."""
    description: str = ""
    ties: Mapping[str, Sequence[tuple[int, str]]] = field(default_factory=dict)
    """Tied weights: key -> the (layer index, attribute path) of each use, e.g.
    `{"embed": [(0, "weight"), (5, "weight")]}` for an embedding reused as the head
    (bamboo.model.ties: the copies start equal and their gradients are added)."""
    boundaries: tuple[Boundary, ...] = field(init=False, repr=False)
    """The output of every layer (len(layers) specs, the last one `output`); empty while
    the model `is_open`."""

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
            raise ModelError(f"PipelineModel layers must be a list of zero-argument callables "
                             f"returning nn.Modules (got {type(layers).__name__})")
        if not layers:
            raise ModelError("PipelineModel has no layers: give at least one layer factory")
        for i, make in enumerate(layers):
            if not callable(make) or isinstance(make, nn.Module):
                raise ModelError(f"PipelineModel layers[{i}] is {type(make).__name__}, not a "
                                 f"zero-argument callable returning an nn.Module (e.g. "
                                 f"lambda: nn.Linear(d, d))")
        if self.context is None and self.inputs is not None and self.output is not None:
            object.__setattr__(self, "context", 1)
        if self.context is not None:
            _positive("context", self.context)
        if self.vocab_size is not None:
            _positive("vocab_size", self.vocab_size)
        if not callable(self.loss):
            raise ModelError(f"PipelineModel loss is {type(self.loss).__name__}, not a callable "
                             f"(output, targets) -> scalar mean loss")
        for spec, what in ((self.output, "output"), (self.inputs, "inputs")):
            if spec is not None:
                check_spec(spec, what)
        object.__setattr__(self, "layers", tuple(layers))
        try:
            object.__setattr__(self, "ties", check_ties(self.ties, len(layers)))
        except TieError as e:
            raise ModelError(f"PipelineModel {e}") from None
        if self.is_open:  # its shapes are traced when it is loaded (bamboo.model.forms)
            object.__setattr__(self, "boundaries", ())
            return
        output = self.output or TensorSpec((self.context, self.vocab_size))
        object.__setattr__(self, "boundaries", (*self._inner_boundaries(), output))

    @property
    def is_open(self) -> bool:
        """Whether some shapes are left to be traced: no `boundary` between several layers,
        or no `context` or `vocab_size` where the default inputs or output need one. Such a
        model gets them when it is loaded, from a Dataset's first sample or from token ids
        (`bamboo.model.forms.pipeline_model`); `boundaries` is empty until then."""
        return ((self.boundary is None and len(self.layers) > 1)
                or (self.context is None and (self.inputs is None or self.output is None))
                or (self.output is None and self.vocab_size is None))

    @property
    def input_spec(self) -> Boundary:
        """What layer 0 receives per sample: `inputs`, or `[context]` int64 token ids."""
        return self.inputs if self.inputs is not None else token_inputs(self.context)

    def _inner_boundaries(self) -> tuple[Boundary, ...]:
        n, spec = len(self.layers) - 1, self.boundary
        if spec is None and n == 0:
            return ()
        if isinstance(spec, (TensorSpec, tuple, dict)):  # one structure for every boundary
            return (_structure(spec, "boundary", needs_float=True),) * n
        if not isinstance(spec, list):
            raise ModelError(f"PipelineModel boundary must be a TensorSpec (the tensor between "
                             f"layers), a tuple or dict of them, or a list of {n}, one per "
                             f"boundary (got {spec!r})")
        if len(spec) != n:
            raise ModelError(f"PipelineModel boundary lists {len(spec)} specs but its {n + 1} "
                             f"layers need {n}, one per boundary (or one TensorSpec for all)")
        return tuple(_structure(s, f"boundary {i}", needs_float=True)
                     for i, s in enumerate(spec))


def _positive(name: str, value: object, why: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelError(f"PipelineModel {name}={value!r} is not a positive integer{why}")


def token_inputs(context: int) -> TensorSpec:
    """The default of `PipelineModel.inputs`: `[context]` int64 token ids per sample."""
    return TensorSpec((context,), torch.int64)


def describe_spec(spec: Any) -> str:
    """A per-sample spec for a message: `int64 [64]`, `(int64 [16], bool [16])`,
    `{'x': float32 [2]}`; a leaf is a TensorSpec, or a tensor (one sample's, as it is)."""
    if isinstance(spec, (TensorSpec, torch.Tensor)):
        return f"{str(spec.dtype).removeprefix('torch.')} [{', '.join(map(str, spec.shape))}]"
    if isinstance(spec, dict):
        return "{" + ", ".join(f"{k!r}: {describe_spec(v)}" for k, v in spec.items()) + "}"
    if isinstance(spec, tuple):
        return "(" + ", ".join(describe_spec(v) for v in spec) + ("," if len(spec) == 1
                                                                    else "") + ")"
    return type(spec).__name__


def zeros_of(spec: Any, batch: int = 1) -> Any:
    """A batch of `batch` samples of `spec` (a TensorSpec, or a tuple or dict of them):
    zeros, True for a bool mask (every position real), as the start-up trace feeds layer 0."""
    items, treedef = flatten(spec, leaf=TensorSpec)
    tensors = [torch.ones if s.dtype == torch.bool else torch.zeros for s in items]
    return unflatten(treedef, [make((batch, *s.shape), dtype=s.dtype)
                               for make, s in zip(tensors, items)])


def boundary_spec(spec: Any, batch: int) -> BoundarySpec | StructuredSpec:
    """The spec of a layer's output for a micro-batch of `batch` samples, from its
    per-sample spec (a TensorSpec, or a tuple or dict of them)."""
    items, treedef = flatten(spec, leaf=TensorSpec)
    specs = tuple(BoundarySpec((batch, *s.shape), s.dtype) for s in items)
    return specs[0] if treedef.kind == "tensor" else StructuredSpec(treedef, specs)
