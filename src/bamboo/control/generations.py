"""Generations: which plan is current, when it ends, and what the next one is.

The coordinator publishes a generation's plan (`gen/<g>`) and its first role map, waits
until every active member reports `GenerationReady`, and ends the generation either at
a step boundary (the `reconf` flag: a drain, standbys that fit a bigger layout, or a
stage left with one copy) or mid-step (`abandon`: a loss no in-flight copy covers).
Once every live member has sent `GenerationEnd`, the next plan is made from the state
the live nodes hold (`bamboo.plan.planner`), or, when some layer has no live copy,
from a restore point (`restore.RestorePoints`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from bamboo.config.modes import RedundancyMode
from bamboo.control.interval import CheckpointInterval
from bamboo.control.kills import Kills
from bamboo.control.nodes import Node, NodeState, Supervisor
from bamboo.control.restore import RestorePoints
from bamboo.control.state import HandledAs, Loss, Reconfiguration, RunContext, Stop
from bamboo.engine.optim import bytes_per_parameter
from bamboo.node.backend_errors import peer_rank
from bamboo.plan.orders import scale_at
from bamboo.plan.partition import partition
from bamboo.plan.placement import spread
from bamboo.plan.planner import GenerationPlan, NoLiveCopy, choose_layout, plan_generation
from bamboo.plan.roles import RoleMap
from bamboo.protocol.messages import (
    BoundaryFlag,
    GenerationEnd,
    GenerationReady,
    epoch_key,
    plan_key,
)
from bamboo.run.progress import pipeline_rows

__all__ = ["Generations", "Modes", "FixedMode", "NextGeneration"]


class Modes(Protocol):
    """The redundancy mode of each generation: `FixedMode`, or with `--redundancy auto`
    the run's measured choice (`redundancy_mode.AutoRedundancy`)."""

    def choose(self, gen: int) -> RedundancyMode:
        """The mode of generation `gen`; with `gen` < 0, the mode a new one would get now."""


class FixedMode:
    """The job's `--redundancy`, the same for every generation."""

    def __init__(self, mode: RedundancyMode) -> None:
        self.mode = mode

    def choose(self, gen: int) -> RedundancyMode:
        return self.mode


@dataclass(frozen=True, slots=True)
class NextGeneration:
    """A generation `Generations.try_plan` published: its `plan`, and the losses of the
    reconfiguration before it (`lost`), covered as `covered_as` (a peer or a checkpoint
    restore) where nothing in flight covered them."""

    plan: GenerationPlan
    lost: tuple[Loss, ...]
    covered_as: HandledAs


class Generations:
    """The one writer of the run's plan and role map (`plan`, `roles`; `rc` derives from the
    plan) and of the reconfiguration under way (`reconf`, and every field of it)."""

    def __init__(self, ctx: RunContext, nodes: Supervisor, restore: RestorePoints,
                 kills: Kills, interval: CheckpointInterval) -> None:
        self.ctx, self.nodes, self.restore, self.kills = ctx, nodes, restore, kills
        self.interval = interval
        """Which boundaries write a checkpoint."""
        self.ready: set[int] = set()
        self.started = ctx.clock()
        self.reconfigurations = 0
        self.times: list[dict] = []
        self.step_begins_pending: int | None = ctx.committed
        """The step whose start waits for the next generation to run."""
        self.checkpoint_due = False
        """A notice asked for a checkpoint at the next boundary."""
        self.next_reason = ""
        self.first_members: list[str] | None = None
        """Generation 0's members in rank order, once its plan is made."""
        self.layer_bytes: dict[int, int] = {}
        """Each layer's packed state bytes, as the nodes that ended a generation said."""

    # -- who is who -------------------------------------------------------------------------

    def member(self, rank: int) -> Node:
        return self.nodes.by_name(self.ctx.plan.members[rank])

    def rank_name(self, rank: int | None) -> str | None:
        return None if rank is None else self.ctx.plan.members[rank]

    def live_members(self) -> list[Node]:
        members = [self.member(r) for r in range(len(self.ctx.plan.members))]
        return [n for n in members if not n.is_gone]

    def active_members(self) -> set[int]:
        return {n.node for n in self.live_members()
                if n.rank is not None and n.rank < self.ctx.plan.active}

    def running(self) -> bool:
        """Every live active member has its state and trains."""
        return self.ready >= self.active_members()

    def where(self, n: Node) -> str:
        """`pipeline D, stage S` (or `standby`), for messages."""
        roles = self.ctx.roles
        if n.rank is None or n.rank >= self.ctx.plan.active:
            return "standby"
        d, stages = roles.pipeline_of(n.rank), roles.stages_of(n.rank)
        if d is None or not stages:
            return "standby"
        return f"pipeline {d}, stage{'s' if len(stages) > 1 else ''} " + \
            " and ".join(map(str, stages))

    def machine_of(self, name: str) -> str | None:
        """The machine of node `name` (None: a local worker, a machine of its own)."""
        return self.nodes.by_name(name).machine

    def initial_role(self, node: int) -> tuple[int | None, int | None]:
        d, p = self.ctx.cfg.data_parallel, self.ctx.cfg.layout.stages
        if self.first_members is not None:  # placed (across machines): the first plan says
            name = f"n{node}"
            k = self.first_members.index(name) if name in self.first_members else None
            return (k // p, k % p) if k is not None else (None, None)
        return (node // p, node % p) if node < d * p else (None, None)

    # -- entering a generation --------------------------------------------------------------

    def first_plan(self, modes: Modes) -> GenerationPlan:
        ctx = self.ctx
        d, p = ctx.cfg.data_parallel, ctx.cfg.layout.stages
        parts = partition(ctx.partition_costs, p)
        resumed = ctx.resume_path is not None
        members = self.first_members = spread([f"n{i}" for i in range(d * p)],
                                              self.machine_of, p)
        return GenerationPlan(gen=0, epoch=0, members=members,
                              redundancy=modes.choose(0), pipelines=d, stages=p, parts=[[r.start, r.stop] for r in parts],
                              start_step=ctx.committed,
                              checkpoint=str(ctx.resume_path) if resumed else None,
                              reason="resume" if resumed else "start")

    def enter(self, planned: GenerationPlan) -> GenerationPlan:
        """Make `planned`, completed with the run's state at its start (the kills carried
        out, the step-by-step loop's learning-rate scale, the fp16 loss scale), the current
        generation and publish it (its layout is news for the run's view:
        `display.RunView.layout_changed`); the plan published."""
        ctx = self.ctx
        fp16 = ctx.cfg.model.precision == "fp16"
        plan = replace(planned, fired_kills=self.kills.fired_kills(), stepwise=ctx.stepwise,
                       lr_scale=scale_at(ctx.lr_scales, planned.start_step),
                       loss_scale=ctx.loss_scale_at(planned.start_step).to_json() if fp16
                       else planned.loss_scale)
        ctx.plan = plan
        ctx.roles = plan.roles()
        for n in self.nodes:
            n.rank = None
        for rank, name in enumerate(plan.members):
            self.nodes.by_name(name).rank = rank
        self.ready = set()
        self.started = ctx.clock()
        ctx.store.set(epoch_key(plan.epoch), ctx.roles.to_json())
        ctx.store.set(plan_key(plan.gen), plan.to_json())
        return plan

    def on_ready(self, n: Node, msg: GenerationReady) -> bool:
        """True when this made the generation run."""
        if msg.gen != self.ctx.plan.gen or self.ctx.reconf is not None:
            return False
        self.ready.add(n.node)
        if msg.state_bytes:
            self.ctx.events.write("state_loaded", gen=msg.gen, node=n.name, source=msg.state_from,
                                  bytes=msg.state_bytes, seconds=msg.state_s,
                                  mb_per_s=round(msg.state_bytes / 1e6 / max(msg.state_s, 1e-9), 2))
        if not self.running():
            return False
        took = self.ctx.clock() - self.started
        self.ctx.events.write("generation_ready", gen=self.ctx.plan.gen, took_s=round(took, 4),
                              parts=self.ctx.plan.parts)
        if self.times and self.times[-1]["gen"] == self.ctx.plan.gen:
            self.times[-1]["setup_s"] = took
            self.times[-1]["total_s"] = self.ctx.clock() - self.times[-1]["t"]
        return True

    # -- ending one -------------------------------------------------------------------------

    def boundary_flags(self, step: int, modes: Modes) -> frozenset[BoundaryFlag]:
        """What the boundary after committed `step` does."""
        cfg, flags = self.ctx.cfg, set()
        nxt = step + 1
        due = self.interval.due(nxt)
        if nxt >= cfg.training.steps:  # the finished run is a resume point
            return frozenset({BoundaryFlag.CHECKPOINT} if due else ())
        if due or (self.checkpoint_due and self.interval.enabled):
            flags.add(BoundaryFlag.CHECKPOINT)
            self.checkpoint_due = False
        reason = self.reconfiguration_reason(modes)
        if reason:
            self.next_reason = reason
            flags.add(BoundaryFlag.RECONFIGURE)
        return frozenset(flags)

    def reconfiguration_reason(self, modes: Modes) -> str | None:
        """Why the generation should end at this boundary, if it should."""
        ctx = self.ctx
        live_active = set(ctx.roles.active_ranks())
        active = [n for n in self.live_members() if n.rank is not None
                  and n.rank < ctx.plan.active and n.rank in live_active]
        draining = [n for n in active if n.state is NodeState.NOTICED]
        if draining:
            return "drain " + ", ".join(n.name for n in draining)
        standbys = self.nodes.standbys()
        d, p = self.layout_for(len(active) + len(standbys))
        if d * p > len(active):
            return f"{len(standbys)} standby node(s) join: {d} x {p} layout"
        if standbys and len(active) < ctx.plan.pipelines * ctx.plan.stages:
            mode = modes.choose(-1)  # what the next generation would run
            kept = self.layout_with_holes(len(active) + len(standbys), len(standbys), mode)
            if kept is not None:
                return (f"{len(standbys)} standby node(s) fill a hole of the {kept[0]} x "
                        f"{kept[1]} layout")
        if ctx.plan.stages == 1 and ctx.roles.reroutes and not ctx.plan.redundancy.reroutes:
            # a loss's step re-routed in flight; the survivors' own layout steps faster
            return f"a slot re-routed at one stage: a {d} x 1 layout"
        exposed = self.exposed_stages() if ctx.rc else []
        if exposed and p > 1 and d * p >= len(active):
            return (f"stage{'s' if len(exposed) > 1 else ''} {', '.join(map(str, exposed))} "
                    f"left with one copy: rebalance onto a {d} x {p} layout")
        if not isinstance(modes, FixedMode):
            mode = modes.choose(-1)
            if mode != ctx.plan.redundancy:
                return f"redundancy {ctx.plan.redundancy} -> {mode}"
        return None

    def exposed_stages(self) -> list[int]:
        """Stages whose only live copy is one node (a second loss would need a checkpoint).

        This is the risk trigger: with one pipeline, a failover leaves the shadow's two
        stages without replicas, so the planner spreads the layers over the survivors and
        every stage has a replica again. With more pipelines, the peers' copies cover it."""
        roles = self.ctx.roles
        gone = {n.rank for n in self.nodes if n.state is NodeState.LOST and n.rank is not None}
        exposed = []
        for s in range(roles.stages):
            copies = {roles.holders[d][s] for d in range(roles.pipelines)} | \
                {roles.replicas[d][s] for d in range(roles.pipelines)}
            if len(copies - gone - {None}) <= 1:
                exposed.append(s)
        return exposed

    def layout_with_holes(self, nodes: int, joining: int,
                          mode: RedundancyMode) -> tuple[int, int] | None:
        """The current D x P, kept with holes, when `nodes` (`joining` of them standbys)
        cannot fill it but are more than a whole layout takes: each standby fills a slot a
        loss emptied (a re-routed or shadowed one), and the slots still empty are served by
        their stage's holders in the other pipelines, as a re-route does. None where the
        whole layout is the plan: no standby joins, one pipeline, fewer nodes than stages,
        or a mode without in-flight cover (off)."""
        plan = self.ctx.plan
        d, p = plan.pipelines, plan.stages
        if joining <= 0 or d < 2 or not (mode.keeps_replica or mode.reroutes):
            return None
        whole_d, whole_p = self.layout_for(nodes)
        if not (whole_d * whole_p < nodes < d * p) or nodes < p:
            return None
        return d, p

    def layout_for(self, nodes: int) -> tuple[int, int]:
        cfg = self.ctx.cfg
        return choose_layout(nodes, stages=cfg.layout.stages, layers=len(self.ctx.param_counts),
                             global_micro_batches=cfg.global_micro_batches,
                             max_pipelines=cfg.layout.pipelines)

    def begin(self, reason: str, *, abandoned: bool) -> Reconfiguration:
        ctx = self.ctx
        ending = self.active_members()  # leaving sources send `left`, not `gen_end`
        if ctx.reconf is not None:  # a loss while one is already under way
            ctx.reconf.ending &= ending
            ctx.reconf.abandoned |= abandoned
            return ctx.reconf
        ctx.reconf = Reconfiguration(reason=reason, started=ctx.clock(), ending=ending,
                                     abandoned=abandoned)
        ctx.events.write("reconfiguration_start", reason=reason, step=ctx.committed,
                         abandoned=abandoned, gen=ctx.plan.gen)
        ctx.say(f"reconfiguring at step {ctx.committed}: {reason}")
        return ctx.reconf

    def reconfigure_after(self, step: int) -> None:
        """Step `step` committed with the `reconf` flag: the generation ends at this boundary,
        and step `step + 1` begins once the next one runs (`take_step_begins`)."""
        self.begin(self.next_reason, abandoned=False)
        self.step_begins_pending = step + 1

    def take_step_begins(self) -> int | None:
        """The step that waited for a generation to run, once (None: none waits)."""
        step, self.step_begins_pending = self.step_begins_pending, None
        return step

    def ask_checkpoint(self) -> None:
        """A notice or the user's stop: a checkpoint at the next boundary (when enabled)."""
        if self.interval.enabled:
            self.checkpoint_due = True

    def publish_roles(self, roles: RoleMap) -> None:
        """An in-flight role change (a failover, a peer restore, a re-route) of the current
        generation: the new role map, which every survivor applies to the step under way."""
        self.ctx.roles = roles
        self.ctx.store.set(epoch_key(roles.epoch), roles.to_json())

    def abandon(self, reason: str, dead: set[int], lost: Loss | None = None,
                why: str = "") -> Reconfiguration:
        """End the generation mid-step: publish a role map marked `abandon` (every survivor
        drops the step under way) and begin the reconfiguration. `dead`: ranks known lost;
        `lost`: a loss the next generation accounts for; `why`: why no in-flight copy
        covered it."""
        ctx = self.ctx
        new = RoleMap.from_json(ctx.roles.to_json())
        new.epoch += 1
        new.takeovers = []
        new.abandon = True
        new.dead = sorted(set(new.dead) | dead)
        ctx.roles = new
        ctx.store.set(epoch_key(new.epoch), new.to_json())
        r = self.begin(reason, abandoned=True)
        if lost is not None:
            r.lost.append(lost)
        if why and not r.why:
            r.why = why
        return r

    def restarting(self, fresh: list[int]) -> None:
        """Checkpoint-restart: the next generation waits for the `fresh` workers started in
        place of every old one, and for nothing the old ones held."""
        r = self.ctx.reconf
        if r.restarting is None:
            r.restarting = set()
        r.restarting.update(fresh)
        r.ending.clear()
        r.holdings.clear()
        self.ctx.events.write("restart_all", step=self.ctx.committed, workers=len(r.restarting))

    def not_ending(self, node: int) -> None:
        """Node `node` left or exited: the reconfiguration under way waits for it no more."""
        if self.ctx.reconf is not None:
            self.ctx.reconf.ending.discard(node)

    def transfer_failure(self, n: Node, msg: GenerationEnd) -> str | None:
        """A `GenerationEnd` of the current generation while it forms (no reconfiguration
        under way) says a state transfer failed: the reason to abandon it, for the caller."""
        ctx = self.ctx
        if msg.gen != ctx.plan.gen or ctx.reconf is not None:
            return None
        ctx.events.write("transfer_failed", node=n.name, gen=msg.gen, error=msg.failed)
        return self._transfer_failure(n, msg.failed or "")

    def on_end(self, n: Node, msg: GenerationEnd) -> None:
        """`n` ended the generation holding `msg.layers` (after `transfer_failure`)."""
        ctx = self.ctx
        if msg.gen != ctx.plan.gen:
            return
        if msg.step == ctx.committed:  # else held at another step: not usable
            ctx.reconf.holdings[n.node] = set(msg.layers)
        self.layer_bytes.update(zip(msg.layers, msg.layer_bytes, strict=False))
        ctx.reconf.ending.discard(n.node)

    def _transfer_failure(self, n: Node, raw: str) -> str:
        """A failed state transfer in the project's words (which nodes, what follows); the
        backend's own text stays in the `transfer_failed` event."""
        members = self.ctx.plan.members
        rank = peer_rank(raw)
        peer = members[rank] if rank is not None and rank < len(members) else None
        between = f"between {n.name} and {peer}" if peer else f"of {n.name}"
        return (f"the state transfer {between} broke off (a node lost or unreachable while "
                f"generation {self.ctx.plan.gen} formed); the next plan goes without it")

    def _resume_hint(self) -> str:
        """`; its checkpoints are in ...: run the same command with --resume auto to go on
        from the newest` (in the words of the run's interface) where the run has a whole
        checkpoint to go on from once nodes are back."""
        from bamboo.run.checkpoint import checkpoint_location, has_whole_checkpoint
        where = checkpoint_location(self.ctx.cfg)
        if not has_whole_checkpoint(where):
            return ""
        how = self.ctx.interface.rerun(self.ctx.cfg.logging.out)
        return f"; its checkpoints are in {where}: {how} to go on from the newest"

    # -- the next one -----------------------------------------------------------------------

    def try_plan(self, modes: Modes, *, trace_finished: bool) -> NextGeneration | None:
        """Publish the next generation once every live member of the old one has ended it;
        with it, the losses it accounts for and how it covers them (the failure handler,
        their one writer, notes that)."""
        ctx, r = self.ctx, self.ctx.reconf
        if r is None or r.ending:
            return None
        if r.restarting is not None and not all(self.nodes[n].state is not NodeState.STARTING
                                                or self.nodes[n].exited for n in r.restarting):
            return None  # checkpoint-restart: wait for the fresh workers
        old = [self.member(i) for i in range(len(ctx.plan.members))]
        staying = [n for n in old if n.can_stay and n.rank is not None
                   and n.rank < ctx.plan.active]
        names = [n.name for n in staying] + [n.name for n in self.nodes.standbys()]
        leaving = [n.name for n in old if not n.exited and
                   (n.state is NodeState.NOTICED or n.kill_at is not None)]
        holdings = {self.nodes[k].name: layers for k, layers in r.holdings.items()
                    if self.nodes[k].state is not NodeState.LOST}
        if not names:
            if trace_finished:
                raise Stop(f"{r.why or 'the last nodes were lost'}; no live node is left to "
                           f"train on and none is coming" + self._resume_hint(), exit_code=3)
            return None  # wait for the trace to add nodes
        kwargs = dict(gen=ctx.plan.gen + 1, epoch=ctx.roles.epoch + 1, nodes=names,
                      holdings=holdings, leaving=leaving, stages=ctx.cfg.layout.stages,
                      param_counts=ctx.param_counts, partition_costs=ctx.partition_costs,
                      global_micro_batches=ctx.cfg.global_micro_batches,
                      max_pipelines=ctx.cfg.layout.pipelines, reason=r.reason,
                      machine_of=self.machine_of)
        mode = modes.choose(ctx.plan.gen + 1)
        kwargs["redundancy"] = mode
        kwargs["keep_layout"] = self.layout_with_holes(len(names), len(names) - len(staying),
                                                       mode)
        handled = HandledAs.PEER_RESTORE
        try:
            plan = plan_generation(start_step=ctx.committed, **kwargs)
        except NoLiveCopy as e:
            plan = self.restore.plan(kwargs, str(e))
            handled = HandledAs.CHECKPOINT_RESTORE
        self.reconfigurations += 1
        decided = ctx.clock()
        ctx.reconf = None
        plan = self.enter(plan)
        moved = self._bytes_moved(plan)
        self.times.append({"gen": plan.gen, "t": r.started, "decision_s": decided - r.started,
                           "bytes": moved, "from_nodes": len(old), "to_nodes": plan.active})
        ctx.events.write("reconfigured", gen=plan.gen, reason=r.reason, step=plan.start_step,
                         pipelines=plan.pipelines, stages=plan.stages, members=plan.members,
                         leavers=plan.leavers, transfers=len(plan.transfers), bytes=moved,
                         checkpoint=plan.checkpoint, parts=plan.parts,
                         redundancy=plan.redundancy)
        ctx.say(f"generation {plan.gen}: {plan.pipelines} pipeline(s) x {plan.stages} stage(s) "
                f"on {plan.active} node(s) from step {plan.start_step}"
                + (f", {len(plan.transfers)} layer state(s) moved" if plan.transfers else "")
                + (f", restored from {Path(plan.checkpoint).name}" if plan.checkpoint else "")
                + (", restarted from the initial state" if plan.fresh_start else ""))
        return NextGeneration(plan=plan, lost=tuple(r.lost), covered_as=handled)

    def _bytes_moved(self, plan: GenerationPlan) -> int:
        """The bytes `plan`'s state transfers move: each layer's packed state as its holders
        reported it; a layer none reported, by an estimate that builds an optimizer (whose
        first build here imports torch's compiler stack, 0.5-1.5 s of this process: so it
        is asked for only then, after the plan is published)."""
        moved = [layer for layer, _, _ in plan.transfers]
        unknown = sum(self.ctx.param_counts[layer] for layer in moved
                      if layer not in self.layer_bytes)
        known = sum(self.layer_bytes[layer] for layer in moved if layer in self.layer_bytes)
        if not unknown:
            return known
        training = self.ctx.cfg.training
        return known + round(unknown * bytes_per_parameter(training.optimizer, training.lr))

    def rows(self) -> list:
        roles = self.ctx.roles
        return pipeline_rows(roles.holders, self.ctx.plan.members, roles.dead,
                             {(r.pipeline, r.stage): r.peers for r in roles.reroutes})
