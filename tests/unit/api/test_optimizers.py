"""The job's own optimizer and schedule: written as calls every process makes again, built
here once so a wrong one is one line, the rates a pure function of the step, and the
state a layer carries to a peer or a checkpoint whichever optimizer keeps it."""
from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

import bamboo
from bamboo.api.optimizers import call_text
from bamboo.config import ConfigError
from bamboo.config.calls import parse_call
from bamboo.config.presets import ModelPreset, preset
from bamboo.engine.optim import learning_rate, make_optimizer, set_lr, step_lr
from bamboo.engine.stage import StageOptimizer, StageState

SGD = "torch.optim.sgd:SGD(lr=0.05, momentum=0.9)"
ONE_CYCLE = "torch.optim.lr_scheduler:OneCycleLR(max_lr=0.1, total_steps=6)"


def halve_after_two(step: int, factor: float = 0.5) -> float:
    """A schedule: step -> multiplier of the optimizer's rate."""
    return 1.0 if step < 2 else factor


def test_the_forms_an_optimizer_and_a_schedule_take() -> None:
    assert call_text(functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9), "o") == SGD
    assert call_text(torch.optim.Adagrad, "o") == "torch.optim.adagrad:Adagrad()"
    assert call_text("torch.optim:SGD( lr = 5e-2 )", "o") == "torch.optim:SGD(lr=0.05)"
    assert call_text(functools.partial(halve_after_two, factor=0.25), "s") == \
        f"{__name__}:halve_after_two(factor=0.25)"
    job = bamboo.Job(nodes=2, stages=2, steps=6,
                     optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
                     schedule=functools.partial(torch.optim.lr_scheduler.OneCycleLR,
                                                max_lr=0.1, total_steps=6))
    assert (job.config.training.optimizer, job.config.training.lr_schedule) == (SGD, ONE_CYCLE)
    assert job.options()["optimizer"] == SGD  # summary.json's config block names it


@pytest.mark.parametrize("options, expected", [
    ({"optimizer": torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)},
     "an instance cannot reach the workers"),
    ({"optimizer": functools.partial(torch.optim.SGD, 0.1)}, "give them by keyword"),
    ({"optimizer": functools.partial(torch.optim.SGD, lr=torch.tensor(0.1))},
     "lr=tensor(0.1000) is not a literal"),
    ({"optimizer": "torch.optim:SGD(lr=0.1, momentumm=0.9)"},
     "unexpected keyword argument 'momentumm'"),
    ({"optimizer": "torch.optim:Nope()"}, "'torch.optim' has no callable 'Nope'"),
    ({"optimizer": "torch.optim:LBFGS()"},
     "LBFGS could not step a probe parameter (TypeError: "),
    ({"schedule": (lambda steps: lambda step: next(steps))(i for i in range(9))},
     "schedule: function cannot be sent by value (TypeError: cannot pickle"),
    ({"schedule": "torch.optim.lr_scheduler:ReduceLROnPlateau()"}, "follows a metric"),
    ({"schedule": "torch.optim.lr_scheduler:OneCycleLR(max_lr=0.1, total_steps=3)"},
     "--lr-schedule torch.optim.lr_scheduler:OneCycleLR(max_lr=0.1, total_steps=3): Tried to "
     "step"),
])
def test_a_wrong_optimizer_or_schedule_is_one_line(options: dict, expected: str) -> None:
    with pytest.raises(bamboo.JobError) as e:
        bamboo.Job(nodes=2, stages=2, steps=6, **options)
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_call_text_parses_literals_only() -> None:
    call = parse_call("/abs/x.py:f(a=1, b=(0.9, 0.95), c='s', d=None, e={'k': [1]})")
    assert (call.target, call.kwargs) == ("/abs/x.py:f", {"a": 1, "b": (0.9, 0.95), "c": "s",
                                                         "d": None, "e": {"k": [1]}})
    for bad in ("SGD", "torch.optim:SGD(0.1)", "torch.optim:SGD(lr=x)", "torch.optim:SGD(**k)",
                "a b:c()"):
        with pytest.raises(ValueError):
            parse_call(bad)
    with pytest.raises(ConfigError, match="--optimizer 'SGD' is not MODULE:NAME"):
        bamboo.api.job.config_of({"optimizer": "SGD"}, where=None)


def test_the_default_rate_is_todays_and_a_schedule_multiplies_the_optimizers_rate() -> None:
    for step in range(8):
        assert step_lr(step, lr=3e-3, warmup=2, total=8) == \
            learning_rate(step, peak=3e-3, warmup=2, total=8)
        assert step_lr(step, lr=3e-3, warmup=2, total=8, optimizer=SGD) == \
            learning_rate(step, peak=0.05, warmup=2, total=8)
        assert step_lr(step, lr=3e-3, warmup=2, total=8, optimizer=SGD,
                       schedule=f"{__name__}:halve_after_two") == \
            (0.05 if step < 2 else 0.025)


def test_a_schedulers_rates_are_torchs_step_by_step() -> None:
    """The rates a OneCycleLR sets on a real SGD over six steps, as the engine takes them."""
    model = nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=0.1, total_steps=6)
    expected = []
    for _ in range(6):
        expected.append(sgd.param_groups[0]["lr"])
        sgd.step()
        scheduler.step()
    got = [step_lr(k, lr=1.0, warmup=0, total=6, optimizer=SGD, schedule=ONE_CYCLE)
           for k in range(6)]
    assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(got, expected)), (got, expected)


def group_factory(params, lr: float = 0.1):
    """An optimizer factory with groups of their own rates."""
    params = list(params)
    return torch.optim.SGD([{"params": params[:1], "lr": lr}, {"params": params[1:], "lr": lr / 10}],
                           lr=lr, momentum=0.5)


def test_a_factorys_groups_keep_their_own_rates_under_the_schedule() -> None:
    optimizer = make_optimizer(nn.Linear(2, 2), lr=3e-3, weight_decay=0.0,
                               spec=f"{__name__}:group_factory(lr=0.2)")
    set_lr(optimizer, 0.1)
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, pytest.approx(0.01)]


def stage(spec: str | None) -> StageState:
    p: ModelPreset = preset("gpt2-tiny")
    return StageState(preset=p, stage=0, layer_indices=range(0, 2), seed=1,
                      device=torch.device("cpu"), optim=StageOptimizer(0.05, 0.0, spec))


@pytest.mark.parametrize("spec, keys", [
    (None, ("step", "exp_avg", "exp_avg_sq")),
    (SGD, ("momentum_buffer",)),
    ("torch.optim:Adagrad()", ("step", "sum")),
    ("torch.optim:RMSprop(centered=True, momentum=0.5)",
     ("step", "square_avg", "momentum_buffer", "grad_avg"))])
def test_a_layers_state_carries_the_optimizers_own_state(spec: str | None, keys: tuple) -> None:
    """After two steps, a layer's state loaded into a fresh stage gives the same parameters
    and optimizer state: the next step of both is the same, bit for bit."""
    a, b = stage(spec), stage(spec)
    torch.manual_seed(0)
    grads = [torch.randn(a.numel) for _ in range(3)]
    for g in grads[:2]:
        a.apply(g, 1.0, 0.05)
    for i in a.layer_indices:
        b.load_layer_state(i, a.layer_state(i))
    a.apply(grads[2], 1.0, 0.05)
    b.apply(grads[2], 1.0, 0.05)
    assert a.digest() == b.digest()
    for p, q in zip(a.params, b.params):
        assert tuple(a.optimizer.state[p]) == keys
        for key in keys:
            assert torch.equal(torch.as_tensor(a.optimizer.state[p][key]),
                               torch.as_tensor(b.optimizer.state[q][key]))


def test_a_lambda_or_closure_schedule_is_sent_by_value_in_the_call_text() -> None:
    """No import path: pickled (bamboo.config.objects), its reference the call's target,
    which every importer resolves and an agent is sent (`objects.references`)."""
    from bamboo.config import objects
    from bamboo.model.api import import_object
    floor = 0.25
    job = bamboo.Job(nodes=2, stages=2, steps=6, optimizer=functools.partial(
        torch.optim.SGD, lr=0.1), schedule=lambda step: max(floor, 1.0 - step / 6))
    text = job.config.training.lr_schedule
    [ref] = objects.references(job.options())
    assert text == f"{ref}()" and job.config.training.optimizer == SGD.split("(")[0] + "(lr=0.1)"
    assert import_object(ref)(5) == 0.25
