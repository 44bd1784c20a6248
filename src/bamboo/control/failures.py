"""Failure handling: a node's process ended, and the run must account for it.

A node that drained and left is a `drain`. A node killed by a signal is a loss, and
becomes, in this order of preference:

- a **failover** or **peer restore** in flight: a new role map (`plan_failover`) that
  every survivor applies to the step under way;
- a **re-route** in flight (`plan_reroute`): under `--redundancy reroute`; and under eager
  or lazy with D >= 2 when its peers carry less than a shadow would, or no shadow can
  (`roles.shadow_or_reroute`);
- an **abandoned generation**: no in-flight copy covers it (or it happened while a
  generation formed), so the next plan restores it from live copies, or from a restore
  point (a **checkpoint restore**);
- with `--recovery checkpoint-restart` (the baseline), every worker is restarted and the
  last checkpoint loaded, as torchrun would.

This module is the only writer of `node_lost`: each loss is written exactly once, when
its handling is known (for in-flight ones, when its step's records are in). It is also
the one writer of every `Loss` (a new generation's restore reaches it through `covered`).
"""
from __future__ import annotations

import signal
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from bamboo.control.final_layers import FinalLayers
from bamboo.control.generations import Generations
from bamboo.control.kills import Kills
from bamboo.control.nodes import Node, NodeState, Supervisor
from bamboo.control.state import HandledAs, Loss, Reconfiguration, RunContext, Stop
from bamboo.control.steps import StepProtocol
from bamboo.plan.roles import (
    FailoverPlan,
    Takeover,
    Unrecoverable,
    plan_failover,
    plan_reroute,
    shadow_or_reroute,
)
from bamboo.protocol.messages import PHASES, StepReport

__all__ = ["FailureHandler", "ExitOutcome", "ZERO_COUNTS"]

ZERO_COUNTS = {"frc_reused": 0, "brc": 0, "resent_grads": 0}


@dataclass(slots=True)
class ExitOutcome:
    """What a node's exit changed, for the caller to act on."""

    roles_changed: bool = False
    """An in-flight role change: the layout is news, and step records may be complete."""
    restart: list[Node] | None = None
    """Checkpoint-restart: the workers stopped (maybe none), each to be replaced by a fresh
    one (`Generations.restarting` then waits for them)."""


class FailureHandler:
    def __init__(self, ctx: RunContext, nodes: Supervisor, steps: StepProtocol,
                 generations: Generations, kills: Kills, final_layers: FinalLayers) -> None:
        self.ctx, self.nodes, self.steps, self.gens = ctx, nodes, steps, generations
        self.final_layers = final_layers
        """Asked, for a loss after the last step, which unwritten layers it left uncopied."""
        self.kills = kills
        """Told which `--kill` a loss carried out."""
        self.losses: list[Loss] = []
        self.standby_losses = 0
        self.written_order: list[Loss] = []
        """Every loss whose `node_lost` event is out, standbys' included, in that order."""
        self.reconfigured_steps: set[int] = set()
        """First steps of generations a reconfiguration made: not clean steps."""
        self.abandoned_after_last_step: int | None = None
        """The generation that finished the last step and was abandoned after it: a loss
        while it ends (its nodes lost together) is after the last step too."""
        self.restore_step: tuple[int, int] | None = None
        self.restores: list[Takeover] = []
        """Peer restores of (generation, step) `restore_step`: their sources must survive,
        and their receivers cannot serve as sources until the step commits."""

    # -- a process ended --------------------------------------------------------------------

    def on_exit(self, n: Node) -> ExitOutcome:
        """`n`'s process is gone (its pipe already drained); its handles are closed after."""
        try:
            return self._on_exit(n)
        finally:
            self.nodes.release(n)

    def _on_exit(self, n: Node) -> ExitOutcome:
        self.nodes.exited(n)
        self.gens.not_ending(n.node)
        code = n.process.exitcode
        if n.state is NodeState.RETIRED:
            return ExitOutcome()
        if n.state is NodeState.LEFT:
            self._drained(n)
            return ExitOutcome()
        if n.state is NodeState.DONE and code == 0:
            return ExitOutcome()
        if (death := self.nodes.launcher_broken(code)) is not None:
            raise Stop(f"{death} (worker {n.name} exited with code {code})")
        if code is not None and code < 0:
            return self.on_lost(n, self._signal_name(n, -code))
        if n.state is not NodeState.DONE:
            output = f"its output: {self.nodes.log_path(n.name)}" if n.machine is None \
                else f"its output: {n.name}.log in its agent's --log-dir"
            raise Stop(f"worker {n.name} ({self.gens.where(n)}) exited with code {code} "
                       f"before finishing ({output}; events.jsonl)")
        return ExitOutcome()

    def _signal_name(self, n: Node, signum: int) -> str:
        name = signal.Signals(signum).name
        if signum == signal.SIGKILL and not n.kill_sent and self.nodes.oom_killed(n):
            return f"{name} (the kernel's OOM killer)"
        return name

    def _drained(self, n: Node) -> None:
        """A noticed node handed its state over at a step boundary and left."""
        loss = Loss(node=n.name, rank=n.rank, step=self.ctx.committed, phase="boundary",
                    handled_as=HandledAs.DRAIN, shadow=None, t=self._t(), signal="notice",
                    counts=dict(ZERO_COUNTS), active_before=self.ctx.plan.active)
        self.losses.append(loss)
        self._write(loss)

    def _t(self) -> float:
        return self.ctx.clock() - self.ctx.t0

    # -- a loss -----------------------------------------------------------------------------

    def on_lost(self, n: Node, signame: str) -> ExitOutcome:
        """`n` was preempted. The cases, in the order tried: a standby; after the last step;
        while a generation forms; in flight (failover, peer restore, re-route); else abandon."""
        ctx = self.ctx
        self.nodes.set_state(n, NodeState.LOST)
        step = ctx.committed
        in_gen = n.rank is not None and ctx.plan.members[n.rank] == n.name
        if in_gen:
            self.kills.node_lost(n.rank)
        if not in_gen:
            self.standby_losses += 1
            self.written_order.append(Loss(node=n.name, rank=None, step=step, phase="standby",
                                           handled_as=HandledAs.STANDBY, shadow=None,
                                           t=self._t(), signal=signame, written=True))
            ctx.events.write("node_lost", node=n.name, step=step, phase="standby",
                             handled_as=HandledAs.STANDBY, signal=signame, pause_s=0.0)
            ctx.say(f"standby node {n.name} lost ({signame})")
            return ExitOutcome()
        active = n.rank < ctx.plan.active and n.rank in self.steps.live_active()
        progress = self.nodes.progress
        phase = PHASES[progress.phase_of(n.slot)] if progress.step_of(n.slot) == step \
            else "between steps"
        where = self.gens.where(n)
        loss = Loss(node=n.name, rank=n.rank, step=step, phase=phase,
                    handled_as=HandledAs.PENDING, shadow=None, t=self._t(), signal=signame,
                    active_before=ctx.plan.active)
        self.losses.append(loss)
        if step >= ctx.end_step and ctx.reconf is None and self.gens.running() \
                and not self.steps.evaluating_in_this_generation(step):
            return self._after_last_step(n, loss, signame, where)
        if ctx.reconf is not None or not active or not self.gens.running():
            ending = self.abandoned_after_last_step == ctx.plan.gen
            loss.phase = "after the last step" if ending else "reconfiguration"
            out = self._abandon(f"node {n.name} lost while a generation formed", loss, why="")
            when = "after the last step" if ending else f"in step {step} while a generation formed"
            ctx.say(f"node {n.name} ({where}) lost {when}; the next generation covers it")
            return out
        try:
            plan = self._failover_plan(n, step)
        except Unrecoverable as e:
            ctx.events.write("fault_detected", node=n.name, step=step, phase=phase,
                             signal=signame, handled_as="reconfiguration", error=str(e))
            out = self._abandon(f"node {n.name} lost in step {step}: {e}", loss,
                                why=f"node {n.name} ({where}) was lost in step {step} "
                                    f"({signame}); {e}")
            ctx.say(f"node {n.name} ({where}) lost in step {step} during {phase}; {e}: the next "
                    f"generation restores it")
            return out
        self._in_flight(n, loss, plan, phase, signame, where)
        return ExitOutcome(roles_changed=True)

    def _after_last_step(self, n: Node, loss: Loss, signame: str, where: str) -> ExitOutcome:
        """`n` was lost after the last commit: nothing to redo while every unwritten final
        layer has a live copy (`final_layers.FinalLayers` asks one to write it); else the
        finished generation is abandoned and a restore point covers those layers."""
        loss.phase = "after the last step"
        uncopied = self.final_layers.without_live_copy()
        if uncopied:
            listed = ", ".join(map(str, uncopied))
            self.ctx.say(f"node {n.name} ({where}) lost after the last step with the last live "
                         f"copy of layer(s) {listed}, before their final parameters were "
                         f"written: the next generation restores them")
            self.abandoned_after_last_step = self.ctx.plan.gen
            return self._abandon(f"node {n.name} lost after the last step with the last copy "
                                 f"of layer(s) {listed}", loss,
                                 why=f"node {n.name} was lost after the last step ({signame}) "
                                     f"with the last copy of layer(s) {listed}")
        loss.handled_as = HandledAs.FAILOVER
        loss.counts = dict(ZERO_COUNTS)
        self._write(loss)
        return ExitOutcome()

    def _in_flight(self, n: Node, loss: Loss, plan: FailoverPlan, phase: str, signame: str,
                   where: str) -> None:
        """Cover the loss of `n` inside the step under way: publish `plan`'s roles."""
        ctx, step = self.ctx, self.ctx.committed
        old_epoch, old_roles = ctx.roles.epoch, ctx.roles
        self.gens.publish_roles(plan.roles)
        self.steps.moot(step, old_epoch)
        shadow = plan.takeovers[0].new_holder if plan.takeovers else None
        if plan.roles.rerouted:
            served = [r for r in plan.roles.reroutes
                      if old_roles.holders[r.pipeline][r.stage] == n.rank]
            shadow = served[0].peers[0] if served else None
        loss.handled_as = HandledAs(plan.handled_as)
        loss.in_flight = True
        if loss.handled_as is HandledAs.PEER_RESTORE:
            self.restore_step = (ctx.plan.gen, step)
            self.restores += [t for t in plan.takeovers if t.kind == "peer_restore"]
        loss.shadow = self.gens.rank_name(shadow)
        ctx.events.write("fault_detected", node=n.name, step=step, phase=phase, signal=signame,
                         handled_as=plan.handled_as, shadow=loss.shadow, roles=ctx.roles.holders)
        ctx.say(f"node {n.name} ({where}) lost in step {step} during {phase}; "
                f"{plan.handled_as.replace('_', ' ')} by {loss.shadow}")
        self.steps.release_waiting_votes()

    def _failover_plan(self, n: Node, step: int) -> FailoverPlan:
        """The in-flight plan for losing `n` in `step`, or Unrecoverable."""
        ctx = self.ctx
        if self.restore_step != (ctx.plan.gen, step):  # ranks and steps of another generation
            self.restores = []
        if any(n.rank in (t.source, t.new_holder) for t in self.restores):
            raise Unrecoverable("a peer restore it took part in had not finished")
        if ctx.plan.redundancy.reroutes or ctx.roles.reroutes:
            # once a generation re-routes, its later losses are re-routed too: a shadow's
            # failover settles transfers along its own pipeline's row, which a re-routed
            # slot's peers do not share
            return plan_reroute(ctx.roles, n.rank)
        if not ctx.rc:
            raise Unrecoverable("--redundancy off keeps no in-flight copy of its stage")
        if ctx.roles.stages == 1:
            # no replica at one stage, and none needed: the lost pipeline's micro-batches go
            # to its peers, which keep what they finished of the step (the engine's re-route)
            return plan_reroute(ctx.roles, n.rank)
        if ctx.roles.pipelines == 1 or self._shadowed():
            # a re-route after a shadow's failover or a peer restore in one generation is
            # not supported: the restarted step would drop what they carried over
            return self._shadow_plan(n)
        shadow = reroute = None
        try:
            shadow = self._shadow_plan(n)
        except Unrecoverable:
            pass
        if shadow is not None and shadow.handled_as == "peer_restore":
            return shadow  # weighed against a re-route: not yet
        try:
            reroute = plan_reroute(ctx.roles, n.rank)
        except Unrecoverable:
            pass
        return shadow_or_reroute(shadow, reroute)

    def _shadowed(self) -> bool:
        """Whether a shadow or a peer restore took a slot in this generation."""
        roles = self.ctx.roles
        return any(roles.holders[d][s] != d * roles.stages + s and roles.route(d, s) is None
                   for d in range(roles.pipelines) for s in range(roles.stages))

    def _shadow_plan(self, n: Node) -> FailoverPlan:
        plan = plan_failover(self.ctx.roles, n.rank)
        receiving = {t.new_holder for t in self.restores}
        if any(t.kind == "peer_restore" and t.source in receiving for t in plan.takeovers):
            raise Unrecoverable("the surviving copy's holder is itself still receiving its state")
        return plan

    def abandon(self, reason: str, loss: Loss | None = None, why: str = "") -> Reconfiguration:
        """End the generation mid-step (a loss no in-flight copy covers, or a state transfer
        that failed): the new epoch marks it abandoned and the step's votes are answered."""
        ctx = self.ctx
        old_epoch = ctx.roles.epoch
        dead = {x.rank for x in self.nodes if x.state is NodeState.LOST and x.rank is not None}
        r = self.gens.abandon(reason, dead, lost=loss, why=why)
        self.steps.moot(ctx.committed, old_epoch)
        return r

    def _abandon(self, reason: str, loss: Loss, why: str) -> ExitOutcome:
        self.abandon(reason, loss, why)
        if self.ctx.cfg.redundancy.recovery == "checkpoint-restart":
            return ExitOutcome(restart=self.stop_all_workers())
        return ExitOutcome()

    def stop_all_workers(self) -> list[Node]:
        """Checkpoint-restart recovery (the baseline, as torchrun does it): stop every worker;
        the caller starts fresh ones in their place, which load the last checkpoint."""
        restarting = self.ctx.reconf.restarting or set()
        stopped = []
        for n in self.nodes:
            if n.exited or n.state not in (NodeState.STARTING, NodeState.READY,
                                           NodeState.DONE) or \
                    n.kill_at is not None or not n.process.is_alive() or n.node in restarting:
                continue  # gone or going: counted when it ends, never restarted
            self.nodes.retire(n)
            stopped.append(n)
        return stopped

    # -- accounting -------------------------------------------------------------------------

    def _write(self, loss: Loss) -> None:
        """The `node_lost` event of `loss` (once)."""
        if loss.written:
            return
        loss.written = True
        self.written_order.append(loss)
        fields: dict[str, object] = dict(node=loss.node, step=loss.step, phase=loss.phase,
                                         handled_as=str(loss.handled_as))
        node = self.nodes.by_name(loss.node)
        if node.host is not None:  # a node on another machine: which one (a Ray node's id too)
            fields["host"] = node.host
        fields.update(node.labels)
        if loss.handled_as is not HandledAs.DRAIN:
            fields.update(shadow=loss.shadow, signal=loss.signal)
        if loss.handled_as is not HandledAs.STOPPED:
            fields.update(pause_s=round(loss.pause_s, 4), **loss.counts)
        self.ctx.events.write("node_lost", **fields)

    def close(self, step: int, reports: list[StepReport], wall_s: float,
              records: list[dict]) -> None:
        """Step `step`'s records are in: write the losses that happened in it, and charge
        the first step of a generation a reconfiguration made to the losses it repaired."""
        here = [x for x in self.losses if x.step == step and not x.written
                and x.handled_as is not HandledAs.PENDING]
        plan = self.ctx.plan
        repaired: list[Loss] = []
        if plan is not None and plan.gen > 0 and step == plan.start_step:
            # this step's wall time holds the reconfiguration (a standby joining, layers
            # moved): its cost belongs to the losses it was planned after whose layout was
            # still short of its nodes; those it gives them back are closed
            self.reconfigured_steps.add(step)
            entered = self.gens.started - self.ctx.t0
            before = [x for x in self.losses if not x.repaired and x.handled_as not in
                      (HandledAs.PENDING, HandledAs.STOPPED) and (x.t <= entered or (
                          x.handled_as is HandledAs.DRAIN and x.step <= step))]
            repaired = [x for x in before if x.written and x not in here]
            for x in before:
                x.repaired = plan.active >= x.active_before
        if not here and not repaired:
            return
        totals = {k: sum(getattr(r, k) for r in reports) for k in ZERO_COUNTS}
        extra = max(0.0, wall_s - self._median_clean_step(records))
        share = extra / (len(here) + len(repaired))
        for x in here:
            x.counts = totals if x.in_flight else dict(ZERO_COUNTS)
            x.pause_s = share
            self._write(x)
        for x in repaired:
            x.reconfiguration_s += share
            self.ctx.events.write("loss_cost", node=x.node, step=x.step,
                                  handled_as=str(x.handled_as), at_step=step,
                                  added_s=round(share, 4), pause_s=round(x.cost_s, 4))

    def _median_clean_step(self, records: list[dict]) -> float:
        failed = {x.step for x in self.losses} | self.reconfigured_steps
        clean = [r["wall_s"] for r in records[1:] if r["step"] not in failed]
        return statistics.median(clean) if clean else 0.0

    def pauses(self) -> list[float]:
        """summary.json's `pause_s`: every second each lost node cost, one entry per
        `node_lost` event in the order they were written (a standby's: 0)."""
        order = self.written_order + [x for x in self.losses if not x.written]
        return [round(x.cost_s, 4) for x in order]

    def covered(self, lost: Iterable[Loss], how: HandledAs) -> None:
        """A new generation covers the losses `lost` of the reconfiguration before it (a
        peer or a checkpoint restore): those nothing in flight covered are handled as `how`."""
        for x in lost:
            if x.handled_as is HandledAs.PENDING:
                x.handled_as = how
                if x.step >= self.ctx.end_step:  # after the last step: no step of its own closes
                    self._write(x)

    def stopped(self) -> None:
        """The run stops: losses it could not survive are written as `stopped`; losses
        whose handling was known but whose step never completed are written as they are."""
        for x in self.losses:
            if x.handled_as is HandledAs.PENDING:
                x.handled_as = HandledAs.STOPPED
            self._write(x)
