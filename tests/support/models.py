"""Custom models (`--model module:function`, bamboo.model.api) for the tests: the example
of examples/, a tiny one as source, and writing such a module where Python finds it."""
from __future__ import annotations

import textwrap
from pathlib import Path

EXAMPLE = "examples.custom_model:build"

HEADER = """\
import torch
from torch import nn
from bamboo.model.api import PipelineModel, TensorSpec
"""

TINY = HEADER + """
CONTEXT, D = 16, 8


class Embed(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, D)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tokens(idx)


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


def build(vocab_size: int = 256) -> PipelineModel:
    return PipelineModel(
        layers=[lambda: nn.Sequential(Embed(vocab_size), Mix()), Mix, Mix,
                lambda: nn.Sequential(Mix(), nn.Linear(D, vocab_size))],
        boundary=TensorSpec((CONTEXT, D)), context=CONTEXT, vocab_size=vocab_size)
"""

TIED = HEADER + """
CONTEXT, D = 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


class Head(nn.Module):
    \"\"\"A LayerNorm, and logits from a weight that the model ties to the embedding.\"\"\"

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.weight = nn.Parameter(torch.randn(vocab, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x) @ self.weight.T


def build(vocab_size: int = 256) -> PipelineModel:
    \"\"\"The embedding (layer 0) and the head (layer 3) share one weight.\"\"\"
    return PipelineModel(
        layers=[lambda: nn.Embedding(vocab_size, D), Block, Block, lambda: Head(vocab_size)],
        boundary=TensorSpec((CONTEXT, D)), context=CONTEXT, vocab_size=vocab_size,
        ties={"embed": [(0, "weight"), (3, "weight")]})
"""


def write_module(directory: Path, name: str, source: str) -> Path:
    """`source` as the module `name`.py in `directory`."""
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path
