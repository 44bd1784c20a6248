"""A schedule that cycles the momentum (OneCycleLR's and CyclicLR's `cycle_momentum`):
every step's momentum is taken from the scheduler once, with its rate, and set on the
optimizer before that step, so a stage steps as torch's own scheduler would have it."""
from __future__ import annotations

import json
import math
import pickle

import pytest
import torch
from torch import nn

import bamboo
from bamboo.engine.optim import StepRate, make_optimizer, schedule_momenta, set_lr, step_lr

SGD = "torch.optim:SGD(lr=0.05, momentum=0.9)"
ADAMW = "torch.optim:AdamW(lr=0.01, betas=(0.9, 0.99))"
STEPS = 8


def one_cycle(**extra: object) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in {"max_lr": 0.1, "total_steps": STEPS,
                                               **extra}.items())
    return f"torch.optim.lr_scheduler:OneCycleLR({args})"


def torchs_own(optimizer_class: type, options: dict, **scheduler_options: object
               ) -> tuple[list[float], list[float], list[torch.Tensor]]:
    """Rates, momenta and parameters, step by step, of torch's OneCycleLR driving a real
    optimizer on a small model."""
    model = model_of_seed()
    optimizer = optimizer_class(model.parameters(), **options)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=STEPS,
                                                    **scheduler_options)
    rates, momenta, params = [], [], []
    for step in range(STEPS):
        group = optimizer.param_groups[0]
        rates.append(group["lr"])
        momenta.append(group["betas"][0] if "betas" in group else group["momentum"])
        gradients(model, step)
        optimizer.step()
        scheduler.step()
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return rates, momenta, params


def model_of_seed() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def gradients(model: nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)


def bamboos(spec: str, schedule: str) -> tuple[list[float], list[float], list[torch.Tensor]]:
    """The same steps as a stage takes them: the step's rate from `step_lr`, set by
    `set_lr` on the job's optimizer, then the optimizer's step."""
    model = model_of_seed()
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.0, spec=spec)
    rates, momenta, params = [], [], []
    for step in range(STEPS):
        rate = step_lr(step, lr=1e-3, warmup=0, total=STEPS, optimizer=spec, schedule=schedule)
        set_lr(optimizer, rate)
        group = optimizer.param_groups[0]
        rates.append(group["lr"])
        momenta.append(group["betas"][0] if "betas" in group else group["momentum"])
        gradients(model, step)
        optimizer.step()
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return rates, momenta, params


@pytest.mark.parametrize("spec, optimizer_class, options", [
    (SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (ADAMW, torch.optim.AdamW, {"lr": 0.01, "betas": (0.9, 0.99)}),
])
def test_one_cycles_momentum_is_torchs_step_by_step(spec: str, optimizer_class: type,
                                                   options: dict) -> None:
    """SGD's momentum and AdamW's first beta go 0.95 -> 0.85 -> 0.95 as torch's own
    OneCycleLR sets them (exactly), the rates within a rounding, and the parameters of
    every step with them."""
    expected_rates, expected_momenta, expected_params = torchs_own(optimizer_class, options)
    rates, momenta, params = bamboos(spec, one_cycle())
    assert momenta == expected_momenta
    assert momenta[0] == 0.95 and min(momenta) < 0.86  # it does cycle
    assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(rates, expected_rates))
    for got, want in zip(params, expected_params):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    if "betas" in options:  # the second beta is the optimizer's own
        optimizer = make_optimizer(model_of_seed(), lr=1e-3, weight_decay=0.0, spec=spec)
        set_lr(optimizer, step_lr(3, lr=1e-3, warmup=0, total=STEPS, optimizer=spec,
                                  schedule=one_cycle()))
        assert optimizer.param_groups[0]["betas"] == (expected_momenta[3], 0.99)


def test_without_cycle_momentum_the_optimizers_own_momentum_stays() -> None:
    schedule = one_cycle(cycle_momentum=False)
    assert schedule_momenta(schedule, SGD, 1e-3, STEPS) is None
    rate = step_lr(2, lr=1e-3, warmup=0, total=STEPS, optimizer=SGD, schedule=schedule)
    assert type(rate) is float
    _, momenta, _ = bamboos(SGD, schedule)
    assert momenta == [0.9] * STEPS


def test_a_step_rate_is_a_float_on_the_wire_and_in_a_checkpoint() -> None:
    """A step report or an optimizer's state dict that holds one reads back as a float."""
    rate = StepRate(0.25, 0.9)
    assert rate == 0.25 and rate.momentum == 0.9
    back = pickle.loads(pickle.dumps(rate))
    assert type(back) is float and back == 0.25
    assert json.loads(json.dumps({"lr": rate})) == {"lr": 0.25}
    optimizer = make_optimizer(model_of_seed(), lr=1e-3, weight_decay=0.0, spec=SGD)
    set_lr(optimizer, rate)
    assert type(optimizer.param_groups[0]["lr"]) is float


def test_cycling_the_momentum_of_an_optimizer_without_one_is_one_line() -> None:
    """SGD built with momentum=0 keeps no momentum buffer for a peer or a checkpoint to
    carry, while the cycled momentum would make it one: refused before any worker."""
    with pytest.raises(bamboo.JobError) as e:
        bamboo.Job(nodes=2, stages=2, steps=STEPS, optimizer="torch.optim:SGD(lr=0.05)",
                   schedule=one_cycle())
    assert "cycle_momentum=False" in str(e.value) and "\n" not in str(e.value), str(e.value)
    bamboo.Job(nodes=2, stages=2, steps=STEPS, optimizer="torch.optim:SGD(lr=0.05)",
               schedule=one_cycle(cycle_momentum=False))
