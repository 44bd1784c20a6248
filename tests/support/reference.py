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
from bamboo.data.user import job_task
from bamboo.model import build_layers, forward_seed, loss_fn, run_layers
from bamboo.engine.optim import clip_coefficient, make_optimizer, set_lr
from bamboo.engine.options import EngineOptions


def train_reference(cfg: JobConfig, evals: list[list[float]] | None = None,
                    metrics: list[dict[str, float]] | None = None
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses per step and final parameters (named like model.pt's keys); with `evals`, the
    held-out losses `[steps done, loss]` at the config's evaluation points go there; with
    `metrics`, each step's mean of the job's metrics (`--metric`) over its micro-batches.
    The job's own Dataset, loss and metrics (`--dataset`, `--loss`, `--metric`) are used as
    the workers build them (`bamboo.data.user.job_task`)."""
    torch.set_num_threads(1)
    p = cfg.model_preset()
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
            evals.append([step, evaluate(model, task, criterion, cfg.evaluation.batches,
                                         seed=cfg.training.seed)])
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
        evals.append([cfg.training.steps, evaluate(model, task, criterion, cfg.evaluation.batches,
                                                   seed=cfg.training.seed)])
    named = {f"layers.{name}": t.detach().clone() for name, t in model.named_parameters()}
    return losses, named


def forward(model: nn.Sequential, x: torch.Tensor, seed: int, step: int | str,
            mb: int) -> torch.Tensor:
    """The whole model on micro-batch `mb` of `step`, layer by layer, each layer's draws
    seeded as the pipeline seeds them."""
    return run_layers(model, range(len(model)), x, device="cpu",
                      seed_of=lambda layer: forward_seed(seed, step, mb, layer))


def evaluate(model: nn.Sequential, task, criterion, batches: int, seed: int = 0) -> float:
    """The mean loss over val micro-batches 0..batches-1, summed in index order, the model
    in eval mode (and back in train mode after)."""
    model.eval()
    try:
        with torch.no_grad():
            return math.fsum(
                float(criterion(forward(model, b.inputs, seed, "eval", index), b.targets))
                / batches for index, b in enumerate(map(task.eval_batch, range(batches))))
    finally:
        model.train()
