"""The model type: `PipelineModel`, an ordered list of layer factories, the `TensorSpec`s of
what travels between them, and a loss (`bamboo.model.api` is where a user imports them)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bamboo.model.structure import (BoundarySpec, StructuredSpec, StructureError, flatten)

__all__ = ["ModelError", "next_token_loss", "TensorSpec", "Boundary", "PipelineModel",
           "boundary_spec"]


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
    return spec  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True)
class PipelineModel:
    """A model bamboo can cut into pipeline stages between any two of its layers."""

    layers: Sequence[Callable[[], nn.Module]]
    """One zero-argument factory per pipeline layer, in order; each returns an nn.Module."""
    boundary: Boundary | list[Boundary] | None = None
    """What travels between layers, per sample: a TensorSpec, or a tuple or dict of them
    (one structure for every boundary), or a list of them, one per boundary."""
    context: int
    """Tokens per sample: layer 0 receives `[B, context]` int64 token ids."""
    vocab_size: int
    """Token ids are 0..vocab_size-1."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = next_token_loss
    """(last layer's output, `[B, context]` int64 targets) -> scalar mean loss."""
    output: Boundary | None = None
    """The last layer's output per sample; `[context, vocab_size]` float32 logits if None."""
    description: str = ""
    boundaries: tuple[Boundary, ...] = field(init=False, repr=False)
    """The output of every layer (len(layers) specs, the last one `output`)."""

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
        for name in ("context", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelError(f"PipelineModel {name}={value!r} is not a positive integer")
        if not callable(self.loss):
            raise ModelError(f"PipelineModel loss is {type(self.loss).__name__}, not a callable "
                             f"(output, targets) -> scalar mean loss")
        output = self.output or TensorSpec((self.context, self.vocab_size))
        if not isinstance(output, (TensorSpec, tuple, dict)):
            raise ModelError(f"PipelineModel output is {type(output).__name__}, not a TensorSpec")
        _structure(output, "output", needs_float=False)
        object.__setattr__(self, "layers", tuple(layers))
        object.__setattr__(self, "boundaries", (*self._inner_boundaries(), output))

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


def boundary_spec(spec: Any, batch: int) -> BoundarySpec | StructuredSpec:
    """The spec of a layer's output for a micro-batch of `batch` samples, from its
    per-sample spec (a TensorSpec, or a tuple or dict of them)."""
    items, treedef = flatten(spec, leaf=TensorSpec)
    specs = tuple(BoundarySpec((batch, *s.shape), s.dtype) for s in items)
    return specs[0] if treedef.kind == "tensor" else StructuredSpec(treedef, specs)
