"""The held-out pass between steps: forward only, nothing saved, nothing updated, closed by a
vote of its own; a loss during it means new roles and the pass again under them."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from bamboo.engine.comm import EVAL, Interrupted, PeerLost
from bamboo.engine.failover import recover
from bamboo.engine.step import StepState
from bamboo.plan.votes import Go, StepReport

if TYPE_CHECKING:
    from bamboo.engine.engine import NodeEngine

__all__ = ["evaluate", "EVAL_FAULT_INDEX"]

EVAL_FAULT_INDEX = -1
"""A fault's instruction index that means: in the evaluation after `step` steps, after each
of this node's val micro-batches."""


def evaluate(e: NodeEngine, step: int, batches: int) -> list[tuple[int, float, float]]:
    """The held-out loss of the parameters after `step` steps: val micro-batches
    0..batches-1 (pipeline d takes those with index % D == d) go forward through the
    pipeline with nothing saved and nothing updated; the last stage's holder returns
    (index, loss, weight) for its pipeline's share. The pass ends with a vote: if the
    roles changed meanwhile (a node was lost), every node applies the new roles (a
    failover, as between steps) and runs the pass again, so the result is that of
    the failure-free run. GenerationEnded as in `NodeEngine.run_step`."""
    scratch = StepState(step)  # what a role change applies to: nothing of a step is done yet
    scratch.report = StepReport(step=step, rank=e.rank, stages=[])
    while True:
        wait = False
        try:
            losses = _eval_pass(e, step, batches)
            if e.link.eval_done(step, e.roles.epoch, losses) is Go.GO:
                return losses
        except PeerLost as lost:
            wait = lost.peer not in e.roles.dead
        except Interrupted:
            pass
        recover(e, scratch, wait)


def _eval_pass(e: NodeEngine, step: int, batches: int) -> list[tuple[int, float, float]]:
    # Each node walks its val micro-batches in order and, within one, its stages in
    # order: between any two nodes the messages of a direction come in one order on
    # both sides (what strict communication needs), whatever stages each holds. The
    # epoch is in the tagged key: a message of a pass cut short never matches a later one.
    # A slot re-routed to data-parallel peers is evaluated by its first peer (its holder
    # in the role map), which walks that pipeline's micro-batches too.
    pipelines = e.roles.pipelines
    losses = []
    p2p = e.transport.p2p
    for index in range(batches):
        d = index % pipelines
        mine = [s for s in range(e.P) if e.holder(s, d) == e.rank and s in e.stages]
        if not mine:
            continue
        seq = ((e.roles.epoch % 64) << 12) | index
        batch, x = None, None
        for stage in mine:
            source = e.holder(stage - 1, d) if stage > 0 else e.rank
            if stage == 0:
                batch = e.task.eval_batch(index)
                x = batch.inputs.to(e.device)
            elif source != e.rank:
                spec = e.specs[e.parts[stage].start - 1]
                x = p2p.recv_interruptible(spec.shape, spec.dtype, e.device, source,
                                           (EVAL, stage - 1, seq), e.interrupted)
            with torch.no_grad(), e.autocast():
                out = e.stages[stage].module(x)
            if stage == e.P - 1:
                batch = batch or e.task.eval_batch(index)
                loss = e.loss(out.float(), batch.targets.to(e.device))
                losses.append((index, float(loss), 1.0 / batches))
                continue
            x = out.to(e.specs[e.parts[stage].stop - 1].dtype)
            target = e.holder(stage + 1, d)
            if target != e.rank:
                p2p.send(x, target, (EVAL, stage, seq))
        e.faults.check(step, EVAL_FAULT_INDEX, False, True)
    p2p.flush(set(e.roles.dead), e.interrupted)
    return losses
