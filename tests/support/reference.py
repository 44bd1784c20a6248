"""A plain, single-process training loop: the ground truth pipelined runs must match.

Whole model in one nn.Sequential, micro-batches in global order, gradients summed
in float64, global-norm clipping, AdamW: no pipeline, no communication. Every layer's
forward draws from the generators seeded by (seed, step, micro-batch, layer) as the
pipeline's do (`bamboo.model.run_layers`), so dropout masks are the same; the held-out
loss runs the model in eval mode, as the pipeline's held-out pass does.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from bamboo.config import JobConfig
from bamboo.data.sizing import SIZING
from bamboo.data.user import job_task
from bamboo.engine.optim import clip_coefficient, make_optimizer, set_lr
from bamboo.engine.options import EngineOptions
from bamboo.model import build_layers, forward_seed, loss_fn, run_layers


def train_reference(cfg: JobConfig, evals: list[list[float]] | None = None,
                    metrics: list[dict[str, float]] | None = None,
                    eval_metrics: list[list] | None = None
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses per step and final parameters (named like model.pt's keys); with `evals`, the
    held-out losses `[steps done, loss]` at the config's evaluation points go there; with
    `metrics`, each step's mean of the job's metrics (`--metric`) over its micro-batches,
    with `eval_metrics` `[steps done, {name: held-out mean}]` at each evaluation.
    The job's own Dataset, loss and metrics (`--dataset`, `--loss`, `--metric`) are used as
    the workers build them (`bamboo.data.user.job_task`)."""
    torch.set_num_threads(1)
    p = cfg.model_preset(SIZING)
    G = cfg.global_micro_batches
    model = nn.Sequential(*build_layers(p, range(p.layers), cfg.training.seed))
    task = job_task(cfg, p)
    optimizer = make_optimizer(model, lr=cfg.training.lr, weight_decay=cfg.training.weight_decay,
                               spec=cfg.training.optimizer)
    options = EngineOptions.from_config(cfg)
    criterion = task.loss or loss_fn(p)
    params = list(model.parameters())
    losses = []
    for step in range(cfg.training.steps):
        if evals is not None and cfg.evaluates_at(step):
            _evaluate_into(evals, eval_metrics, step, model, task, criterion, cfg)
        acc = [torch.zeros_like(q, dtype=torch.float64) for q in params]
        step_loss, step_metrics = 0.0, dict.fromkeys(task.metrics, 0.0)
        for g in range(G):
            batch = task.batch(step, g)
            out = forward(model, batch.inputs, cfg.training.seed, step, g)
            loss = criterion(out, batch.targets)
            step_loss += float(loss.detach()) / G
            with torch.no_grad():
                for name, fn in task.metrics.items():
                    step_metrics[name] += float(fn(out.detach().float(), batch.targets)) / G
            (loss * (1.0 / G)).backward()
            for a, q in zip(acc, params):
                if q.grad is not None:  # a parameter the loss does not reach: as the engine
                    a.add_(q.grad)
                q.grad = None
        norm = math.sqrt(sum(float(a.square().sum()) for a in acc))
        coef = clip_coefficient(norm, cfg.training.grad_clip)
        for a, q in zip(acc, params):
            q.grad = a.float() * coef if coef != 1.0 else a.float()
        set_lr(optimizer, options.lr_at(step))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
        if metrics is not None:
            metrics.append(step_metrics)
    if evals is not None and cfg.evaluates_at(cfg.training.steps):
        _evaluate_into(evals, eval_metrics, cfg.training.steps, model, task, criterion, cfg)
    named = {f"layers.{name}": t.detach().clone() for name, t in model.named_parameters(remove_duplicate=False)}
    return losses, named


def _evaluate_into(evals: list, eval_metrics: list | None, step: int, model: nn.Sequential,
                   task, criterion, cfg: JobConfig) -> None:
    """The held-out loss after `step` steps into `evals` (its metrics into `eval_metrics`)."""
    values: dict[str, float] = {}
    evals.append([step, evaluate(model, task, criterion, cfg.evaluation.batches,
                                 seed=cfg.training.seed, metrics=values)])
    if eval_metrics is not None and values:
        eval_metrics.append([step, values])


def forward(model: nn.Sequential, x: torch.Tensor, seed: int, step: int | str,
            mb: int) -> torch.Tensor:
    """The whole model on micro-batch `mb` of `step`, layer by layer, each layer's draws
    seeded as the pipeline seeds them."""
    return run_layers(model, range(len(model)), x, device="cpu",
                      seed_of=lambda layer: forward_seed(seed, step, mb, layer))


def evaluate(model: nn.Sequential, task, criterion, batches: int, seed: int = 0,
             metrics: dict[str, float] | None = None) -> float:
    """The mean loss over val micro-batches 0..batches-1, summed in index order, the model
    in eval mode (and back in train mode after); the task's metrics' means go to `metrics`."""
    model.eval()
    losses, values = [], {name: [] for name in task.metrics}
    try:
        with torch.no_grad():
            for index in range(batches):
                b = task.eval_batch(index)
                out = forward(model, b.inputs, seed, "eval", index)
                losses.append(float(criterion(out, b.targets)) / batches)
                for name, fn in task.metrics.items():
                    values[name].append(float(fn(out.float(), b.targets)))
    finally:
        model.train()
    if metrics is not None:
        metrics.update({name: math.fsum(v) / batches for name, v in values.items()})
    return math.fsum(losses)
