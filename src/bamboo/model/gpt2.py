"""GPT-2 as a list of pipeline layers.

Pre-LN transformer blocks with causal self-attention, learned positional embeddings
and a final LayerNorm, as in GPT-2. The token embedding lives in layer 0 and the
final LayerNorm plus the LM head in the last layer, so a model with n blocks has
exactly n pipeline layers. The head is *untied* from the token embedding: tying it
would couple the first and last stage with an extra gradient all-reduce every step,
and the parameter count grows only by vocab x d.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bamboo.config.presets import ModelPreset
from bamboo.model.layer import PipelineLayer

__all__ = ["CausalSelfAttention", "GPTBlock", "gpt2_layer"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through `scaled_dot_product_attention`.

    One code path in training, eval and no-grad mode, so redundant recomputation of a
    layer gives bit-identical results to the primary's.
    """

    def __init__(self, d_model: int, heads: int, n_blocks: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        nn.init.normal_(self.qkv.weight, std=0.02)
        nn.init.zeros_(self.qkv.bias)
        nn.init.normal_(self.proj.weight, std=0.02 / math.sqrt(2 * n_blocks))
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """The 4x GELU feed-forward of a transformer block."""

    def __init__(self, d_model: int, n_blocks: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)
        nn.init.normal_(self.fc.weight, std=0.02)
        nn.init.zeros_(self.fc.bias)
        nn.init.normal_(self.proj.weight, std=0.02 / math.sqrt(2 * n_blocks))
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class GPTBlock(nn.Module):
    """Pre-LN block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, heads: int, n_blocks: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, n_blocks)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, n_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token plus learned position embedding: (B, T) int64 -> (B, T, d)."""

    def __init__(self, vocab: int, context: int, d_model: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(context, d_model)
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.01)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tokens(idx) + self.positions(positions)


class LMHead(nn.Module):
    """Final LayerNorm and the (untied) projection to vocabulary logits."""

    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab, bias=False)
        nn.init.normal_(self.out.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt2_layer(p: ModelPreset, index: int) -> nn.Module:
    """Layer `index` of preset `p` (parameters drawn from the current RNG)."""
    embed = Embedding(p.vocab, p.context, p.d_model) if index == 0 else None
    block = GPTBlock(p.d_model, p.heads, p.layers)
    head = LMHead(p.d_model, p.vocab) if index == p.layers - 1 else None
    return PipelineLayer(block, embed, head)
