"""A small BERT-style encoder as a list of pipeline layers.

Post-LN bidirectional transformer blocks (as in BERT), token and position
embeddings with an embedding LayerNorm in layer 0, and a masked-LM head (dense,
GELU, LayerNorm, untied decoder) in the last layer. Token id `vocab - 1` is [MASK].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bamboo.config.presets import ModelPreset
from bamboo.model.layer import PipelineLayer

__all__ = ["BertBlock", "bert_layer"]


class BertBlock(nn.Module):
    """Post-LN encoder block: ln(x + attn(x)), then ln(x + mlp(x))."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln1 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        for lin in (self.qkv, self.proj, self.fc, self.fc_out):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = self.ln1(x + self.proj(attn))
        return self.ln2(x + self.fc_out(F.gelu(self.fc(x))))


class BertEmbedding(nn.Module):
    """Token + position embeddings followed by LayerNorm."""

    def __init__(self, vocab: int, context: int, d_model: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(context, d_model)
        self.ln = nn.LayerNorm(d_model)
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.ln(self.tokens(idx) + self.positions(positions))


class MLMHead(nn.Module):
    """Masked-LM head: dense, GELU, LayerNorm, decoder to the vocabulary."""

    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.ln = nn.LayerNorm(d_model)
        self.decoder = nn.Linear(d_model, vocab)
        nn.init.normal_(self.dense.weight, std=0.02)
        nn.init.zeros_(self.dense.bias)
        nn.init.normal_(self.decoder.weight, std=0.02)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.ln(F.gelu(self.dense(x))))


def bert_layer(p: ModelPreset, index: int) -> nn.Module:
    """Layer `index` of preset `p` (parameters drawn from the current RNG)."""
    embed = BertEmbedding(p.vocab, p.context, p.d_model) if index == 0 else None
    head = MLMHead(p.d_model, p.vocab) if index == p.layers - 1 else None
    return PipelineLayer(BertBlock(p.d_model, p.heads), embed, head)
