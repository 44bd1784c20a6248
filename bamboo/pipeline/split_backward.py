"""ZB-H1's split backward: the input gradient now, the linear layers' weight gradients later.

A stage's forward under `--schedule zb-h1` keeps a tape: for every `nn.Linear` it ran,
the layer and its input, and a hook on its output that will catch the output's
gradient. `input_gradient` then runs autograd for the stage's input and for the
parameters that are not a linear layer's own (norms, embeddings, convolutions): their
gradients go into the stage's sum at once, and the hooks fill the tape.
`weight_gradient` computes each linear layer's weight and bias gradients from its
(input, output gradient) pair with the matrix products autograd's own linear backward
runs, and adds them to the sum.

Why not autograd's graph for the second half (torch's `stage_backward_weight`)? On a
CPU it runs one autograd call per parameter group: 38 for one gpt2-mini stage, which
made the weight half cost as much as a whole backward. Here it is a few matrix
products, the work the split moves and no more.

A linear layer whose weight is shared with another module (tied weights) stays in the
first half: autograd then sees all its uses.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Tape", "Taping", "deferred_linears", "input_gradient", "weight_gradient"]


@dataclass(slots=True)
class _Entry:
    layer: nn.Linear
    x: torch.Tensor
    grad: list[torch.Tensor] = field(default_factory=list)
    """The layer output's gradient, once `input_gradient` has run."""


@dataclass(slots=True)
class Tape:
    """What one forward of one stage left for its weight gradient."""

    entries: list[_Entry] = field(default_factory=list)


def deferred_linears(module: nn.Module) -> set[nn.Linear]:
    """The linear layers of `module` whose weight gradient can wait: every parameter of
    theirs is registered in no other module."""
    owners: dict[int, int] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {m for m in module.modules() if isinstance(m, nn.Linear)
            and all(owners[id(p)] == 1 for p in m.parameters(recurse=False))}


class Taping:
    """The forward hooks of one stage's module: while `recording(tape)` is open, every
    deferred linear layer that runs with gradients on is put on the tape."""

    def __init__(self, module: nn.Module) -> None:
        self.linears = deferred_linears(module)
        self._tape: Tape | None = None
        for layer in self.linears:
            layer.register_forward_hook(self._hook)

    def _hook(self, layer: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        if self._tape is None or not out.requires_grad:
            return
        entry = _Entry(layer, args[0].detach())  # type: ignore[arg-type]  # not its graph
        out.register_hook(entry.grad.append)
        self._tape.entries.append(entry)

    @contextlib.contextmanager
    def recording(self, tape: Tape) -> Iterator[None]:
        self._tape = tape
        try:
            yield
        finally:
            self._tape = None

    def other_params(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters whose gradients the first half computes."""
        deferred = {id(p) for m in self.linears for p in m.parameters(recurse=False)}
        return [p for p in params if id(p) not in deferred and p.requires_grad]


def input_gradient(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None,
                   others: list[nn.Parameter]) -> tuple[torch.Tensor | None, bool]:
    """The first half: the gradient of `x` (None when it needs none), with `others`'
    gradients left in their `.grad`; and whether the weight half has anything left.

    Nothing to differentiate for (a stage whose input is data and whose parameters are
    all deferred linears): the whole backward runs here, and nothing is left."""
    wanted = ([x] if x is not None and x.requires_grad else []) + others
    if not wanted:
        torch.autograd.backward(out, grad_tensors=grad)
        return None, False
    grads = torch.autograd.grad(out, wanted, grad_outputs=grad, allow_unused=True)
    dx = None
    if x is not None and x.requires_grad:
        dx, grads = grads[0], grads[1:]
    for p, g in zip(others, grads):
        if g is not None:
            p.grad = g
    return dx, True


def weight_gradient(tape: Tape, autocast: Callable[[], Any]) -> None:
    """The second half: every taped linear layer's weight (and bias) gradient into `.grad`,
    as autograd computes them: dW = g^T x and db = sum of g over the rows, under the
    forward's autocast (bf16 runs compute them in bf16, as the forward did)."""
    with torch.no_grad():
        _weight_gradient(tape, autocast)


def _weight_gradient(tape: Tape, autocast: Callable[[], Any]) -> None:
    for entry in tape.entries:
        if not entry.grad:
            raise RuntimeError(f"no gradient reached {entry.layer}: its output did not feed "
                               "the stage's output")
        layer, g = entry.layer, entry.grad[0]
        g2 = g.reshape(-1, g.shape[-1])
        x2 = entry.x.reshape(-1, entry.x.shape[-1])
        with autocast():
            dw = g2.t().mm(x2.to(g2.dtype) if x2.dtype != g2.dtype else x2)
        _add(layer.weight, dw)
        if layer.bias is not None:
            _add(layer.bias, g2.sum(0))
    tape.entries.clear()


def _add(p: nn.Parameter, g: torch.Tensor) -> None:
    g = g.to(p.dtype)
    p.grad = g if p.grad is None else p.grad + g
