"""The held-out pass between steps: forward only, nothing saved, nothing updated, the layers
in eval mode (no dropout) and any draw they still make seeded by (seed, val micro-batch,
layer) (`StageForward.held_out`). The engine closes it with a vote of its own
(`NodeEngine.evaluate`); a loss during it means new roles and the pass again under them."""
from __future__ import annotations

from collections.abc import Callable

import torch

from bamboo.data.datasets import Task, on_device
from bamboo.engine.comm import EVAL, P2P
from bamboo.engine.context import Held, NodeContext
from bamboo.engine.forward import metric_values
from bamboo.engine.stage import StageState
from bamboo.model.structure import float32
from bamboo.plan.faults import EVAL_FAULT_INDEX

__all__ = ["eval_pass", "EVAL_FAULT_INDEX", "MetricRows"]

Losses = list[tuple[int, float, float]]
"""(val micro-batch, loss, weight) of each micro-batch whose last stage this node ran."""

MetricRows = list[tuple[int, str, float]]
"""(val micro-batch, metric name, value) of each of them, for the job's `--metric`s."""


def eval_pass(ctx: NodeContext, held: Held, p2p: P2P, batches: int, *, task: Task,
              loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              forward: Callable[[StageState, torch.Tensor, int], torch.Tensor],
              after_batch: Callable[[int], None],
              metrics: MetricRows | None = None) -> Losses:
    """One pass over val micro-batches 0..batches-1 (pipeline d takes those with index % D
    == d) through the stages `held` gives this node, over `p2p`: the last stage's holder
    returns (index, loss, weight) for its pipeline's share. `forward(stage, x, index)` runs
    a stage on val micro-batch `index`. `after_batch(index)` after each val micro-batch this
    node ran. The task's metrics of each val micro-batch go to `metrics`."""
    # Each node walks its val micro-batches in order and, within one, its stages in
    # order: between any two nodes the messages of a direction come in one order on
    # both sides (what strict communication needs), whatever stages each holds. The
    # epoch is in the tagged key: a message of a pass cut short never matches a later one.
    # A slot re-routed to data-parallel peers is evaluated by its first peer (its holder
    # in the role map), which walks that pipeline's micro-batches too.
    roles, rank, device = held.roles, ctx.rank, ctx.device
    interrupted = ctx.interrupted(roles)
    losses = []
    for index in range(batches):
        d = index % roles.pipelines
        mine = [s for s in range(ctx.P) if roles.holders[d][s] == rank and s in held.stages]
        if not mine:
            continue
        seq = ((roles.epoch % 64) << 12) | index
        batch, x = None, None
        for stage in mine:
            source = roles.holders[d][stage - 1] if stage > 0 else rank
            if stage == 0:
                batch = task.eval_batch(index)
                x = on_device(batch.inputs, device)
            elif source != rank:
                spec = ctx.boundary_spec(stage, input_side=True)
                x = spec.unpack(p2p.recv_interruptible(spec.shape, spec.dtype, device, source,
                                                       (EVAL, stage - 1, seq), interrupted))
            out = forward(held.stages[stage], x, index)
            if stage == ctx.P - 1:
                batch = batch or task.eval_batch(index)
                labels = on_device(batch.targets, device)
                value = loss(float32(out), labels)
                losses.append((index, float(value), 1.0 / batches))
                if metrics is not None and task.metrics:
                    values = metric_values(task.metrics, out, labels)
                    metrics.extend((index, name, v) for name, v in values.items())
                continue
            spec = ctx.boundary_spec(stage, input_side=False)
            x = spec.cast(out)  # float tensors only
            target = roles.holders[d][stage + 1]
            if target != rank:
                p2p.send(spec.pack(x), target, (EVAL, stage, seq))
        after_batch(index)
    p2p.flush(set(roles.dead), interrupted)
    return losses
