"""A model of your own: a small causal transformer written with plain torch.nn.

Train it from the repository root (the worker processes import it from there too):

    bamboo train --model examples.custom_model:build --nodes 4 --stages 4 --steps 50

or name the file itself: `--model examples/custom_model.py:build`. Each of the four
pipeline layers is one pre-LN transformer block; the token and position embedding ride in
layer 0 and the final norm and the vocabulary projection in layer 3, so every boundary
carries a `[B, 64, 64]` float32 activation. See bamboo/model/api.py for the rules.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bamboo.model.api import PipelineModel, TensorSpec

CONTEXT, WIDTH, HEADS, BLOCKS = 64, 64, 4, 4


class Embed(nn.Module):
    """Token plus learned position embedding: [B, T] int64 -> [B, T, d]."""

    def __init__(self, vocab_size: int, context: int, width: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(context, width)
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.01)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    """Pre-LN block: causal multi-head attention, then a 4x GELU MLP, each residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, width: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def build(vocab_size: int = 256) -> PipelineModel:
    """Four pipeline layers of one block each, for `vocab_size` tokens."""
    def layer(index: int) -> nn.Module:
        parts: list[nn.Module] = [Block(WIDTH, HEADS)]
        if index == 0:
            parts.insert(0, Embed(vocab_size, CONTEXT, WIDTH))
        if index == BLOCKS - 1:
            parts.append(Head(WIDTH, vocab_size))
        return nn.Sequential(*parts)

    return PipelineModel(
        layers=[lambda i=i: layer(i) for i in range(BLOCKS)],
        boundary=TensorSpec((CONTEXT, WIDTH)),
        context=CONTEXT,
        vocab_size=vocab_size,
        description=f"example transformer: {BLOCKS} blocks, d={WIDTH}, {HEADS} heads, "
                    f"context {CONTEXT}, vocab {vocab_size}",
    )
