"""A user's own data, loss and metric for the tests (`--dataset`, `--loss`, `--metric`): a
tiny per-token classifier (each token's class is its id // 8) with dropout, a map-style
Dataset of seeded samples, a label-smoothing loss and an accuracy metric, each named by its
file's path as a user's script would be."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from bamboo.model.api import PipelineModel, TensorSpec

CONTEXT, D, TOKENS, CLASSES = 8, 16, 32, 4

_FILE = Path(__file__).resolve()
MODEL = f"{_FILE}:build"
DATASET = f"{_FILE}:TokenClasses(n=40)"
EVAL_DATASET = f"{_FILE}:TokenClasses(n=16, seed=99)"
LOSS = f"{_FILE}:smoothed_loss(smoothing=0.1)"
METRIC = f"accuracy={_FILE}:accuracy"


class TokenClasses(Dataset):
    """`n` samples of CONTEXT token ids, drawn from (seed, index); labels: each id // 8."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + index)
        tokens = torch.randint(0, TOKENS, (CONTEXT,), generator=g)
        return tokens, tokens // (TOKENS // CLASSES)


def smoothed_loss(outputs: torch.Tensor, labels: torch.Tensor,
                  smoothing: float = 0.0) -> torch.Tensor:
    """Label-smoothed cross-entropy of `[B, T, C]` logits against `[B, T]` labels."""
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), labels.reshape(-1),
                           label_smoothing=smoothing)


class SmoothedLoss(nn.Module):
    """`smoothed_loss` as a module, given as an object (sent by value)."""

    def __init__(self, smoothing: float) -> None:
        super().__init__()
        self.smoothing = smoothing

    def forward(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return smoothed_loss(outputs, labels, self.smoothing)


def accuracy(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The fraction of tokens whose class is the arg-max."""
    return (outputs.argmax(-1) == labels).float().mean()


class Mix(nn.Module):
    """A residual block with dropout on its branch."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc, self.drop = nn.LayerNorm(D), nn.Linear(D, D), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(self.ln(x))))


def build(vocab_size: int = 256) -> PipelineModel:
    return PipelineModel(
        layers=[lambda: nn.Sequential(nn.Embedding(vocab_size, D), Mix()), Mix, Mix,
                lambda: nn.Sequential(Mix(), nn.Linear(D, CLASSES))],
        boundary=TensorSpec((CONTEXT, D)), output=TensorSpec((CONTEXT, CLASSES)),
        context=CONTEXT, vocab_size=vocab_size)


IMAGE_MODEL = f"{_FILE}:build_cnn"
IMAGES = f"{_FILE}:Images(n=24)"


class Images(Dataset):
    """`n` seeded [3, 8, 8] images; the label is the channel with the largest mean."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + index)
        image = torch.randn(3, 8, 8, generator=g)
        return image, image.mean(dim=(1, 2)).argmax()


def build_cnn() -> nn.Sequential:
    """A small CNN classifier with dropout and no `context`: it declares what layer 0
    takes, and its tensors between layers and output are found by tracing it."""
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Dropout(0.1)),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)))
    model.inputs = TensorSpec((3, 8, 8))
    return model
