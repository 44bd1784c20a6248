"""What travels between two layers: one tensor, or a tuple or a dict of tensors.

A layer returns a tensor, a tuple of them, or a dict of `str` to them (tuples and dicts
may nest); the next layer gets that value as its one argument, as in DeepSpeed's pipeline
engine. `flatten` turns such a value into its tensors (the leaves, in a fixed order: a
tuple's in order, a dict's by insertion order) and its `Treedef`; `unflatten` builds the
value again. The spec of a boundary is the same structure of `TensorSpec`s.

Between nodes a boundary travels as one message whatever its structure
(`BoundarySpec.shape` and `.dtype` are the message's): one tensor is sent as it is, as
always; a structure is packed into one byte buffer, each tensor at an offset aligned to 16
bytes, and the receiver views its tensors in the buffer without copying. Floating-point
tensors get a gradient back (one message too: a structure's float tensors packed the same
way, or the one float tensor itself when there is only one); the others (masks, ids,
labels) travel forward only, with no `requires_grad` and nothing sent back. A float tensor
the next stage did not use (its gradient is None) gets zeros back, so every gradient
message has the same layout.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Treedef", "StructureError", "flatten", "unflatten", "describe", "map_floats",
           "float32", "detach", "BoundarySpec", "StructuredSpec", "leaves"]

_ALIGN = 16
"""Byte alignment of each tensor in a packed buffer (any dtype's view of it is aligned)."""


class StructureError(ValueError):
    """A value that is neither a tensor nor a tuple or dict of them."""


@dataclass(frozen=True, slots=True)
class Treedef:
    """The shape of a structure without its tensors: "tensor", "tuple" or "dict"."""

    kind: str
    keys: tuple[str, ...] = ()
    children: tuple[Treedef, ...] = ()

    def __str__(self) -> str:
        if self.kind == "tensor":
            return "tensor"
        if self.kind == "tuple":
            return f"({', '.join(map(str, self.children))}{',' if len(self.children) == 1 else ''})"
        return "{" + ", ".join(f"{k!r}: {c}" for k, c in zip(self.keys, self.children)) + "}"


_TENSOR = Treedef("tensor")


def flatten(value: Any, leaf: type = torch.Tensor) -> tuple[list[Any], Treedef]:
    """The leaves of `value` (instances of `leaf`) in order, and its structure.
    StructureError naming what is neither a leaf nor a tuple or a str-keyed dict."""
    out: list[Any] = []
    return out, _flatten(value, leaf, out, "")


def _flatten(value: Any, leaf: type, out: list[Any], at: str) -> Treedef:
    if isinstance(value, leaf):
        out.append(value)
        return _TENSOR
    if type(value) is tuple or (isinstance(value, tuple) and not hasattr(value, "_fields")):
        return Treedef("tuple", (), tuple(_flatten(v, leaf, out, f"{at}[{i}]")
                                          for i, v in enumerate(value)))
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise StructureError(f"a dict{' at ' + at if at else ''} with the key {bad[0]!r} "
                                 f"(keys are strings)")
        return Treedef("dict", tuple(value), tuple(_flatten(v, leaf, out, f"{at}[{k!r}]")
                                                   for k, v in value.items()))
    raise StructureError(f"{type(value).__name__}{' at ' + at if at else ''}")


def unflatten(treedef: Treedef, leaves: Sequence[Any]) -> Any:
    """The value of structure `treedef` with `leaves` in flatten's order."""
    if treedef.kind == "tensor":
        return leaves[0]
    return _unflatten(treedef, iter(leaves))


def _unflatten(treedef: Treedef, it: Iterator[Any]) -> Any:
    if treedef.kind == "tensor":
        return next(it)
    children = [_unflatten(c, it) for c in treedef.children]
    return tuple(children) if treedef.kind == "tuple" else dict(zip(treedef.keys, children))


def describe(value: Any) -> str:
    """A value's type for a message: `tuple of (Tensor, list)`, `dict of {'a': int}`."""
    if isinstance(value, tuple):
        return f"tuple of ({', '.join(type(v).__name__ for v in value)})"
    if isinstance(value, dict):
        return "dict of {" + ", ".join(f"{k!r}: {type(v).__name__}"
                                       for k, v in value.items()) + "}"
    return type(value).__name__


def map_floats(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """`value` with `fn` applied to its floating-point tensors (the others as they are)."""
    if isinstance(value, torch.Tensor):
        return fn(value) if value.is_floating_point() else value
    items, treedef = flatten(value)
    return unflatten(treedef, [fn(t) if t.is_floating_point() else t for t in items])


def float32(value: Any) -> Any:
    """A last stage's output for the loss: its floating tensors in float32."""
    if isinstance(value, torch.Tensor):
        return value.float()
    return map_floats(lambda t: t.float(), value)


def detach(value: Any) -> Any:
    """`value` with every tensor detached (no copy)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    items, treedef = flatten(value)
    return unflatten(treedef, [t.detach() for t in items])


def leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of a value (a tensor, tuple or dict of them)."""
    return [value] if isinstance(value, torch.Tensor) else flatten(value)[0]


@dataclass(frozen=True, slots=True)
class BoundarySpec:
    """One tensor out of a layer for one micro-batch: its shape (batch dimension first) and
    dtype, which are also the message's. The value passes every method as it is (no copy)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def grad_shape(self) -> tuple[int, ...]:
        return self.shape

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.dtype

    def pack(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def unpack(self, wire: torch.Tensor) -> torch.Tensor:
        return wire

    def pack_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def unpack_grad(self, wire: torch.Tensor) -> torch.Tensor:
        return wire

    def cast(self, value: torch.Tensor) -> torch.Tensor:
        """A stage's output in the boundary's dtype (bf16 autocast may have changed it)."""
        return value.to(self.dtype)

    def as_input(self, value: torch.Tensor) -> torch.Tensor:
        """A received or handed-on value as the next stage's input: a leaf of its graph."""
        return value.detach().requires_grad_(value.is_floating_point())

    def grad_pairs(self, out: torch.Tensor, grad: torch.Tensor) -> tuple[Any, Any]:
        """(outputs, their gradients) for `torch.autograd.backward`."""
        return out, grad

    def grad_inputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The input's tensors that take a gradient (for `torch.autograd.grad`)."""
        return [x] if x.requires_grad else []

    def input_grads(self, x: torch.Tensor) -> torch.Tensor | None:
        """The gradient to send back after a backward of the input `x`."""
        return x.grad

    def grads_of(self, x: torch.Tensor, dxs: Sequence[torch.Tensor | None]) -> Any:
        """The gradient to send back from `torch.autograd.grad`'s results for `grad_inputs(x)`."""
        return dxs[0] if dxs else None


@dataclass(frozen=True)
class StructuredSpec:
    """A tuple or dict of tensors out of a layer for one micro-batch: `specs` (batch
    dimension first) in flatten's order, packed into one uint8 message of `shape`."""

    treedef: Treedef
    specs: tuple[BoundarySpec, ...]
    offsets: tuple[int, ...] = field(init=False)
    shape: tuple[int, ...] = field(init=False)
    dtype: torch.dtype = field(init=False, default=torch.uint8)
    floats: tuple[int, ...] = field(init=False)
    """Indices of the floating-point tensors: those that get a gradient back."""
    grad_offsets: tuple[int, ...] = field(init=False)
    grad_shape: tuple[int, ...] = field(init=False)
    grad_dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        offsets, size = _layout(self.specs)
        floats = tuple(i for i, s in enumerate(self.specs) if s.dtype.is_floating_point)
        set_ = object.__setattr__
        set_(self, "offsets", offsets)
        set_(self, "shape", (size,))
        set_(self, "floats", floats)
        if len(floats) == 1:  # the one float tensor travels back as it is
            only = self.specs[floats[0]]
            set_(self, "grad_offsets", (0,))
            set_(self, "grad_shape", only.shape)
            set_(self, "grad_dtype", only.dtype)
        else:
            grad_offsets, grad_size = _layout([self.specs[i] for i in floats])
            set_(self, "grad_offsets", grad_offsets)
            set_(self, "grad_shape", (grad_size,))
            set_(self, "grad_dtype", torch.uint8)

    # -- activations ------------------------------------------------------------------------

    def pack(self, value: Any) -> torch.Tensor:
        items = flatten(value)[0]
        return _pack(items, self.offsets, self.shape[0])

    def unpack(self, wire: torch.Tensor) -> Any:
        return unflatten(self.treedef, _views(wire, self.specs, self.offsets))

    def cast(self, value: Any) -> Any:
        items, treedef = flatten(value)
        return unflatten(treedef, [t.to(s.dtype) if s.dtype.is_floating_point else t
                                   for t, s in zip(items, self.specs)])

    def as_input(self, value: Any) -> Any:
        items, treedef = flatten(value)
        return unflatten(treedef, [t.detach().requires_grad_(t.is_floating_point())
                                   for t in items])

    # -- gradients: a tuple, one per float tensor -------------------------------------------

    def pack_grad(self, grad: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if len(self.floats) == 1:
            return grad[0]
        return _pack(list(grad), self.grad_offsets, self.grad_shape[0])

    def unpack_grad(self, wire: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(self.floats) == 1:
            return (wire,)
        return tuple(_views(wire, [self.specs[i] for i in self.floats], self.grad_offsets))

    def grad_pairs(self, out: Any, grad: tuple[torch.Tensor, ...]) -> tuple[Any, Any]:
        items = flatten(out)[0]
        pairs = [(items[i], g) for i, g in zip(self.floats, grad) if items[i].requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def grad_inputs(self, x: Any) -> list[torch.Tensor]:
        items = flatten(x)[0]
        return [items[i] for i in self.floats if items[i].requires_grad]

    def input_grads(self, x: Any) -> tuple[torch.Tensor, ...]:
        items = flatten(x)[0]
        return tuple(_or_zeros(items[i].grad, items[i]) for i in self.floats)

    def grads_of(self, x: Any, dxs: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
        items = flatten(x)[0]
        got = dict(zip((id(t) for t in self.grad_inputs(x)), dxs))
        return tuple(_or_zeros(got.get(id(items[i])), items[i]) for i in self.floats)


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like, memory_format=torch.contiguous_format) if grad is None else grad


def _layout(specs: Sequence[BoundarySpec]) -> tuple[tuple[int, ...], int]:
    """Each tensor's byte offset in a packed buffer (aligned), and the buffer's size."""
    offsets, size = [], 0
    for s in specs:
        offsets.append(size)
        size += -(-math.prod(s.shape) * s.dtype.itemsize // _ALIGN) * _ALIGN
    return tuple(offsets), max(size, _ALIGN)


def _pack(items: list[torch.Tensor], offsets: Sequence[int], size: int) -> torch.Tensor:
    """`items` copied into one uint8 buffer at `offsets` (one copy each, no more)."""
    buf = torch.empty(size, dtype=torch.uint8, device=items[0].device)
    for t, at in zip(items, offsets, strict=True):
        n = t.numel() * t.element_size()
        buf[at:at + n].view(t.dtype).view(t.shape).copy_(t.detach())
    return buf


def _views(wire: torch.Tensor, specs: Sequence[BoundarySpec],
           offsets: Sequence[int]) -> list[torch.Tensor]:
    """The tensors of a packed buffer, as views of it (no copy)."""
    return [wire[at:at + math.prod(s.shape) * s.dtype.itemsize].view(s.dtype).view(s.shape)
            for s, at in zip(specs, offsets)]
