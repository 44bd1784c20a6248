"""The coordinator's core: every decision of a run, driven through four calls.

    core = CoordinatorCore(cfg, run_path, display, source)
    core.start(store, events, clock)        # the parts, the trace, the first nodes and plan
    core.handle(node, message)              # a node's message, to the part that owns it
    core.node_exited(node)                  # its process ended (a loss, a drain, the end)
    core.tick(now)                          # leases, trace, joins, the next plan, stalls

The process loop (`loop.Coordinator`) drives it with a real TCPStore, the event log and
real processes; the decision tests (`tests/coordinator_sim.py`) drive it the same way with
a dict store, a list of events, a fake clock and scripted workers. The parts:

    nodes.Supervisor          processes, agents, leases and fencing
    steps.StepProtocol        go/decide votes, commits, step records
    failures.FailureHandler   a lost node -> failover, peer restore, abandon, restart
    generations.Generations   plans, boundary flags, reconfiguration
    restore.RestorePoints     checkpoint or initial state when no live copy exists
    preemptions.Preemptions   --kill, notices, trace replay
    checkpointing.CheckpointAssembly
    results.Results           step records, model, summary
    final_layers.FinalLayers  a final layer whose writer was lost: written from a copy
    display.RunView           layout panel, `role` events, notes on long waits
    kills.Kills               --kill and --crash faults, and which kills fired

The parts are given the parts they ask, never a callback: what one part's news asks of
another comes back here as a return value (a committed round, a completed evaluation, an
exit that changed roles or restarts every worker, the trace nodes to start, a plan from a
restore point), and the core hands it on. Each field of the shared `RunContext` has one
writer (the table in `state`).

Where nodes run is a `bamboo.protocol.launch.Launcher` (`supply.NodeSupply` asks it for
nodes; `bamboo.launch` has the local processes and the agents). A worker's
software error stops the run with that error (never failed over: a deterministic bug
would only cascade through the shadows). Decisions end the run by raising `Stop`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bamboo.config import JobConfig
from bamboo.control.checkpointing import CheckpointAssembly
from bamboo.control.display import RunView
from bamboo.control.failures import ExitOutcome, FailureHandler
from bamboo.control.final_layers import FinalLayers
from bamboo.control.generations import FixedMode, Generations, Modes
from bamboo.control.interval import CheckpointInterval
from bamboo.control.kills import Kills
from bamboo.control.nodes import Node, NodeState, Supervisor
from bamboo.control.orders import Orders
from bamboo.control.preemptions import Preemptions
from bamboo.control.restore import RestorePoints
from bamboo.control.results import Results
from bamboo.control.run_options import RunOptions
from bamboo.control.state import Events, RunContext, Stop, Store
from bamboo.control.steps import StepProtocol
from bamboo.control.supply import NodeSupply
from bamboo.data.sizing import SIZING
from bamboo.model import layer_param_counts
from bamboo.node.backend_errors import describe
from bamboo.plan.orders import Order, OrderKind
from bamboo.protocol.launch import Launcher
from bamboo.protocol.messages import (
    BoundaryFlag,
    CheckpointPart,
    Done,
    EvalDone,
    GenerationEnd,
    GenerationReady,
    LayerParams,
    Left,
    MicroBatchesDone,
    Notice,
    Ready,
    RoundDone,
    StepReport,
    WorkerError,
    WorkerMessage,
)
from bamboo.run.checkpoint import checkpoint_location

__all__ = ["CoordinatorCore"]

log = logging.getLogger(__name__)

_ROOT_CAUSE_GRACE_S = 2.0
"""A node that lost a peer waits this long for the peer's own exit to explain it."""


class CoordinatorCore:
    """One run's decisions; see the module docstring for the calls that drive it."""

    def __init__(self, cfg: JobConfig, run_path: Path, display: Any, launcher: Launcher,
                 options: RunOptions | None = None) -> None:
        options = options or RunOptions()
        self.cfg, self.run_path, self.display = cfg, run_path, display
        self.launcher = launcher
        """Where the run's nodes run (`bamboo.protocol.launch`)."""
        self.supply = NodeSupply(launcher)
        self.interface = options.interface
        """Where the run was started from (its messages' words)."""
        self.stepwise = options.stepwise
        """The user's loop drives the run through orders (`give`; `bamboo.Trainer`)."""
        self.extra_faults = dict(options.extra_faults)
        self.resume, self.debug = options.resume, options.debug
        self.peer_lost_message = ""
        self.peer_lost_at: float | None = None
        self.last_news = 0.0
        self.stall_s = cfg.runtime.step_stall_s

    # -- the API ----------------------------------------------------------------------------

    def start(self, store: Store, events: Events, clock: Callable[[], float], *,
              store_host: str | None = "127.0.0.1") -> None:
        """Build the parts around `store` and `events`, load the trace, bring the first
        nodes (`supply.initial`) and publish the first plan."""
        self.store, self.events, self.store_host = store, events, store_host
        self._build_parts(clock)
        self.preemptions.load_trace()
        self.supply.initial(self)
        self.gens.enter(self.gens.first_plan(self.modes))
        self.view.layout_changed()
        cfg, plan = self.cfg, self.ctx.plan
        self.ctx.say(f"started {cfg.layout.nodes} workers: {plan.pipelines} pipeline(s) x "
                     f"{plan.stages} stage(s), model {cfg.model.name}, redundancy "
                     f"{plan.redundancy if (plan.redundancy.keeps_replica and plan.stages > 1) or plan.redundancy.reroutes else 'off'}"
                     + (f", replaying {cfg.cluster.trace} at {cfg.cluster.replay_time_scale:g}x"
                        if self.preemptions.replay else "")
                     + (f"; resumed from step {self.resume.step} ({self.resume.path})"
                        if self.resume is not None else ""))
        self.last_news = clock()
        self.steps.timing_from(self.last_news)

    def handle(self, n: Node, msg: WorkerMessage) -> None:
        """A message from node `n`, to the part that owns it (Stop for one it does not know)."""
        self.last_news = self.ctx.clock()
        match msg:
            case MicroBatchesDone():
                self.steps.on_micro_batches_done(msg)
            case RoundDone():
                self._on_round_done(msg)
            case EvalDone():
                self._on_eval_done(msg)
            case StepReport():
                self.steps.on_step_report(n.node, msg)
                self._record_steps()
            case LayerParams():
                self.results.on_params(msg)
            case Ready():
                self._on_ready(n, msg)
            case GenerationReady():
                self._on_generation_ready(n, msg)
            case GenerationEnd():
                self._on_generation_end(n, msg)
            case CheckpointPart():
                self.checkpoints.on_part(msg)
            case Notice():
                if self.preemptions.on_notice(n, msg.source, self.gens.where(n)):
                    self.gens.ask_checkpoint()
            case Left():
                self.nodes.set_state(n, NodeState.LEFT)
                self.gens.not_ending(n.node)
            case Done():
                self.nodes.set_state(n, NodeState.DONE)
            case WorkerError():
                self._on_worker_error(n, msg)
            case _:
                raise Stop(f"node {n.name} sent a message this coordinator does not know "
                           f"({type(msg).__name__}): are the worker and the coordinator the "
                           f"same version of bamboo?")

    def node_exited(self, n: Node) -> None:
        """`n`'s process ended: a loss, a drain's end, or the run's end for that node."""
        out = self.failures.on_exit(n)
        self._after_exit(out)

    def tick(self, now: float) -> None:
        """What time alone decides: leases, waits worth a note, nodes that joined, the
        trace's next event, the next plan, and whether the run has stalled."""
        self.nodes.check_leases()
        self.view.note_waits()
        self.supply.poll(self)
        for trace_node in self.preemptions.tick():
            self.spawn(first_gen=self.ctx.plan.gen + 1, trace_node=trace_node)
        self.try_plan()
        if self.ctx.stepwise:
            self.orders.follow(self.steps.evaluated, self.checkpoints.last_step)
        self._check_stalls(now)

    def give(self, order: Order) -> int:
        """A step-by-step run's next order at the boundary it stands at (`orders.Orders`);
        the run's clocks restart, since the time the user's loop took is not the run's."""
        now = self.ctx.clock()
        self.last_news = now
        if order.kind is OrderKind.STEP:
            self.steps.timing_from(now)
        return self.orders.give(order)

    def finished(self) -> bool:
        """Every step committed and every active node done (or lost after its last step)."""
        ctx = self.ctx
        if ctx.committed < ctx.end_step or ctx.reconf is not None:
            return False
        active = [self.gens.member(r) for r in ctx.roles.active_ranks()]
        if not all(n.state in (NodeState.DONE, NodeState.LOST) for n in active):
            return False
        return not self.final_layers.pending()

    def final_summary(self) -> dict[str, Any]:
        """The completed run's summary (Stop when the trained model is incomplete)."""
        missing = self.results.missing_layers()
        if missing:
            raise Stop(f"the node writing layer {missing[0]}'s final parameters was lost after "
                       f"the last step, before it wrote them: the trained model is incomplete"
                       + (f"; the last checkpoint is in {checkpoint_location(self.cfg)}"
                          if self.checkpoints.last else ""), exit_code=3)
        return self.summary("completed", None)

    def fail(self, message: str) -> dict[str, Any]:
        """Stop every node and account for the run that ends with `message`: its summary."""
        self.nodes.stop_all()
        self._remove_unfinished_writes()
        self.failures.stopped()
        self.events.write("run_failed", error=message)
        return self.summary("failed", message)

    def _remove_unfinished_writes(self) -> None:
        """The stopped workers' interrupted checkpoint and final-layer writes leave no
        temporary behind (best effort: the run's own error is what the user must see)."""
        from bamboo.run.checkpoint import remove_unfinished_writes
        try:
            removed = remove_unfinished_writes(checkpoint_location(self.cfg))
        except Exception as e:  # noqa: BLE001 - a storage that fails now is reported
            self.events.write("cleanup_failed", error=f"{type(e).__name__}: {e}"[:300])
            return
        if removed:
            self.events.write("unfinished_writes_removed", names=sorted(removed))

    def summary(self, status: str, error: str | None) -> dict[str, Any]:
        out = self.results.summary(
            status=status, error=error, losses=self.failures.losses,
            standby_losses=self.failures.standby_losses,
            reconfigurations=self.gens.reconfigurations, redone_steps=self.restore.redone_steps,
            reconf_times=self.gens.times, pauses=self.failures.pauses())
        interval = self.gens.interval  # the interval in force at the end (null: none chosen yet)
        out["config"] |= {"checkpoint_every": interval.every,
                          "checkpoint_every_by": "run" if interval.auto else "user"}
        return out

    @property
    def committed(self) -> int:
        return self.ctx.committed

    def spawn(self, *, first_gen: int, trace_node: int | None = None,
              owns_trace_node: bool = True) -> Node:
        """One more node from the launcher, announced with its role (a `node_up` event)."""
        n = self.supply.start_node(self, first_gen)
        self.nodes.plays(n, trace_node)
        replay = self.preemptions.replay
        if trace_node is not None and owns_trace_node:
            self.preemptions.played_by(trace_node, n.node)
        role = self.gens.initial_role(n.node) if first_gen == 0 else (None, None)
        self.events.write("node_up", node=n.name, pid=n.process.pid, pipeline=role[0],
                          stage=role[1], trace_node=replay.name(trace_node)
                          if trace_node is not None and replay else None)
        return n

    def try_plan(self) -> None:
        """Publish the next generation's plan when a reconfiguration can have one; a plan
        from a restore point takes the step protocol and the checkpoints back to it."""
        none_coming = self.preemptions.trace_finished() and self.supply.none_coming(self) \
            and not self.nodes.coming()
        committed = self.ctx.committed
        new = self.gens.try_plan(self.modes, trace_finished=none_coming)
        if new is None:
            return
        self.failures.covered(new.lost, new.covered_as)
        plan = new.plan
        if plan.start_step < committed:  # restored: the steps after its start are redone
            self.steps.rewind(plan.start_step)
            self.checkpoints.forget_after(plan.start_step)
        self.steps.new_generation()
        self.view.layout_changed()

    # -- building ---------------------------------------------------------------------------

    def _context(self, clock: Callable[[], float]) -> RunContext:
        cfg, resume = self.cfg, self.resume
        start = resume.step if resume is not None else 0
        counts = layer_param_counts(cfg.model_preset(SIZING))
        return RunContext(
            cfg=cfg, store=self.store, events=self.events, display=self.display,
            run_path=self.run_path, param_counts=counts,
            partition_costs=cfg.partition_costs(counts), clock=clock,
            t0=clock(), committed=start,
            losses=list(resume.meta.get("losses", []))[:start] if resume else [],
            eval_losses=[e for e in resume.meta.get("eval_losses", []) if e[0] <= start]
            if resume else [],
            metrics=list(resume.meta.get("metrics", []))[:start] if resume else [],
            eval_metrics=[e for e in resume.meta.get("eval_metrics", []) if e[0] <= start]
            if resume else [],
            resume_step=resume.step if resume else None,
            resume_path=resume.path if resume else None,
            stepwise=self.stepwise, end_step=cfg.training.steps, interface=self.interface,
            skipped_steps=[k for k in resume.meta.get("skipped_steps", []) if k < start]
            if resume else [],
            start_loss_scale=resume.meta.get("loss_scale") if resume else None,
            lr_scales=[e for e in resume.meta.get("lr_scales", []) if e[0] <= start]
            if resume else [])

    def _build_parts(self, clock: Callable[[], float]) -> None:
        """The parts, each given the parts it asks (never a callback): what one part does
        that another must follow comes back to the core as a return value."""
        cfg = self.cfg
        ctx = self.ctx = self._context(clock)
        self.kills = Kills(ctx, self.extra_faults)
        self.nodes = Supervisor(ctx, 2 * max(cfg.layout.nodes, cfg.node_cap) + 4, self.kills,
                                self.store_host, self.launcher)
        self.preemptions = Preemptions(ctx, self.nodes, self.kills)
        self.steps = StepProtocol(ctx, self.nodes, check_replicas=cfg.redundancy.check_replicas)
        interval = CheckpointInterval(ctx)
        self.checkpoints = CheckpointAssembly(ctx, interval)
        self.restore = RestorePoints(ctx, interval)
        self.gens = Generations(ctx, self.nodes, self.restore, self.kills, interval)
        self.results = Results(ctx, self.display)
        self.final_layers = FinalLayers(ctx, self.nodes, self.results)
        self.failures = FailureHandler(ctx, self.nodes, self.steps, self.gens, self.kills,
                                       self.final_layers)
        self.orders = Orders(ctx)
        self.view = RunView(ctx, self.nodes, self.gens, self.display)
        self.auto: Any = None
        self.modes: Modes = FixedMode(cfg.redundancy.kind)
        if cfg.redundancy.kind.chosen_per_generation:
            from bamboo.control.redundancy_mode import AutoRedundancy
            self.auto = self.modes = AutoRedundancy(ctx, self.nodes, self.results,
                                                    self.failures, self.gens)

    # -- messages ---------------------------------------------------------------------------

    def _on_round_done(self, msg: RoundDone) -> None:
        """A commit vote; when it completes the round: the boundary's flags, the commit,
        the records it completes, and what the boundary starts."""
        step = self.steps.on_round_done(msg)
        if step is None:
            return
        flags = self.gens.boundary_flags(step, self.modes)
        self.steps.commit(step, msg.epoch, flags)
        self.orders.committed(msg.epoch)
        self._record_steps()
        if self.auto is not None:
            self.auto.step_ran(step)
        if BoundaryFlag.RECONFIGURE in flags:
            self.gens.reconfigure_after(step)
        else:
            self.preemptions.step_begins(step + 1)

    def _on_eval_done(self, msg: EvalDone) -> None:
        done = self.steps.on_eval_done(msg)
        if done is None:
            return
        step, loss, metrics = done
        self.results.record_eval(step, loss, metrics)
        if step >= self.ctx.end_step:  # no step record follows: close the last pass
            self.failures.close(step, [], 0.0, self.results.records)

    def _on_ready(self, n: Node, msg: Ready) -> None:
        if msg.cpus:
            self.events.write("pinned", node=n.name, cpus=list(msg.cpus))
        self.nodes.ready(n, msg.own_processor)
        if n.rank is None:
            self.events.write("standby", node=n.name)

    def _on_generation_ready(self, n: Node, msg: GenerationReady) -> None:
        if not self.gens.on_ready(n, msg):
            return
        if self.preemptions.generation_runs():  # the first: the trace and step clocks start
            self.steps.timing_from(self.preemptions.trace_t0)
        step = self.gens.take_step_begins()
        if step is not None:
            self.preemptions.step_begins(step)

    def _on_generation_end(self, n: Node, msg: GenerationEnd) -> None:
        if n.state is NodeState.DONE:  # its finished generation was abandoned: it goes on
            self.nodes.set_state(n, NodeState.READY)
        failed = self.gens.transfer_failure(n, msg)
        if failed is not None:  # a transfer failed: the generation cannot start
            self.failures.abandon(failed)
        self.gens.on_end(n, msg)

    def _on_worker_error(self, n: Node, msg: WorkerError) -> None:
        self.events.write("worker_error", node=n.name, step=msg.step, error=msg.error,
                          peer_lost=msg.peer_lost, traceback=msg.traceback)
        if not msg.peer_lost:
            if self.debug:
                log.error("%s", msg.traceback.rstrip("\n"))
            raise Stop(f"worker {n.name} ({self.gens.where(n)}) failed in step {msg.step}: "
                       f"{describe(msg.error)}")
        # The lost peer's own exit normally arrives within moments and explains this.
        self.peer_lost_message = self.peer_lost_message or (
            f"node {n.name} lost its connection to a peer in step {msg.step} and no node "
            f"was reported lost (the backend's error is in events.jsonl: worker_error)")
        self.peer_lost_at = self.peer_lost_at or self.ctx.clock()

    # -- what one part's news asks of the others -------------------------------------------

    def _after_exit(self, out: ExitOutcome) -> None:
        """An exit changed roles in flight (the layout is news; step records may be
        complete), or stopped every worker for a checkpoint-restart (fresh ones replace
        them, each playing its old trace node)."""
        if out.roles_changed:
            self.view.layout_changed()
            self._record_steps()
        if out.restart is not None:
            owner = self.preemptions.trace_owner
            fresh = [self.spawn(first_gen=self.ctx.plan.gen + 1, trace_node=old.trace_node,
                                owns_trace_node=old.trace_node is not None
                                and owner.get(old.trace_node) == old.node).node
                     for old in out.restart]
            self.gens.restarting(fresh)

    def _record_steps(self) -> None:
        """Each committed step whose reports are all in: its record, the losses it closes,
        its replicas' check."""
        for p, reports in self.steps.completed():
            node_of = {id(r): self.nodes[node] for node, r in p.reports.items()}
            nodes = [node_of[id(r)] for r in reports]
            record = self.results.record(p, reports, [n.name for n in nodes],
                                         [n.own_processor for n in nodes])
            self.failures.close(p.step, reports, record["wall_s"], self.results.records)
            self.steps.check_digests(reports, p.step)

    def _check_stalls(self, now: float) -> None:
        if self.peer_lost_at is not None and now - self.peer_lost_at > _ROOT_CAUSE_GRACE_S:
            raise Stop(self.peer_lost_message)
        if self.steps.stalled_round():
            raise Stop("a node reported a failed commit round but no node was lost; stopped "
                       "the run (see events.jsonl)")
        if now - self.last_news > self.stall_s:
            r = self.ctx.reconf
            if r is not None and not any(n.is_alive for n in self.nodes):
                raise Stop(f"{r.why or 'every node was lost'}; no live node for "
                           f"{now - r.started:.0f} s, waiting for {self.supply.awaited(self)}: "
                           f"stopped the run" + (f" (the last checkpoint is in "
                                                 f"{checkpoint_location(self.cfg)})"
                                                 if self.checkpoints.last else ""))
            raise Stop(f"no worker reported progress for {self.stall_s:.0f} s; stopped the run "
                       f"(raise --comm-timeout if steps are that slow)")
