"""The pipeline layer of bamboo's own transformers: one block, with the embedding before it
(layer 0) or the head after it (the last layer).

GPT-2 (`gpt2.py`) and BERT (`bert.py`) differ in their blocks, embeddings and heads, not in
how a layer strings them together; both wrap them in `PipelineLayer`. The submodules are
registered in the order embed, block, head, so parameter names (`embed.*`, `block.*`,
`head.*`) and their order are the same for every family.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["PipelineLayer"]


class PipelineLayer(nn.Module):
    """One pipeline layer: a block, with the embedding before it or the head after it."""

    def __init__(self, block: nn.Module, embed: nn.Module | None = None,
                 head: nn.Module | None = None) -> None:
        super().__init__()
        self.embed = embed
        self.block = block
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        x = self.block(x)
        if self.head is not None:
            x = self.head(x)
        return x
