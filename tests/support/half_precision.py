"""Models and data for the fp16 tests, each named by its file's path as a user's script
would be: a tabular MLP whose large features overflow fp16 gradients at the initial loss
scale (its first steps are skipped until the scale is small enough), and a layer whose
gradient is NaN however the loss is scaled (its scale collapses)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from bamboo.model.api import PipelineModel, TensorSpec

FEATURES, WIDTH = 20, 64

_FILE = Path(__file__).resolve()
MODEL = f"{_FILE}:build"
COLLAPSING_MODEL = f"{_FILE}:build_collapsing"
DATASET = f"{_FILE}:Features(scale=30.0)"


class Features(Dataset):
    """512 seeded samples of FEATURES floats times `scale`; the label: the first's sign."""

    def __init__(self, scale: float, n: int = 512) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, FEATURES, generator=g) * scale
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class NaNGradient(nn.Module):
    """The identity whose backward is NaN: sqrt's derivative at 0 (inf) times |x - x|'s (0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt((x - x).abs())


def _blocks(extra: nn.Module | None = None) -> list:
    first = [nn.Linear(FEATURES, WIDTH), nn.ReLU()] + ([extra] if extra is not None else [])
    return [lambda: nn.Sequential(*first), lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()),
            lambda: nn.Linear(WIDTH, 2)]


def build() -> PipelineModel:
    return PipelineModel(layers=_blocks(), inputs=TensorSpec((FEATURES,)),
                         boundary=TensorSpec((WIDTH,)), output=TensorSpec((2,)),
                         loss=F.cross_entropy)


def build_collapsing() -> PipelineModel:
    return PipelineModel(layers=_blocks(NaNGradient()), inputs=TensorSpec((FEATURES,)),
                         boundary=TensorSpec((WIDTH,)), output=TensorSpec((2,)),
                         loss=F.cross_entropy)
