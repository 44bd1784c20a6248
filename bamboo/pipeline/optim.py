"""Optimizer, learning-rate schedule and gradient clipping for one stage.

AdamW with decoupled weight decay on parameters of two or more dimensions (not on
biases and norms, as GPT-2 training does), a linear warm-up then cosine decay to a
tenth of the peak rate.
Every quantity is a pure function of the step, so a replica or a shadow computes
exactly what the primary computes.
"""
from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["learning_rate", "make_optimizer", "clip_coefficient"]


def learning_rate(step: int, *, peak: float, warmup: int, total: int) -> float:
    """Warm-up to `peak` over `warmup` steps, then cosine decay to peak / 10 at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_optimizer(module: nn.Module, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over `module`; weight decay on parameters with two or more dimensions."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor that brings the global gradient norm down to `max_norm` (1 when under)."""
    if max_norm <= 0 or total_norm <= max_norm:
        return 1.0
    return max_norm / (total_norm + 1e-6)
