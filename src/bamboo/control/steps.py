"""The step protocol: the two votes of every step, the commit, and the step records.

For step k under role epoch e, every live active node votes `MicroBatchesDone`; when all
have, the coordinator writes Go.GO to `go/k/e`. Then every node votes `RoundDone`; when
all succeeded, `decide/k/e` is COMMIT (with boundary flags from the generations part),
and step k's loss is the sum of the micro-batch losses. A vote under an older epoch is
answered ABORT/REDO. After the commit each node sends its `StepReport`; when every
expected report is in, the step's record (`step_done` event) is written in order, the
replicas' digests are compared, and the losses of that step are closed.

Evaluation (`--eval-every`) has a vote of its own between steps: after k steps, every live
active node votes `EvalDone` with the val losses it computed; when all have under the
current epoch, `eval/k/e` is GO and the held-out loss after k steps is recorded (once).

Nothing here grows with the run: when step k commits, every survivor has read the
decisions of step k-1 (it voted in step k after them), so the votes and the store keys of
steps up to k-2 are deleted (`FORGET_AFTER`).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from bamboo.control.metrics import reduce_metrics
from bamboo.control.nodes import Supervisor
from bamboo.control.state import RunContext, Stop
from bamboo.protocol.messages import (
    BoundaryFlag,
    Decision,
    EvalDone,
    Go,
    MicroBatchesDone,
    RoundDone,
    StepReport,
    Verdict,
    decide_key,
    eval_key,
    go_key,
)

__all__ = ["StepProtocol", "PendingStep", "FORGET_AFTER"]

FORGET_AFTER = 2
"""When step k commits, the votes and decision keys of steps <= k - FORGET_AFTER go."""


@dataclass(slots=True)
class PendingStep:
    step: int
    loss: float
    wall_s: float
    expected: set[int]
    """Node ids whose step report is awaited."""
    reports: dict[int, StepReport] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    """The job's metrics (`--metric`), each the mean over the global batch."""


class StepProtocol:
    """Votes, commits and step records of the current generation."""

    def __init__(self, ctx: RunContext, nodes: Supervisor, *, check_replicas: bool = False) -> None:
        self.ctx, self.nodes = ctx, nodes
        self.written: set[str] = set()
        """Decision keys in the store (each written once, deleted once no node can wait)."""
        self.eval_votes: dict[tuple[int, int], dict[int, EvalDone]] = {}
        self.evaluated: set[int] = {step for step, _ in ctx.eval_losses}
        """Steps whose held-out loss is recorded, a resumed run's included (a generation
        that starts again at an evaluation point evaluates again: the first result stands)."""
        self.evaluated_in_gen: set[tuple[int, int]] = set()
        """(generation, steps done) of every evaluation vote that completed: a generation
        that evaluates again after a restore is in its evaluation until its own vote does."""
        self.check_replicas = check_replicas
        self.micro_batches_done: dict[tuple[int, int], set[int]] = {}
        self.rounds: dict[tuple[int, int], dict[int, RoundDone]] = {}
        self.pending: dict[int, PendingStep] = {}
        self.decided: dict[int, set[str]] = {}
        """Step -> the decision keys written for it (deleted once no node can wait for them)."""
        self.round_failed_at: float | None = None
        self.last_commit_t = ctx.clock()

    def _member_node(self, rank: int) -> int:
        """Rank in the current generation -> node id."""
        return self.nodes.by_name(self.ctx.plan.members[rank]).node

    def _gone(self) -> set[int]:
        """Node ids whose reports will never come."""
        return {n.node for n in self.nodes if n.is_gone or n.exited}

    def live_active(self) -> set[int]:
        return set(self.ctx.roles.active_ranks())

    def _stale(self, epoch: int) -> bool:
        return epoch < self.ctx.roles.epoch or self.ctx.reconf is not None

    def on_micro_batches_done(self, msg: MicroBatchesDone) -> None:
        key = go_key(msg.step, msg.epoch)
        if self._stale(msg.epoch):
            self._decide(key, Go.ABORT.value, msg.step)
            return
        done = self.micro_batches_done.setdefault((msg.step, msg.epoch), set())
        done.add(msg.rank)
        if done >= self.live_active():
            self._decide(key, Go.GO.value, msg.step)

    def release_waiting_votes(self) -> None:
        """After a role change: a vote that only the lost node was missing is complete."""
        for (step, epoch), done in list(self.micro_batches_done.items()):
            if epoch == self.ctx.roles.epoch and done >= self.live_active():
                self._decide(go_key(step, epoch), Go.GO.value, step)

    def on_eval_done(self, msg: EvalDone) -> tuple[int, float, dict[str, float]] | None:
        """(steps done, held-out loss, held-out metrics) when this vote completes an
        evaluation not recorded yet: the caller records it."""
        key = eval_key(msg.step, msg.epoch)
        if self._stale(msg.epoch):
            self._decide(key, Go.ABORT.value, msg.step)
            return None
        votes = self.eval_votes.setdefault((msg.step, msg.epoch), {})
        votes[msg.rank] = msg
        if set(votes) >= self.live_active():
            self._decide(key, Go.GO.value, msg.step)
            del self.eval_votes[(msg.step, msg.epoch)]
            self.evaluated_in_gen.add((self.ctx.plan.gen, msg.step))
            if msg.step not in self.evaluated:
                self.evaluated.add(msg.step)
                losses = dict(sorted((i, (loss, w)) for v in votes.values()
                                     for i, loss, w in v.losses))
                metrics = reduce_metrics(row for v in votes.values() for row in v.metrics)
                return msg.step, math.fsum(loss * w for loss, w in losses.values()), metrics
        return None

    def eval_pending(self, step: int) -> bool:
        """An evaluation after `step` steps is due and not recorded yet."""
        return self.ctx.cfg.evaluates_at(step) and step not in self.evaluated

    def evaluating_in_this_generation(self, step: int) -> bool:
        """The current generation's nodes evaluate after `step` steps and their vote has not
        completed (a recorded result of an earlier generation does not end it)."""
        return self.ctx.cfg.evaluates_at(step) and \
            (self.ctx.plan.gen, step) not in self.evaluated_in_gen

    def moot(self, step: int, epoch: int) -> None:
        """Roles changed in `step`: votes under `epoch` are answered abort and redo."""
        self._decide(go_key(step, epoch), Go.ABORT.value, step)
        self._decide(decide_key(step, epoch), Decision.REDO.value, step)
        self.round_failed_at = None

    def on_round_done(self, msg: RoundDone) -> int | None:
        """The step whose commit round this vote completed, every vote a success and its
        loss finite: the caller commits it (`commit`, with the boundary's flags)."""
        key = decide_key(msg.step, msg.epoch)
        if self._stale(msg.epoch):
            self._decide(key, Decision.REDO.value, msg.step)
            return None
        reports = self.rounds.setdefault((msg.step, msg.epoch), {})
        reports[msg.rank] = msg
        if not msg.ok and self.round_failed_at is None:
            self.round_failed_at = self.ctx.clock()
        if set(reports) >= self.live_active() and all(r.ok for r in reports.values()):
            self._check_finite(msg.step, reports)
            return msg.step
        return None

    def commit(self, step: int, epoch: int, flags: frozenset[BoundaryFlag]) -> None:
        """Write step `step`'s COMMIT (with the boundary's `flags`) and commit it."""
        self._decide(decide_key(step, epoch), Verdict(Decision.COMMIT, flags).encode(), step)
        self._commit(step, self.rounds[(step, epoch)])

    @staticmethod
    def _step_loss(reports: dict[int, RoundDone]) -> float:
        mb_losses = sorted(x for r in reports.values() for x in r.losses)
        return math.fsum(loss * w for _, loss, w in mb_losses)

    def _check_finite(self, step: int, reports: dict[int, RoundDone]) -> None:
        """Stop before committing a step whose loss or gradient norm is not finite: its
        optimizer step would make every parameter non-finite (nothing of it is applied;
        the summary keeps the steps before it and no model is written)."""
        loss = self._step_loss(reports)
        norm = next((r.grad_norm for r in reports.values() if not math.isfinite(r.grad_norm)),
                    max((r.grad_norm for r in reports.values()), default=0.0))
        if math.isfinite(loss) and math.isfinite(norm):
            return
        if math.isfinite(loss) and self.ctx.cfg.model.precision == "fp16":
            self._check_loss_scale(step)  # an overflow: the step is skipped
            return
        raise Stop(f"training diverged in step {step}: loss {loss}, gradient norm {norm}; "
                   f"stopped before applying it (the summary holds the {step} steps before; "
                   f"no model written): lower --lr (it is {self.ctx.cfg.training.lr:g}) and "
                   f"run again")

    def _check_loss_scale(self, step: int) -> None:
        """fp16: skipping `step` must leave a usable loss scale (Stop else)."""
        after = self.ctx.loss_scale_at(step).after(True)
        if after.collapsed:
            streak, k = 1, step - 1
            while k in self.ctx.skipped_steps:
                streak, k = streak + 1, k - 1
            raise Stop(f"fp16: the gradients of step {step} overflowed again ({streak} "
                       f"steps in a row skipped): the loss scale fell to {after.scale:g}, so "
                       f"the model overflows in fp16 however its loss is scaled; stopped "
                       f"before any weight turned NaN: train it with precision bf16 or fp32, "
                       f"or look for an operation that overflows in half precision")

    def _commit(self, step: int, reports: dict[int, RoundDone]) -> None:
        ctx = self.ctx
        self.round_failed_at = None
        loss = self._step_loss(reports)
        now = ctx.clock()
        expected = {self._member_node(r) for r in self.live_active()}
        metrics = reduce_metrics(row for r in reports.values() for row in r.metrics)
        self.pending[step] = PendingStep(step, loss, now - self.last_commit_t, expected,
                                         metrics=metrics)
        self.last_commit_t = now
        ctx.committed = step + 1
        self._note_layout(step)
        del ctx.losses[step:]
        ctx.losses.append(loss)
        ctx.skipped_steps[:] = [k for k in ctx.skipped_steps if k < step]
        if ctx.cfg.model.precision == "fp16" and \
                not all(math.isfinite(r.grad_norm) for r in reports.values()):
            ctx.skipped_steps.append(step)
        if ctx.cfg.training.metrics:
            del ctx.metrics[step:]
            ctx.metrics.append(metrics)
        self._forget(step - FORGET_AFTER)

    def _note_layout(self, step: int) -> None:
        """Step `step` commits under the current roles: D x P, and whether a slot of it is
        served by its stage's peers (a re-route sums that stage's gradients in another order)."""
        ctx, roles = self.ctx, self.ctx.roles
        now = {"pipelines": roles.pipelines, "stages": roles.stages,
               "rerouted": bool(roles.reroutes)}
        last = ctx.layouts[-1] if ctx.layouts else None
        if last is None or any(last[k] != v for k, v in now.items()):
            ctx.layouts.append({"from_step": step, **now})

    def _forget(self, upto: int) -> None:
        """Drop the votes of steps <= `upto` and delete their decision keys from the store:
        every survivor read them before it voted in a later step."""
        for votes in (self.micro_batches_done, self.rounds, self.eval_votes):
            for step, epoch in [k for k in votes if k[0] <= upto]:
                del votes[(step, epoch)]
        for step in [s for s in self.decided if s <= upto]:
            for key in self.decided.pop(step):
                if key in self.written:  # no node can still wait for it: the store stays bounded
                    self.written.discard(key)
                    self.ctx.store.delete_key(key)

    def _decide(self, key: str, value: str, step: int) -> None:
        """Write a decision key of `step` (a decision, once written, never changes),
        remembered for `_forget`."""
        if key not in self.written:
            self.written.add(key)
            self.ctx.store.set(key, value)
        self.decided.setdefault(step, set()).add(key)

    def on_step_report(self, node: int, msg: StepReport) -> None:
        pending = self.pending.get(msg.step)
        if pending is not None:
            pending.reports[node] = msg

    def completed(self) -> Iterator[tuple[PendingStep, list[StepReport]]]:
        """Every committed step whose reports are all in (or will never come), in order:
        the caller records each, then checks its replicas (`check_digests`)."""
        gone = self._gone()
        while self.pending:
            first = min(self.pending)
            p = self.pending[first]
            if not (p.expected - gone) <= set(p.reports):
                return
            del self.pending[first]
            yield p, sorted(p.reports.values(), key=lambda r: r.rank)

    def rewind(self, step: int) -> None:
        """A restore goes back to `step`: the steps after it are redone, and records of
        later steps will never complete."""
        self.ctx.committed = step
        del self.ctx.losses[step:]
        del self.ctx.metrics[step:]
        self.ctx.skipped_steps[:] = [k for k in self.ctx.skipped_steps if k < step]
        self.pending = {k: v for k, v in self.pending.items() if k < step}

    def new_generation(self) -> None:
        """A new plan is out: a failed round of the old generation explains nothing now."""
        self.round_failed_at = None

    def timing_from(self, t: float) -> None:
        """The first generation runs: the first step's wall time counts from `t`."""
        self.last_commit_t = t

    def check_digests(self, reports: list[StepReport], step: int) -> None:
        if not self.check_replicas:
            return
        roles = self.ctx.roles
        primaries, replicas = {}, {}
        for r in reports:
            for name, digest in r.digests.items():
                stage = int(name.removeprefix("replica").removeprefix("stage"))
                target = replicas if name.startswith("replica") else primaries
                target[(roles.pipeline_of(r.rank), stage)] = digest
        for key, digest in replicas.items():
            if key in primaries and primaries[key] != digest:
                raise Stop(f"replica of stage {key[1]} in pipeline {key[0]} differs from its "
                           f"primary after step {step}")
        self.ctx.events.write("replicas_checked", step=step, replicas=len(replicas))

    def stalled_round(self) -> bool:
        """A node reported a failed round and no loss explains it within the lease."""
        return self.round_failed_at is not None and \
            self.ctx.clock() - self.round_failed_at > self.ctx.cfg.runtime.lease_s + 5
