"""Optimizer, learning-rate schedule and gradient clipping for one stage.

AdamW with decoupled weight decay on parameters of two or more dimensions (not on
biases and norms, as GPT-2 training does), a linear warm-up then cosine decay to a
tenth of the peak rate.
Every quantity is a pure function of the step, so a replica or a shadow computes
exactly what the primary computes.

Which AdamW implementation runs depends on where the parameters live (`adamw_options`):
on CUDA the fused kernel (one launch for the whole stage), on the CPU torch's foreach
path. Both are elementwise: each parameter's update depends on that parameter alone, so
the result does not depend on how parameters are grouped into stages. On the CPU the
foreach path gives the same bits as the per-tensor loop (`foreach=False`), whatever the
grouping or order of the parameters (tests/test_devices.py checks it), so pipelined runs
stay bit-identical to tests/reference.py, which builds its optimizer here too.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["learning_rate", "make_optimizer", "adamw_options", "clip_coefficient",
           "steps_on_param_device"]


def learning_rate(step: int, *, peak: float, warmup: int, total: int) -> float:
    """Warm-up to `peak` over `warmup` steps, then cosine decay to peak / 10 at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def adamw_options(device_types: set[str]) -> dict[str, bool]:
    """AdamW's implementation flags for parameters on these device types: fused when all
    are on CUDA, foreach when all are on the CPU, the per-tensor loop otherwise (mixed
    devices, or other accelerators, where neither has been checked)."""
    if device_types == {"cuda"}:
        return {"fused": True}
    if device_types <= {"cpu"}:
        return {"foreach": True}
    return {"foreach": False}


def steps_on_param_device(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The fused kernel reads each parameter's step count on the parameter's device; state
    loaded from elsewhere (a checkpoint, a peer's state vector) carries a CPU step tensor."""
    for p, state in optimizer.state.items():
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.device != p.device:
            state["step"] = step.to(device=p.device, dtype=torch.float32)


def make_optimizer(module: nn.Module, *, lr: float, weight_decay: float,
                   device: torch.device | str | None = None) -> torch.optim.AdamW:
    """AdamW over `module`; weight decay on parameters with two or more dimensions.
    `device`: where the parameters are (default: read from them)."""
    params = list(module.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    types = {torch.device(device).type} if device is not None else {p.device.type for p in params}
    options = adamw_options(types)
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **options)
    if options.get("fused"):
        optimizer.register_step_pre_hook(steps_on_param_device)
    return optimizer


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor that brings the global gradient norm down to `max_norm` (1 when under)."""
    if max_norm <= 0 or total_norm <= max_norm:
        return 1.0
    return max_norm / (total_norm + 1e-6)
