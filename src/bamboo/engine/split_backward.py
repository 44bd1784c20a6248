"""ZB-H1's split backward: the input gradient now, the linear layers' weight gradients later.

A stage's forward under `--schedule zb-h1` keeps a tape: for every `nn.Linear` whose
forward ran, the layer, its input (in the autocast dtype when autocast is on, as autograd
keeps it) and the gradient edge of its output. `input_gradient` then runs one autograd
call for the stage's input, for every parameter that is not a taped linear layer's own
(norms, embeddings, convolutions, a linear layer whose weight is used without its
forward), and for the taped outputs: their gradients are what the second half needs.
`weight_gradient` computes each taped layer's weight and bias gradients from its (input,
output gradient) pair with the matrix products autograd's own linear backward runs, and
leaves them in `.grad`.

Why not autograd's graph for the second half (torch's `stage_backward_weight`)? On a
CPU it runs one autograd call per parameter group: 38 for one gpt2-mini stage, which
made the weight half cost as much as a whole backward. Here it is a few matrix
products, the work the split moves and no more.

A linear layer whose weight is shared with another module (tied weights) is never
deferred: autograd then sees all its uses. The tape keeps each linear layer's input until
the weight half runs; under 1F1B autograd would free it at the backward.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["Tape", "Taping", "deferred_linears", "input_gradient", "weight_gradient"]


@dataclass(slots=True)
class _Entry:
    layer: nn.Linear
    x: torch.Tensor
    out: GradientEdge
    """Where the layer's output gradient is read (no reference to the output itself)."""
    grad: torch.Tensor | None = None
    """The layer output's gradient, once `input_gradient` has run (None: the output did
    not reach the stage's output)."""


@dataclass(slots=True)
class Tape:
    """What one forward of one stage left for its weight gradient."""

    entries: list[_Entry] = field(default_factory=list)

    def layers(self) -> set[nn.Linear]:
        return {e.layer for e in self.entries}


def deferred_linears(module: nn.Module) -> set[nn.Linear]:
    """The linear layers of `module` whose weight gradient may wait: every parameter of
    theirs is registered in no other module."""
    owners: dict[int, int] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {m for m in module.modules() if isinstance(m, nn.Linear)
            and all(owners[id(p)] == 1 for p in m.parameters(recurse=False))}


class Taping:
    """The forward hooks of one stage's module: while `recording(tape)` is open, every
    deferrable linear layer that runs with gradients on is put on the tape."""

    def __init__(self, module: nn.Module) -> None:
        self.linears = deferred_linears(module)
        self._tape: Tape | None = None
        for layer in self.linears:
            layer.register_forward_hook(self._hook)

    def _hook(self, layer: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        if self._tape is None or not out.requires_grad:
            return
        x = args[0].detach()  # not its graph
        kind = x.device.type
        if x.is_floating_point() and torch.is_autocast_enabled(kind):
            x = x.to(torch.get_autocast_dtype(kind))  # what autograd keeps under autocast
        self._tape.entries.append(_Entry(layer, x, get_gradient_edge(out)))  # type: ignore[arg-type]  # get_gradient_edge is typed loosely by torch

    @contextlib.contextmanager
    def recording(self, tape: Tape) -> Iterator[None]:
        self._tape = tape
        try:
            yield
        finally:
            self._tape = None

    @staticmethod
    def other_params(params: list[nn.Parameter], tape: Tape | None) -> list[nn.Parameter]:
        """The parameters whose gradients the first half computes: all but those of the
        linear layers on `tape` (all of them without a tape)."""
        deferred = set() if tape is None else \
            {id(p) for m in tape.layers() for p in m.parameters(recurse=False)}
        return [p for p in params if id(p) not in deferred and p.requires_grad]


def input_gradient(out: Any, grad: Any, x: torch.Tensor | Sequence[torch.Tensor] | None,
                   others: list[nn.Parameter], tape: Tape | None) -> Any:
    """The first half, one autograd call: the gradient of `x` (None when it needs none),
    `others`' gradients left in their `.grad`, and each taped output's gradient kept on
    the tape for the second half. `out` and `grad` are a tensor or lists of them (a
    boundary's float tensors); `x` a tensor, or a list of the input's tensors that take a
    gradient, whose gradients come back as a list (None for one the output does not use)."""
    single = x is None or isinstance(x, torch.Tensor)
    if single:
        xs = [x] if x is not None and x.requires_grad else []
    else:
        xs = list(x)  # type: ignore[arg-type]  # a tuple of tensors here, as the branch above says
    inputs: list[Any] = xs + others
    entries = tape.entries if tape is not None else []
    n_direct = len(inputs)
    inputs += [e.out for e in entries]
    if not inputs:
        return None if single else []
    grads = torch.autograd.grad(out, inputs, grad_outputs=grad, allow_unused=True)
    dxs, grads = grads[:len(xs)], grads[len(xs):]
    n_direct -= len(xs)
    for p, g in zip(others, grads[:n_direct]):
        if g is not None:
            p.grad = g
    for entry, g in zip(entries, grads[n_direct:]):
        entry.grad = g
    if single:
        return dxs[0] if xs else None
    return list(dxs)


def weight_gradient(tape: Tape, autocast: Callable[[], Any]) -> None:
    """The second half: every taped linear layer's weight (and bias) gradient into `.grad`,
    as autograd computes them: dW = g^T x and db = sum of g over the rows, under the
    forward's autocast (bf16 runs compute them in bf16, as the forward did). A layer run
    several times in one forward sums its uses last first, as autograd's backward meets
    them."""
    with torch.no_grad():
        for entry in reversed(tape.entries):
            if entry.grad is None:
                continue  # its output did not reach the stage's output: no gradient
            layer, g = entry.layer, entry.grad
            g2 = g.reshape(-1, g.shape[-1])
            x2 = entry.x.reshape(-1, entry.x.shape[-1])
            with autocast():
                dw = g2.t().mm(x2)
            _add(layer.weight, dw)
            if layer.bias is not None:
                _add(layer.bias, g2.sum(0))
    tape.entries.clear()


def _add(p: nn.Parameter, g: torch.Tensor) -> None:
    g = g.to(p.dtype)
    p.grad = g if p.grad is None else p.grad + g
