"""A custom model with dropout in every layer (`--model PATH:build`): the model the tests
of seeded randomness train, kill and compare with the single-process loop."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from bamboo.model.api import PipelineModel, TensorSpec

CONTEXT, D = 16, 16

NAME = f"{Path(__file__).resolve()}:build"
"""The model's name on the command line (the file's path, so every worker finds it)."""


class Embed(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.tokens, self.drop = nn.Embedding(vocab, D), nn.Dropout(0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.drop(self.tokens(idx))


class Mix(nn.Module):
    """A residual block with dropout on its branch."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc, self.drop = nn.LayerNorm(D), nn.Linear(D, D), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(self.ln(x))))


def build(vocab_size: int = 256) -> PipelineModel:
    return PipelineModel(
        layers=[lambda: nn.Sequential(Embed(vocab_size), Mix()), Mix, Mix,
                lambda: nn.Sequential(Mix(), nn.Linear(D, vocab_size))],
        boundary=TensorSpec((CONTEXT, D)), context=CONTEXT, vocab_size=vocab_size)
