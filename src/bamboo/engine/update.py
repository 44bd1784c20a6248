"""Phase C of a step: the optimizer step on every stage a node holds and on its replica; and
what the step's report says the node holds after it.

The reduced gradients of the commit round are applied with the step's learning rate (the
schedule's, times a step-by-step run's scale), clipped by the global norm, and, under
`--precision fp16`, with the loss scale divided out again; a step whose fp16 gradients
overflowed is skipped instead (bamboo.plan.loss_scale). Every node computes the same from
the same round, so replicas and shadows stay bit-identical to their primaries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from bamboo.engine.commit import RoundResult
from bamboo.engine.optim import StepRate, clip_coefficient
from bamboo.engine.options import EngineOptions
from bamboo.engine.stage import StageState
from bamboo.engine.step import StepState
from bamboo.plan.loss_scale import LossScale

__all__ = ["Applied", "apply_update", "holdings"]


@dataclass(frozen=True, slots=True)
class Applied:
    """What phase C did: the unscaled global norm, the learning rate, whether it was
    skipped (fp16 overflow), and the loss scaler's state for the next step."""

    grad_norm: float
    lr: float
    skipped: bool
    loss_scale: LossScale


def apply_update(*, stages: dict[int, StageState], replica: StageState | None,
                 result: RoundResult, options: EngineOptions, step: int, lr_scale: float,
                 loss_scale: LossScale, scale: float) -> Applied:
    """One optimizer step on `stages` and `replica` from `result` (`scale`: the loss scale
    the step's backward ran with, 1 unless fp16)."""
    o = options
    if o.precision == "fp16":
        overflowed = not math.isfinite(result.norm)
        loss_scale = loss_scale.after(overflowed)
        if overflowed:  # skipped on every node and replica alike: the same norm
            for st in stages.values():
                st.reset_grads()
            return Applied(result.norm, 0.0, True, loss_scale)
    norm = result.norm / scale if scale != 1.0 else result.norm
    coef = clip_coefficient(norm, o.grad_clip)
    coef = coef / scale if scale != 1.0 else coef  # exact: the scale is a power of two
    lr = o.lr_at(step)
    if lr_scale != 1.0:  # a StepRate keeps the momentum its schedule sets
        lr = StepRate(float(lr) * lr_scale, getattr(lr, "momentum", None))
    for stage, st in stages.items():
        st.apply(result.reduced[stage].to(torch.float32), coef, lr)
        st.reset_grads()
    if replica is not None:
        assert result.replica_grad is not None
        if o.frc_offload:  # the replica's optimizer state lives in host memory
            replica.offload_optimizer()
        if replica.on_host and o.replica_step_later:  # off the critical path
            replica.apply_later(result.replica_grad, coef, lr)
        else:
            replica.apply(result.replica_grad, coef, lr)
    return Applied(norm, lr, False, loss_scale)


def holdings(s: StepState, stages: dict[int, StageState], replica: StageState | None,
             check_replicas: bool) -> dict[str, Any]:
    """The step report's fields on what the node holds after the step: the stages held,
    their state's bytes and parameters, the step's peak memory and, when replicas are
    checked, every held stage's digest."""
    held = list(stages.values()) + ([replica] if replica is not None else [])
    device_bytes, host_bytes = s.memory.node_peak(held, list(stages.values()))
    replica_host_bytes = replica.memory()[1] if replica is not None else 0
    digests = {}
    if check_replicas:
        digests = {f"stage{k}": st.digest() for k, st in stages.items()}
        if replica is not None:
            digests[f"replica{replica.stage}"] = replica.digest()
    return dict(stages=sorted(stages), state_bytes=sum(st.state_size() for st in held),
                params_held=sum(st.numel for st in held), device_bytes=device_bytes,
                host_bytes=host_bytes, replica_host_bytes=replica_host_bytes, digests=digests)
