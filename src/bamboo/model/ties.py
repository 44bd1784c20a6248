"""Tied weights: one parameter that several layers use (an input embedding reused as the
output head), as DeepSpeed's `TiedLayerSpec` declares it.

A tie is a key and its uses, each a (layer index, attribute path) such as `(0, "weight")`
and `(5, "module.weight")`. What every process does with it:

- Building: the parameter of every use starts as the key's first use's, built from that
  layer's seeded stream (`initial_copy`), so the copies on different stages start equal
  without a broadcast.
- Within one stage, the uses share one `nn.Parameter` (`share_within`): autograd adds their
  gradients, the stage's optimizer steps it once.
- Across stages, each holder keeps a copy; the commit round adds the copies' reduced
  gradients in stage order (bamboo.engine.commit) and every copy steps with that sum, so
  the copies stay equal without sending weights again (DeepSpeed's `ReduceTiedGrads`).
  The global gradient norm counts the tied parameter once, under its first use's layer.
- Only the named attributes are shared: a tied layer's other parameters are its own (a
  head that reuses an embedding module's `weight` through a `forward_fn` leaves that
  module's other parameters unused).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Tie", "TieError", "check_ties", "param_path", "get_param", "set_param",
           "share_within", "uses_at", "check_shapes", "initial_copy"]


class TieError(ValueError):
    """A tie that cannot be used as declared; the message is one line."""


@dataclass(frozen=True, slots=True)
class Tie:
    key: str
    uses: tuple[tuple[int, str], ...]
    """(layer index, attribute path), in layer order; the first is the one counted in the
    gradient norm and the one every copy starts from."""

    @property
    def first(self) -> tuple[int, str]:
        return self.uses[0]

    def layers(self) -> list[int]:
        return [layer for layer, _ in self.uses]


def check_ties(ties: Mapping[str, Sequence[tuple[int, str]]] | None, num_layers: int
               ) -> tuple[Tie, ...]:
    """`ties` (key -> its uses) as Ties sorted by key; TieError with one line when a use is
    not a (layer index, attribute path) pair of a layer in range, a use belongs to two ties,
    a tie names one layer twice, two keys read the same, or a key has fewer than two
    uses."""
    if not ties:
        return ()
    if not isinstance(ties, Mapping):
        raise TieError(f"ties must be a dict of key -> [(layer index, attribute path), ...] "
                       f"(got {type(ties).__name__})")
    out, seen, names = [], {}, set()
    for key in sorted(ties, key=str):
        if str(key) in names:
            raise TieError(f"two ties are named {str(key)!r}: give each tie its own key")
        names.add(str(key))
        uses = ties[key]
        if isinstance(uses, (str, bytes)) or not isinstance(uses, Sequence):
            raise TieError(f"tie {key!r}: its uses must be a list of (layer index, attribute "
                           f"path) pairs, e.g. [(0, 'weight'), ({num_layers - 1}, 'weight')]")
        pairs = []
        for use in uses:
            if (not isinstance(use, (tuple, list)) or len(use) != 2 or type(use[0]) is not int
                    or not isinstance(use[1], str) or not use[1]):
                raise TieError(f"tie {key!r}: use {use!r} is not a (layer index, attribute "
                               f"path) pair such as (0, 'weight')")
            layer, path = use
            if not 0 <= layer < num_layers:
                raise TieError(f"tie {key!r}: layer {layer} is not one of the model's "
                               f"{num_layers} layers")
            if (layer, path) in seen:
                raise TieError(f"tie {key!r}: layer {layer}'s {path!r} is already a use of "
                               f"tie {seen[(layer, path)]!r}")
            seen[(layer, path)] = key
            pairs.append((layer, path))
        pairs.sort()
        layers = [layer for layer, _ in pairs]
        if len(set(layers)) != len(layers):
            twice = next(layer for layer in layers if layers.count(layer) > 1)
            raise TieError(f"tie {key!r} names layer {twice} twice: a tie joins parameters "
                           f"of different layers")
        if len(pairs) < 2:
            raise TieError(f"tie {key!r} has {len(pairs)} use: a tie joins two uses or more")
        out.append(Tie(str(key), tuple(pairs)))
    return tuple(out)


def param_path(module: nn.Module, path: str) -> str:
    """Where the parameter that dotted `path` of `module` names is registered: `path`
    itself, or for an attribute that returns a registered parameter (a property, as
    DeepSpeed's `tied_weight_attr` may name: it reads it with getattr) that parameter's
    own path. TieError when `path` names no parameter."""
    value: object = module
    try:
        for name in path.split("."):
            value = getattr(value, name)
    except AttributeError:
        value = None
    if isinstance(value, nn.Parameter):
        for registered, p in module.named_parameters(remove_duplicate=False):
            if p is value:
                return registered
    raise TieError(f"{type(module).__name__} has no parameter {path!r} to tie")


def get_param(module: nn.Module, path: str) -> nn.Parameter:
    """The parameter at dotted `path` of `module`; TieError when there is none."""
    owner, _, name = param_path(module, path).rpartition(".")
    return (module.get_submodule(owner) if owner else module)._parameters[name]


def set_param(module: nn.Module, path: str, param: nn.Parameter) -> None:
    """Register `param` where `path` of `module` names a parameter (see `param_path`)."""
    owner, _, name = param_path(module, path).rpartition(".")
    (module.get_submodule(owner) if owner else module)._parameters[name] = param


def uses_at(ties: Iterable[Tie], layer: int) -> list[tuple[Tie, str]]:
    """The ties with a use at `layer`, each with that use's attribute path."""
    return [(tie, path) for tie in ties for at, path in tie.uses if at == layer]


def check_shapes(tie: Tie, first: nn.Module, layer: int, module: nn.Module, path: str) -> None:
    want, got = get_param(first, tie.first[1]), get_param(module, path)
    if want.shape != got.shape or want.dtype != got.dtype:
        raise TieError(f"tie {tie.key!r}: layer {layer}'s {path!r} is "
                       f"{list(got.shape)} {got.dtype}, but layer {tie.first[0]}'s "
                       f"{tie.first[1]!r} is {list(want.shape)} {want.dtype}: tied parameters "
                       f"have one shape and dtype")


def initial_copy(tie: Tie, first: nn.Module, layer: int, module: nn.Module, path: str) -> None:
    """Set use (`layer`, `path`) of `module` to the value of the tie's first use (in
    `first`, layer `tie.first[0]` as its seeded stream builds it)."""
    check_shapes(tie, first, layer, module, path)
    with torch.no_grad():
        get_param(module, path).copy_(get_param(first, tie.first[1]))


def share_within(layers: Sequence[nn.Module], indices: Sequence[int], ties: Iterable[Tie]
                 ) -> None:
    """Make the uses of each tie among `layers` (model layers `indices`) one parameter:
    the lowest layer's."""
    position = {layer: i for i, layer in enumerate(indices)}
    for tie in ties:
        held = [(layer, path) for layer, path in tie.uses if layer in position]
        for layer, path in held[1:]:
            owner_layer, owner_path = held[0]
            shared = get_param(layers[position[owner_layer]], owner_path)
            mine = get_param(layers[position[layer]], path)
            if (mine.shape, mine.dtype) != (shared.shape, shared.dtype):
                raise TieError(f"tie {tie.key!r}: layer {layer}'s {path!r} and layer "
                               f"{owner_layer}'s {owner_path!r} differ in shape or dtype")
            set_param(layers[position[layer]], path, shared)
