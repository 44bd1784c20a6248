"""A custom model whose layers hand on a dict of tensors (`--model PATH:build`): a float
hidden state, a float gate and a bool mask of the padding-like tokens. The mask travels
without gradients; the last layer leaves the gate unused (zeros go back for it)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from bamboo.model.api import PipelineModel, TensorSpec

CONTEXT, D = 16, 16

NAME = f"{Path(__file__).resolve()}:build"
"""The model's name on the command line (the file's path, so every worker finds it)."""

BOUNDARY = {"hidden": TensorSpec((CONTEXT, D)), "gate": TensorSpec((CONTEXT,)),
            "mask": TensorSpec((CONTEXT,), torch.bool)}


class Embed(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.tokens, self.gate = nn.Embedding(vocab, D), nn.Embedding(vocab, 1)

    def forward(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"hidden": self.tokens(idx), "gate": torch.sigmoid(self.gate(idx)[..., 0]),
                "mask": idx % 3 != 0}


class Mix(nn.Module):
    """A residual block on the unmasked positions, scaled by the gate, with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc, self.drop = nn.LayerNorm(D), nn.Linear(D, D), nn.Dropout(0.1)
        self.g = nn.Linear(D, 1)

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h, gate, mask = x["hidden"], x["gate"], x["mask"]
        branch = self.drop(torch.tanh(self.fc(self.ln(h)))) * (gate * mask)[..., None]
        return {"hidden": h + branch, "gate": torch.sigmoid(self.g(h)[..., 0]) * gate,
                "mask": mask}


class Head(nn.Module):
    """Logits from the hidden state alone: the gate's gradient here is None."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(D), nn.Linear(D, vocab)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.out(self.ln(x["hidden"]))


def build(vocab_size: int = 256) -> PipelineModel:
    return PipelineModel(layers=[lambda: Embed(vocab_size), Mix, Mix, lambda: Head(vocab_size)],
                         boundary=BOUNDARY, context=CONTEXT, vocab_size=vocab_size)
