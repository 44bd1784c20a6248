"""What layer 0 takes per sample, as text: a model's `inputs` spec written so that it can
travel in torch-free places (a `ModelPreset`, the job every process reads) and be read
back in any process.

    text = spec_text(TensorSpec((20,)))     # '{"dtype": "float32", "shape": [20]}'
    spec = spec_of_text(text)               # TensorSpec((20,), torch.float32)

`sample_spec(inputs)` is the per-sample spec of a micro-batch's inputs (a tensor, or a
tuple or dict of them, batch first): how the shapes of a model trained on a Dataset are
learnt from its first sample (bamboo.data.user), as DeepSpeed learns them from its first
batch at run time.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from bamboo.model.pipeline import Boundary, ModelError, TensorSpec
from bamboo.model.structure import StructureError, describe, flatten, unflatten

__all__ = ["spec_text", "spec_of_text", "sample_spec", "Unreadable", "unreadable_text"]


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A Dataset whose first sample could not be read (the job's check of its data says
    why, in its own words): a model that needs its shapes is refused with `reason`."""

    reason: str


def unreadable_text(reason: str) -> str:
    """The text of an `Unreadable` first sample."""
    return json.dumps({"unreadable": reason})


def _plain(spec: Any) -> Any:
    if isinstance(spec, TensorSpec):
        return {"shape": list(spec.shape), "dtype": str(spec.dtype).removeprefix("torch.")}
    if isinstance(spec, tuple):
        return {"tuple": [_plain(s) for s in spec]}
    return {"dict": [[k, _plain(v)] for k, v in spec.items()]}


def spec_text(spec: Boundary) -> str:
    """`spec` (a TensorSpec, or a tuple or dict of them) as JSON text."""
    return json.dumps(_plain(spec), sort_keys=True)


def _spec(plain: Any) -> Boundary:
    if "tuple" in plain:
        return tuple(_spec(s) for s in plain["tuple"])
    if "dict" in plain:
        return {k: _spec(v) for k, v in plain["dict"]}
    dtype = getattr(torch, plain["dtype"])
    return TensorSpec(tuple(plain["shape"]), dtype)


def spec_of_text(text: str) -> Boundary | Unreadable:
    """The spec `spec_text` wrote (or the `Unreadable` that `unreadable_text` wrote)."""
    plain = json.loads(text)
    if "unreadable" in plain:
        return Unreadable(plain["unreadable"])
    return _spec(plain)


def sample_spec(inputs: Any) -> Boundary:
    """The per-sample spec of a micro-batch's `inputs` (every tensor batch first): its
    structure, each tensor's shape without the batch dimension and its dtype. ModelError
    (one line) for what is not a tensor or a tuple or dict of them, or a sample that is a
    scalar."""
    try:
        items, treedef = flatten(inputs)
    except StructureError as e:
        raise ModelError(f"a sample's inputs are {describe(inputs)} ({e} is not a tensor): "
                         f"give a tensor, or a tuple or a dict of str to tensors") from None
    specs = []
    for t in items:
        if t.dim() < 2:
            raise ModelError(f"a sample's inputs hold a scalar ({t.dtype} of shape "
                             f"{list(t.shape[1:])} per sample): give it as a tensor of shape "
                             f"[1]")
        specs.append(TensorSpec(tuple(t.shape[1:]), t.dtype))
    return unflatten(treedef, specs)
