"""Llama as a list of pipeline layers.

Pre-norm decoder blocks as in Llama 2/3: RMSNorm, rotary position embeddings applied
to queries and keys, grouped-query causal attention (several query heads share a key and
value head) and a SwiGLU feed-forward, no biases anywhere. Layer 0 is the token embedding
and block 0, the last layer is the last block, the final RMSNorm and the (untied) LM head,
so every boundary is a float32 [B, T, d] tensor, as with GPT-2.

Submodule and parameter names follow transformers' `LlamaForCausalLM` (`embed_tokens`,
`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, `norm`, `lm_head`, ...) and so do
the numerics (rotate_half RoPE, RMSNorm in float32), so the weights of a trained run map
one to one onto a `LlamaForCausalLM` (`bamboo export`). Every block computes its own
rotary cos/sin from the sequence length: they hold no parameters and need not cross a
pipeline boundary.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bamboo.config.presets import ModelPreset
from bamboo.model.layer import PipelineLayer

__all__ = ["RMSNorm", "rotary_cos_sin", "LlamaAttention", "LlamaBlock", "llama_layer",
           "ffn_dim"]


def ffn_dim(p: ModelPreset) -> int:
    """The SwiGLU hidden width: the preset's, else Llama's 8/3 d rounded up to 32."""
    return p.ffn_dim or 32 * math.ceil(8 * p.d_model / 3 / 32)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 whatever the input dtype (as Llama does)."""

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_cos_sin(t: int, head_dim: int, theta: float,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] of positions 0..t-1, the two halves repeated (rotate_half)."""
    # Frequencies on the CPU in float32, as transformers computes them, so both agree bitwise.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    positions = torch.arange(t, device=device, dtype=torch.float)
    freqs = positions[:, None] * inv_freq.to(device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    """Grouped-query causal self-attention with RoPE, through `scaled_dot_product_attention`.

    One code path in training, eval and no-grad mode, so a layer's redundant recomputation
    gives bit-identical results to the primary's.
    """

    def __init__(self, d_model: int, heads: int, kv_heads: int, theta: float,
                 n_blocks: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.theta = heads, kv_heads, theta
        self.head_dim = d_model // heads
        self.q_proj = nn.Linear(d_model, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, d_model, bias=False)
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.normal_(proj.weight, std=0.02)
        nn.init.normal_(self.o_proj.weight, std=0.02 / math.sqrt(2 * n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary_cos_sin(t, self.head_dim, self.theta, x.device)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # bf16 autocast: q, k, v share one dtype
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, hidden: int, n_blocks: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)
        nn.init.normal_(self.gate_proj.weight, std=0.02)
        nn.init.normal_(self.up_proj.weight, std=0.02)
        nn.init.normal_(self.down_proj.weight, std=0.02 / math.sqrt(2 * n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, p: ModelPreset) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(p.d_model, p.norm_eps)
        self.self_attn = LlamaAttention(p.d_model, p.heads, p.kv_heads or p.heads, p.rope_theta,
                                        p.layers)
        self.post_attention_layernorm = RMSNorm(p.d_model, p.norm_eps)
        self.mlp = LlamaMLP(p.d_model, ffn_dim(p), p.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TokenEmbedding(nn.Module):
    """Token embedding only: positions enter through RoPE inside every block."""

    def __init__(self, vocab: int, d_model: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d_model)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(idx)


class LMHead(nn.Module):
    """The final RMSNorm and the (untied) projection to vocabulary logits."""

    def __init__(self, d_model: int, vocab: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(d_model, eps)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        nn.init.normal_(self.lm_head.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def llama_layer(p: ModelPreset, index: int) -> nn.Module:
    """Layer `index` of preset `p` (parameters drawn from the current RNG)."""
    if p.d_model % p.heads or p.heads % (p.kv_heads or p.heads):
        raise ValueError(f"model '{p.name}': d={p.d_model}, {p.heads} heads and "
                         f"{p.kv_heads} key/value heads do not divide evenly")
    embed = TokenEmbedding(p.vocab, p.d_model) if index == 0 else None
    block = LlamaBlock(p)
    head = LMHead(p.d_model, p.vocab, p.norm_eps) if index == p.layers - 1 else None
    return PipelineLayer(block, embed, head)
