"""A layer's state as a peer receives it and a checkpoint stores it: its parameters and its
optimizer's per-parameter state, entry by entry, in exact bits, whatever the optimizer.

What a parameter's optimizer state holds is learned from the optimizer itself: one step of
the same optimizer class, with the options its group was built with, on a probe parameter
of the same shape, dtype and device (`probe_entries`, cached per shape, dtype, device and
options) gives the keys a stepped parameter's state holds and what each is: a tensor of any
shape and dtype (AdamW's moments, amsgrad's running maximum, Adafactor's factored row and
column variances, a step count kept as a tensor) or a Python scalar (a float, an int, a
bool: stored as a float64, int64 or bool tensor of no dimension, so its value comes back
exactly). Every node builds the same layers and the same optimizer, so a sender and a
receiver compute the same `LayerLayout`: a receive buffer is posted before the data
arrives. A state of any other kind (a list, None, a string) or one whose keys or shapes
change after the first step cannot be carried: ValueError, naming the optimizer.

The layout's entries, in order: `param.<name>` for every parameter of the layer
(`named_parameters()` names); then for every parameter its optimizer steps,
`held.<name>` (1 once the optimizer holds state for it, 0 before its first step) and
`optim.<name>.<key>` for each key of its state. Two forms of the same state:

- named tensors (`LayerState`): what a checkpoint stores (one DCP key each) and what a
  node keeps of its layers between generations (`snapshot`: CPU copies);
- one flat uint8 buffer (`LayerLayout.pack`): what a peer sends. Its first `HEADER` bytes
  are the layout's digest, checked by the receiver (`unpack`); every entry starts at a
  multiple of `ALIGN` bytes, so it unpacks as a view of the buffer, and a layer's buffer
  is a multiple of `ALIGN` long, so a stage's layers are simply concatenated.
"""
from __future__ import annotations

import copy
import enum
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Kind", "Entry", "LayerLayout", "LayerState", "layer_layout", "probe_entries",
           "read_state", "write_state", "snapshot", "group_options", "HEADER", "ALIGN"]

LayerState = dict[str, torch.Tensor]
"""A layer's state as named tensors (see the module docstring for the names)."""

HEADER = 16
"""Bytes of the layout's digest at the start of a packed layer."""

ALIGN = 16
"""Every entry of a packed layer starts at a multiple of this (the largest element size)."""


class Kind(enum.Enum):
    """What an entry of a layer's state is."""

    PARAM = "param"
    HELD = "held"
    """uint8 0/1: whether the optimizer holds state for the parameter (0 before its first step)."""
    TENSOR = "tensor"
    FLOAT = "float"
    INT = "int"
    BOOL = "bool"

    @property
    def scalar_dtype(self) -> torch.dtype | None:
        """The dtype a Python scalar of this kind is stored as (None: not a scalar)."""
        return _SCALAR_DTYPES.get(self)


_SCALAR_DTYPES = {Kind.FLOAT: torch.float64, Kind.INT: torch.int64, Kind.BOOL: torch.bool}
_SCALAR_KINDS = ((bool, Kind.BOOL), (int, Kind.INT), (float, Kind.FLOAT))  # bool first: an int


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of a layer's state."""

    name: str
    kind: Kind
    shape: tuple[int, ...]
    dtype: torch.dtype
    param: int
    """The index of its parameter among the layer's."""
    key: str | None = None
    """The optimizer state's key (TENSOR and scalar kinds)."""
    host: bool = False
    """A state tensor the optimizer keeps on the CPU while the parameter is elsewhere (a
    step count outside the fused or capturable kernels)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        """The part of the layout both sides must agree on (not where a tensor lives)."""
        return f"{self.name}|{self.kind.value}|{list(self.shape)}|{self.dtype}"


def _some(names: list[str]) -> str:
    """`names` counted, the first three named."""
    if not names:
        return "no entry"
    more = ", ..." if len(names) > 3 else ""
    return f"{len(names)} entr{'y' if len(names) == 1 else 'ies'} ({', '.join(names[:3])}{more})"


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """Where each entry of a layer's state lies in its packed buffer."""

    entries: tuple[Entry, ...]
    offsets: tuple[int, ...]
    nbytes: int
    """The packed buffer's length in bytes (its header included)."""
    digest: bytes

    @classmethod
    def of(cls, entries: Sequence[Entry]) -> LayerLayout:
        offsets, at = [], HEADER
        for e in entries:
            offsets.append(at)
            at = _aligned(at + e.nbytes)
        text = "\n".join(e.describe() for e in entries).encode()
        return cls(tuple(entries), tuple(offsets), _aligned(at),
                   hashlib.sha256(text).digest()[:HEADER])

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def check(self, state: Mapping[str, torch.Tensor], where: str) -> None:
        """ValueError (one line, starting with `where`) unless `state` holds exactly this
        layout's entries, each of its shape and dtype."""
        if sorted(state) != sorted(self.names()):
            extra, missing = sorted(set(state) - set(self.names())), \
                sorted(set(self.names()) - set(state))
            raise ValueError(f"{where}: its state has {_some(extra)} this model and optimizer "
                             f"do not keep and lacks {_some(missing)} (a different model or "
                             f"optimizer)")
        for e in self.entries:
            t = state[e.name]
            if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                raise ValueError(f"{where}: {e.name} is {t.dtype} {list(t.shape)}, this model "
                                 f"and optimizer keep {e.dtype} {list(e.shape)} (a different "
                                 f"model or optimizer)")

    def pack(self, state: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        """The state as one uint8 buffer on `device` (see the module docstring)."""
        flat = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        flat[:HEADER] = torch.frombuffer(bytearray(self.digest), dtype=torch.uint8)
        for e, at in zip(self.entries, self.offsets):
            t = state[e.name].detach().contiguous().reshape(-1)
            flat[at:at + e.nbytes].copy_(t.view(torch.uint8), non_blocking=False)
        return flat

    def unpack(self, flat: torch.Tensor, where: str) -> LayerState:
        """The named tensors of a packed buffer, as views of it; ValueError (one line, with
        `where`) when it was packed by another layout."""
        if flat.dtype != torch.uint8 or flat.numel() != self.nbytes:
            raise ValueError(f"{where}: a packed state of {flat.numel()} {flat.dtype} values, "
                             f"expected {self.nbytes} bytes (a different model or optimizer)")
        if bytes(flat[:HEADER].tolist()) != self.digest:
            raise ValueError(f"{where}: the state was packed by another layout (a different "
                             f"model or optimizer, or another optimizer option)")
        return {e.name: flat[at:at + e.nbytes].view(e.dtype).view(e.shape)
                for e, at in zip(self.entries, self.offsets)}


# -- learning a parameter's state from the optimizer ------------------------------------------

_VOLATILE = ("params",)
"""Group keys that are not options."""

_PROBES: dict[tuple, tuple[tuple[str, Kind, tuple[int, ...], torch.dtype, bool], ...]] = {}


def group_options(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """id(parameter) -> the options of its group as they are now (taken when the optimizer
    is built, before a schedule changes any of them: the layout is the built optimizer's)."""
    return {id(p): {k: copy.deepcopy(v) for k, v in group.items() if k not in _VOLATILE}
            for group in optimizer.param_groups for p in group["params"]}


def _value_kind(value: Any) -> Kind | None:
    if isinstance(value, torch.Tensor):
        return Kind.TENSOR
    return next((kind for t, kind in _SCALAR_KINDS if isinstance(value, t)), None)


def _rebuild(cls: type, options: dict[str, Any], defaults: dict[str, Any],
             probe: nn.Parameter) -> torch.optim.Optimizer:
    group = [{"params": [probe], **options}]
    try:
        return cls(group, **defaults)
    except TypeError:  # a constructor that takes other arguments than its defaults
        pass
    try:
        return cls(group)
    except Exception as e:  # noqa: BLE001 - whatever a user's constructor raises
        raise ValueError(f"{cls.__name__} cannot be rebuilt on a probe parameter "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}): "
                         f"what its per-parameter state holds cannot be known") from None


def _entries_of(cls: type, state: dict[str, Any]
                ) -> tuple[tuple[str, Kind, tuple[int, ...], torch.dtype, bool], ...]:
    out = []
    for key, value in state.items():
        kind = _value_kind(value)
        if kind is None:
            raise ValueError(f"{cls.__name__} keeps a {type(value).__name__} in its "
                             f"per-parameter state ({key!r}): only tensors and numbers can be "
                             f"carried to a peer or a checkpoint")
        if kind is Kind.TENSOR:
            out.append((str(key), kind, tuple(value.shape), value.dtype,
                        value.device.type == "cpu"))
        else:
            out.append((str(key), kind, (), kind.scalar_dtype, False))  # type: ignore[arg-type]  # a scalar entry has a scalar dtype, by its kind
    return tuple(out)


def probe_entries(optimizer: torch.optim.Optimizer, options: dict[str, Any],
                  shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                  ) -> tuple[tuple[str, Kind, tuple[int, ...], torch.dtype, bool], ...]:
    """(key, kind, shape, dtype, on the CPU) of what `optimizer`'s class keeps for a
    parameter of this shape, dtype and device in a group of `options` after a step, from
    two steps on a probe parameter (cached). ValueError (one line naming the optimizer)
    when the optimizer cannot be rebuilt, keeps what cannot be carried, or changes its
    state's keys or shapes after the first step."""
    cls = type(optimizer)
    key = (cls, tuple(shape), dtype, torch.device(device).type, repr(sorted(options.items())))
    if key not in _PROBES:
        probe = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
        rebuilt = _rebuild(cls, options, dict(optimizer.defaults), probe)
        seen = []
        for _ in range(2):
            probe.grad = torch.ones_like(probe)
            try:
                rebuilt.step()
            except Exception as e:  # noqa: BLE001 - e.g. an optimizer that needs a closure
                raise ValueError(f"{cls.__name__} could not step a probe parameter "
                                 f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
                                 f": what its per-parameter state holds cannot be known") from None
            seen.append(_entries_of(cls, dict(rebuilt.state.get(probe, {}))))
        if seen[0] != seen[1]:
            raise ValueError(f"{cls.__name__}'s per-parameter state changes after its first "
                             f"step ({[k for k, *_ in seen[0]]} then {[k for k, *_ in seen[1]]}): "
                             f"a peer restore or a checkpoint cannot carry it")
        _PROBES[key] = seen[1]
    return _PROBES[key]


def layer_layout(named: Sequence[tuple[str, nn.Parameter]],
                 optimizer: torch.optim.Optimizer | None,
                 options: Mapping[int, dict[str, Any]]) -> LayerLayout:
    """The layout of a layer's state: its parameters (`named`, in order) and what
    `optimizer` keeps for each one it steps (`options`: `group_options` as built)."""
    entries = [Entry(f"param.{n}", Kind.PARAM, tuple(p.shape), p.dtype, j)
               for j, (n, p) in enumerate(named)]
    for j, (n, p) in enumerate(named):
        if optimizer is None or id(p) not in options:
            continue  # a parameter the optimizer does not step keeps no state
        entries.append(Entry(f"held.{n}", Kind.HELD, (), torch.uint8, j))
        for key, kind, shape, dtype, host in probe_entries(optimizer, options[id(p)],
                                                           tuple(p.shape), p.dtype, p.device):
            entries.append(Entry(f"optim.{n}.{key}", kind, shape, dtype, j, key,
                                 host and p.device.type != "cpu"))
    return LayerLayout.of(entries)


# -- reading and writing a layer's live state ------------------------------------------------


def _scalar(kind: Kind, value: Any) -> torch.Tensor:
    return torch.tensor(value, dtype=kind.scalar_dtype)


def read_state(layout: LayerLayout, params: Sequence[nn.Parameter],
               optimizer: torch.optim.Optimizer | None, where: str) -> LayerState:
    """The layer's live state as named tensors: the parameters and state tensors
    themselves (no copies: `snapshot` copies them), scalars as new tensors, zeros for the
    state of a parameter not stepped yet. ValueError when the optimizer's state does not
    have the layout its probe gave (naming the optimizer)."""
    out: LayerState = {}
    state = optimizer.state if optimizer is not None else {}
    for e in layout.entries:
        p = params[e.param]
        per = state.get(p) if p in state else None
        if e.kind is Kind.PARAM:
            out[e.name] = p.detach()
        elif e.kind is Kind.HELD:
            out[e.name] = torch.tensor(1 if per else 0, dtype=torch.uint8)
            if per:
                _check_keys(layout, e.param, per, optimizer, where)
        elif not per:
            out[e.name] = torch.zeros(e.shape, dtype=e.dtype)
        elif e.kind is Kind.TENSOR:
            out[e.name] = per[e.key].detach()
        else:
            out[e.name] = _scalar(e.kind, per[e.key])
    return out


def _check_keys(layout: LayerLayout, param: int, per: dict[str, Any],
                optimizer: Any, where: str) -> None:
    mine = {e.key: e for e in layout.entries if e.param == param and e.key is not None}
    if set(per) != set(mine) or any(
            _value_kind(v) is not mine[k].kind or (isinstance(v, torch.Tensor) and (
                tuple(v.shape) != mine[k].shape or v.dtype != mine[k].dtype))
            for k, v in per.items()):
        raise ValueError(f"{where}: {type(optimizer).__name__} holds state "
                         f"{sorted(map(str, per))} for a parameter where a step on a probe "
                         f"parameter of its shape gave {sorted(mine)}: its state cannot be "
                         f"carried to a peer or a checkpoint")


def write_state(layout: LayerLayout, params: Sequence[nn.Parameter],
                optimizer: torch.optim.Optimizer | None, state: Mapping[str, torch.Tensor],
                place: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Set the layer's parameters and optimizer state from named tensors of this layout
    (checked by the caller). `place` puts a state tensor where the optimizer keeps it (the
    parameter's device, or host memory when the stage's optimizer state is offloaded);
    entries the optimizer keeps on the CPU go there."""
    with torch.no_grad():
        for e in layout.entries:
            if e.kind is Kind.PARAM:
                params[e.param].copy_(state[e.name])
    if optimizer is None:
        return
    for e in layout.entries:
        if e.kind is not Kind.HELD:
            continue
        p = params[e.param]
        if not int(state[e.name]):
            optimizer.state.pop(p, None)
            continue
        per: dict[str, Any] = {}
        for s in layout.entries:
            if s.param != e.param or s.key is None:
                continue
            t = state[s.name]
            if s.kind is Kind.TENSOR:
                per[s.key] = t.to("cpu", copy=True) if s.host else place(t)
            else:
                per[s.key] = (float if s.kind is Kind.FLOAT else
                              int if s.kind is Kind.INT else bool)(t.item())
        optimizer.state[p] = per


def snapshot(state: Mapping[str, torch.Tensor]) -> LayerState:
    """CPU copies of a layer's named tensors (training may go on meanwhile)."""
    return {k: t.detach().to("cpu", copy=True) for k, t in state.items()}

