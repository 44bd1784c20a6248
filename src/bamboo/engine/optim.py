"""Optimizer, learning-rate schedule and gradient clipping for one stage.

By default AdamW with decoupled weight decay on parameters of two or more dimensions (not
on biases and norms, as GPT-2 training does), a linear warm-up then cosine decay to a
tenth of the peak rate. A job may name its own (`--optimizer`, `--lr-schedule`, or
`bamboo.Job(optimizer=..., schedule=...)`): any optimizer class or factory of the
parameters, and a schedule as `step -> multiplier` or a `torch.optim.lr_scheduler`
class, whose learning rates (and the momentum it cycles: OneCycleLR's and CyclicLR's
`cycle_momentum`) are taken once, step by step, on a throwaway optimizer
(`user_schedule`, `StepRate`); each process builds them by name (`bamboo.config.calls`).
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

import functools
import inspect
import math
import warnings
from typing import Any

import torch
from torch import nn

from bamboo.config.calls import parse_call
from bamboo.model.api import import_object

__all__ = ["learning_rate", "make_optimizer", "adamw_options", "clip_coefficient",
           "steps_on_param_device", "step_lr", "set_lr", "check_optimizer", "StepRate",
           "schedule_momenta"]

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
                   device: torch.device | str | None = None,
                   spec: str | None = None) -> torch.optim.Optimizer:
    """AdamW over `module`; weight decay on parameters with two or more dimensions.
    `device`: where the parameters are (default: read from them). `spec`: the job's own
    optimizer (`--optimizer MODULE:NAME(ARGS)`), called with the parameters and its
    arguments (`lr` defaults to `lr`)."""
    params = list(module.parameters())
    if spec is not None:
        return _user_optimizer(params, spec, lr)
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


def _user_optimizer(params: list[nn.Parameter], spec: str, lr: float) -> torch.optim.Optimizer:
    call = parse_call(spec)
    factory = import_object(call.target)
    kwargs = dict(call.kwargs)
    if "lr" not in kwargs and _takes(factory, "lr"):
        kwargs["lr"] = lr
    optimizer = factory(params, **kwargs)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"--optimizer {spec} returned {type(optimizer).__name__}, not a "
                         f"torch.optim.Optimizer")
    base = optimizer.defaults.get("lr", lr)
    for group in optimizer.param_groups:  # a factory's groups may scale the learning rate
        group["lr_scale"] = float(group["lr"]) / base if base else 1.0
    return optimizer


def _takes(factory: Any, name: str) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class StepRate(float):
    """A step's learning rate that also carries the momentum its schedule sets for that
    step (`momentum`; None: the optimizer's own). It is a float everywhere else (a step
    report, a log line) and pickles as a plain float."""

    momentum: float | None

    def __new__(cls, value: float, momentum: float | None = None) -> StepRate:
        rate = super().__new__(cls, value)
        rate.momentum = momentum
        return rate

    def __reduce__(self) -> tuple[type, tuple[float]]:
        return float, (float(self),)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate for this step: `lr`, times the group's own scale (a
    job's optimizer factory may give its groups rates of their own); and when `lr` is a
    `StepRate` with a momentum, every group's momentum (SGD's `momentum`, or the first of
    Adam's `betas`), as the scheduler sets it."""
    rate = float(lr)
    for group in optimizer.param_groups:
        scale = group.get("lr_scale", 1.0)
        group["lr"] = rate * scale if scale != 1.0 else rate
    momentum = getattr(lr, "momentum", None)
    if momentum is not None:
        for group in optimizer.param_groups:
            if "betas" in group:
                group["betas"] = (momentum, *group["betas"][1:])
            elif "momentum" in group:
                group["momentum"] = momentum


def step_lr(step: int, *, lr: float, warmup: int, total: int, optimizer: str | None = None,
            schedule: str | None = None) -> float:
    """The learning rate of `step`: today's warm-up and cosine decay (of `lr`, or of the
    job's optimizer's own rate), or the job's `--lr-schedule` times that rate (a
    `StepRate` carrying the step's momentum when that schedule cycles it)."""
    base = _base_lr(optimizer, lr)
    if schedule is None:
        return learning_rate(step, peak=base, warmup=warmup, total=total)
    k = min(step, total - 1)
    rate = base * user_schedule(schedule, optimizer, lr, total)[k]
    momenta = schedule_momenta(schedule, optimizer, lr, total)
    return rate if momenta is None else StepRate(rate, momenta[k])


@functools.lru_cache(maxsize=8)
def _base_lr(optimizer: str | None, lr: float) -> float:
    if optimizer is None:
        return lr
    probe = _user_optimizer([nn.Parameter(torch.zeros(1))], optimizer, lr)
    return float(probe.defaults.get("lr", lr))


def user_schedule(schedule: str, optimizer: str | None, lr: float, total: int) -> tuple[float, ...]:
    """The multiplier of every step 0..total-1: a function's value, or the rate a
    `torch.optim.lr_scheduler` class sets step by step on a throwaway optimizer (the job's,
    on one parameter) over its rate before the scheduler."""
    return _scheduled(schedule, optimizer, lr, total)[0]


def schedule_momenta(schedule: str, optimizer: str | None, lr: float,
                     total: int) -> tuple[float, ...] | None:
    """The momentum (SGD's `momentum`, Adam's first beta) a scheduler sets at every step
    0..total-1 (OneCycleLR's and CyclicLR's `cycle_momentum`); None when it sets none."""
    return _scheduled(schedule, optimizer, lr, total)[1]


def _momentum(group: dict[str, Any]) -> float | None:
    if "betas" in group:
        return float(group["betas"][0])
    return float(group["momentum"]) if "momentum" in group else None


@functools.lru_cache(maxsize=8)
def _scheduled(schedule: str, optimizer: str | None, lr: float,
               total: int) -> tuple[tuple[float, ...], tuple[float, ...] | None]:
    """(multipliers, momenta or None) of every step: see `user_schedule`."""
    call = parse_call(schedule)
    target = import_object(call.target)
    scheduler_base = getattr(torch.optim.lr_scheduler, "LRScheduler", None) or \
        torch.optim.lr_scheduler._LRScheduler
    if not (inspect.isclass(target) and issubclass(target, scheduler_base)):
        return tuple(float(target(step, **call.kwargs)) for step in range(total)), None
    if target.__name__ == "ReduceLROnPlateau":
        raise ValueError("ReduceLROnPlateau follows a metric, not the step: its rates cannot "
                         "be replayed; give a schedule of the step")
    param = nn.Parameter(torch.zeros(1))
    probe = make_optimizer(nn.ParameterList([param]), lr=lr, weight_decay=0.0, spec=optimizer)
    group = probe.param_groups[0]
    base, own = float(group["lr"]), _momentum(group)
    rates, momenta = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
        scheduler = target(probe, **call.kwargs)
        for _ in range(total):
            rates.append(float(group["lr"]) / base)
            momenta.append(_momentum(group))
            probe.step()
            scheduler.step()
    if all(m == own for m in momenta):
        return tuple(rates), None
    if own == 0.0 and "betas" not in group:
        raise ValueError(f"{target.__name__} cycles a momentum the optimizer has at 0 "
                         f"(no state to carry): give momentum=0.9 or cycle_momentum=False")
    return tuple(rates), tuple(float(m) for m in momenta)  # type: ignore[arg-type]  # one rate per group, checked above


@functools.lru_cache(maxsize=8)
def bytes_per_parameter(optimizer: str | None, lr: float) -> float:
    """About the bytes a parameter's packed state takes under the job's optimizer (None:
    the default AdamW): its own and its state tensors' for a 16 x 16 float32 weight (an
    elementwise optimizer keeps as much per element at any size, a factored one such as
    Adafactor less at larger sizes). For estimates made before any layer is built: the
    bytes a reconfiguration plans to move."""
    from bamboo.engine.layer_state import Kind, group_options, layer_layout
    weight = nn.Linear(16, 16, bias=False)
    built = make_optimizer(weight, lr=lr, weight_decay=0.0, spec=optimizer)
    layout = layer_layout(list(weight.named_parameters()), built, group_options(built))
    return sum(e.nbytes for e in layout.entries
               if e.kind in (Kind.PARAM, Kind.TENSOR)) / weight.weight.numel()


def check_optimizer(optimizer: str | None, schedule: str | None, lr: float, total: int) -> None:
    """Build the job's optimizer and schedule once here, so a wrong one is one line before
    any worker starts (ValueError): among them an optimizer whose per-parameter state
    cannot be learned from a probe step or carried (`bamboo.engine.layer_state`), tried on
    parameters of one, two and four dimensions."""
    if optimizer is not None:
        from bamboo.engine.layer_state import group_options, layer_layout
        probe = nn.ModuleDict({"linear": nn.Linear(2, 2), "conv": nn.Conv2d(1, 2, 1)})
        built = make_optimizer(probe, lr=lr, weight_decay=0.0, spec=optimizer)
        layer_layout(list(probe.named_parameters()), built, group_options(built))
    if schedule is not None:
        user_schedule(schedule, optimizer, lr, total)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor that brings the global gradient norm down to `max_norm` (1 when under)."""
    if max_norm <= 0 or total_norm <= max_norm:
        return 1.0
    return max_norm / (total_norm + 1e-6)
