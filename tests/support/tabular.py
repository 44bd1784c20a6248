"""A newcomer's first model for the tests: a tabular classifier written as a plain
`nn.Sequential` whose activations, dropout and reshapes are children of their own (layers
without parameters, so a stage may hold nothing else), on a small seeded Dataset; and an
optimizer of a user's own that keeps three state tensors and two Python numbers a
parameter. Each is named by its file's path, as a user's script would name it."""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from bamboo.model.api import TensorSpec

FEATURES, HIDDEN, CLASSES = 12, 16, 2

_FILE = Path(__file__).resolve()
MODEL = f"{_FILE}:build"
DATASET = f"{_FILE}:Tab(n=64)"
TRIPLE = f"{_FILE}:Triple(lr=0.02)"

PARAMETERLESS = (1, 2, 4, 5)
"""The layers of `build` without parameters: ReLU, Dropout, GELU, Flatten."""


class Tab(Dataset):
    """`n` seeded rows of FEATURES numbers; the label: whether the first is positive."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def build() -> nn.Sequential:
    """Seven layers, four of them without parameters."""
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Dropout(0.1),
                          nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Flatten(),
                          nn.Linear(HIDDEN, CLASSES))
    model.inputs, model.output = TensorSpec((FEATURES,)), TensorSpec((CLASSES,))
    return model


class Triple(torch.optim.Optimizer):
    """A user's own optimizer: per parameter a running mean of the gradient, the running
    peak of its magnitude and the last gradient (three tensors shaped like the parameter),
    a step count (a Python int) and its bias correction (a Python float)."""

    def __init__(self, params, lr: float = 0.01, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        for group in self.param_groups:
            beta = group["beta"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self.state[p]
                if not s:
                    s["count"], s["correction"] = 0, 1.0
                    for key in ("mean", "peak", "last"):
                        s[key] = torch.zeros_like(p)
                s["count"] += 1
                s["correction"] = 1.0 - beta ** s["count"]
                s["mean"].mul_(beta).add_(p.grad, alpha=1.0 - beta)
                torch.maximum(s["peak"], p.grad.abs(), out=s["peak"])
                update = s["mean"] / s["correction"] / (s["peak"] + 1e-8) \
                    + 0.1 * (p.grad - s["last"])
                s["last"].copy_(p.grad)
                p.add_(update, alpha=-group["lr"] / math.sqrt(s["count"]))
