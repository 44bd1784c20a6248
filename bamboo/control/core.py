"""The coordinator's core: every decision of a run, driven through three calls.

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
    checkpoints.CheckpointAssembly
    results.Results           step records, model, summary
    final_layers.FinalLayers  a final layer whose writer was lost: written from a copy
    display.RunView           layout panel, `role` events, notes on long waits

Where nodes come from is a `NodeSource` (`sources.LocalWorkers`, `sources.Agents`). A
worker's software error stops the run with that error (never failed over: a deterministic
bug would only cascade through the shadows). Decisions end the run by raising `Stop`.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from bamboo.run.checkpoint import Checkpoint, checkpoint_location
from bamboo.node.backend_errors import describe
from bamboo.control.checkpointing import CheckpointAssembly
from bamboo.control.interval import CheckpointInterval
from bamboo.control.display import RunView
from bamboo.control.failures import FailureHandler
from bamboo.control.final_layers import FinalLayers
from bamboo.control.generations import Generations
from bamboo.control.nodes import Node, NodeState, Supervisor
from bamboo.control.preemptions import Preemptions
from bamboo.control.restore import RestorePoints
from bamboo.control.results import Results
from bamboo.control.state import Events, RunContext, Stop, Store
from bamboo.control.steps import PendingStep, StepProtocol
from bamboo.wire.protocol import (BoundaryFlag, CheckpointPart, Done, EvalDone, GenerationEnd,
                                     GenerationReady, LayerParams, Left, MicroBatchesDone,
                                     Notice, Ready, RoundDone, StepReport, WorkerError,
                                     WorkerMessage)
from bamboo.config import JobConfig
from bamboo.plan.faults import Fault
from bamboo.model import layer_param_counts

__all__ = ["CoordinatorCore", "NodeSource"]

_ROOT_CAUSE_GRACE_S = 2.0
"""A node that lost a peer waits this long for the peer's own exit to explain it."""


class NodeSource(Protocol):
    """Where a run's nodes come from (local worker processes, agents, scripted workers)."""

    def initial(self, core: CoordinatorCore) -> None:
        """Bring the run's first `--nodes` nodes (`core.spawn` or `core.nodes.admit`); Stop
        when they do not come."""

    def start_node(self, core: CoordinatorCore, first_gen: int) -> Node:
        """One more node now (a trace's add, a checkpoint-restart's fresh worker)."""

    def poll(self, core: CoordinatorCore) -> None:
        """Once a tick: admit nodes that arrived on their own (agents that joined)."""

    def none_coming(self, core: CoordinatorCore) -> bool:
        """Whether no node is coming that a waiting reconfiguration could use."""

    def awaited(self, core: CoordinatorCore) -> str:
        """What a reconfiguration left without a live node waits for, said in the message
        of the stop that ends that wait ("an agent to offer a worker (...)")."""


class CoordinatorCore:
    """One run's decisions; see the module docstring for the calls that drive it."""

    def __init__(self, cfg: JobConfig, run_path: Path, display: Any, source: NodeSource, *,
                 extra_faults: dict[int, list[Fault]] | None = None,
                 resume: Checkpoint | None = None, debug: bool = False) -> None:
        self.cfg, self.run_path, self.display, self.source = cfg, run_path, display, source
        self.extra_faults, self.resume, self.debug = extra_faults, resume, debug
        self.peer_lost_message = ""
        self.peer_lost_at: float | None = None
        self.last_news = 0.0
        self.stall_s = cfg.runtime.step_stall_s

    # -- the API ----------------------------------------------------------------------------

    def start(self, store: Store, events: Events, clock: Callable[[], float], *,
              store_host: str | None = "127.0.0.1") -> None:
        """Build the parts around `store` and `events`, load the trace, bring the first
        nodes (`source.initial`) and publish the first plan."""
        self.store, self.events, self.store_host = store, events, store_host
        self._build_parts(clock)
        self._load_trace()
        self.source.initial(self)
        self.gens.enter(self.gens.first_plan())
        cfg, plan = self.cfg, self.ctx.plan
        self.ctx.say(f"started {cfg.layout.nodes} workers: {plan.pipelines} pipeline(s) x "
                     f"{plan.stages} stage(s), model {cfg.model.name}, redundancy "
                     f"{plan.redundancy if (self.ctx.rc and plan.stages > 1) or plan.redundancy == 'reroute' else 'off'}"
                     + (f", replaying {cfg.cluster.trace} at {cfg.cluster.replay_time_scale:g}x"
                        if self.preemptions.replay else "")
                     + (f"; resumed from step {self.resume.step} ({self.resume.path})"
                        if self.resume is not None else ""))
        self.last_news = self.steps.last_commit_t = clock()

    def handle(self, n: Node, msg: WorkerMessage) -> None:
        """A message from node `n`, to the part that owns it (Stop for one it does not know)."""
        self.last_news = self.ctx.clock()
        handler = self.handlers.get(type(msg))
        if handler is None:
            raise Stop(f"node {n.name} sent a message this coordinator does not know "
                       f"({type(msg).__name__}): are the worker and the coordinator the same "
                       f"version of bamboo?")
        handler(n, msg)

    def node_exited(self, n: Node) -> None:
        """`n`'s process ended: a loss, a drain's end, or the run's end for that node."""
        self.failures.on_exit(n)

    def tick(self, now: float) -> None:
        """What time alone decides: leases, waits worth a note, nodes that joined, the
        trace's next event, the next plan, and whether the run has stalled."""
        self.nodes.check_leases()
        self.view.note_waits()
        self.source.poll(self)
        self.preemptions.tick(lambda trace_node: self.spawn(
            first_gen=self.ctx.plan.gen + 1, trace_node=trace_node))
        self.try_plan()
        self._check_stalls(now)

    def finished(self) -> bool:
        """Every step committed and every active node done (or lost after its last step)."""
        ctx = self.ctx
        if ctx.committed < self.cfg.training.steps or ctx.reconf is not None:
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
        """One more node from the source, announced with its role (a `node_up` event)."""
        n = self.source.start_node(self, first_gen)
        n.trace_node = trace_node
        replay = self.preemptions.replay
        if trace_node is not None and owns_trace_node:
            self.preemptions.trace_owner[trace_node] = n.node
        role = self.gens.initial_role(n.node) if first_gen == 0 else (None, None)
        self.events.write("node_up", node=n.name, pid=n.process.pid, pipeline=role[0],
                          stage=role[1], trace_node=replay.name(trace_node)
                          if trace_node is not None and replay else None)
        return n

    def worker_spec(self, node: int, slot: int, first_gen: int) -> Any:
        """What node `node` starts with: the job, the store, its faults."""
        from bamboo.node.worker import WorkerSpec
        return WorkerSpec(node=node, slot=slot, first_gen=first_gen,
                          store_host=self.store_host,  # type: ignore[arg-type]
                          store_port=self.store.port, config=self.cfg,  # type: ignore[attr-defined]
                          faults=self.preemptions.faults_for(node, first_gen))

    def try_plan(self) -> None:
        """Publish the next generation's plan when a reconfiguration can have one."""
        none_coming = self.preemptions.trace_finished() and self.source.none_coming(self) \
            and not self.nodes.coming()
        if self.gens.try_plan(trace_finished=none_coming) is not None:
            self.steps.round_failed_at = None

    # -- building ---------------------------------------------------------------------------

    def _build_parts(self, clock: Callable[[], float]) -> None:
        cfg, resume = self.cfg, self.resume
        start = resume.step if resume is not None else 0
        counts = layer_param_counts(cfg.model_preset())
        ctx = self.ctx = RunContext(
            cfg=cfg, store=self.store, events=self.events, display=self.display,
            run_path=self.run_path, param_counts=counts,
            partition_costs=cfg.partition_costs(counts), clock=clock,
            t0=clock(), rc=cfg.redundancy.mode not in ("off", "reroute"), committed=start,
            losses=list(resume.meta.get("losses", []))[:start] if resume else [],
            eval_losses=[e for e in resume.meta.get("eval_losses", []) if e[0] <= start]
            if resume else [],
            resume_step=resume.step if resume else None,
            resume_path=resume.path if resume else None)
        slots = 2 * max(cfg.layout.nodes, cfg.node_cap) + 4
        self.nodes = Supervisor(ctx, slots, self.worker_spec)
        self.preemptions = Preemptions(ctx, self.nodes, where=lambda n: self.gens.where(n),
                                       extra_faults=self.extra_faults)
        self.steps = StepProtocol(ctx, member_node=lambda r: self.gens.member(r).node,
                                  gone=self._gone_nodes, boundary=self._boundary,
                                  on_commit=self._on_commit, on_record=self._on_record,
                                  on_eval=self._on_eval,
                                  check_replicas=cfg.redundancy.check_replicas)
        self.steps.evaluated.update(step for step, _ in ctx.eval_losses)
        interval = CheckpointInterval(ctx)
        self.checkpoints = CheckpointAssembly(ctx, interval)
        self.restore = RestorePoints(ctx, rewind=self._rewind, interval=interval)
        self.auto: Any = None
        self.gens = Generations(ctx, self.nodes, self.restore, interval=interval,
                                fired_kills=self.preemptions.fired_kills,
                                layout_shown=lambda: self.view.layout_changed(),
                                choose_redundancy=(lambda gen: self.auto.choose(gen))
                                if cfg.redundancy.mode == "auto" else None)
        self.failures = FailureHandler(ctx, self.nodes, self.steps, self.gens,
                                       kill_fired=self.preemptions.kill_fired,
                                       respawn=self._respawn,
                                       layout_changed=lambda: self.view.layout_changed())
        self.results = Results(ctx, self.display.step, self.display.evaluation)
        self.final_layers = FinalLayers(ctx, self.nodes, self.results, self.gens.member)
        if cfg.redundancy.mode == "auto":
            from bamboo.control.redundancy_mode import AutoRedundancy
            self.auto = AutoRedundancy(ctx, self.nodes, self.results, self.failures, self.gens)
        self.view = RunView(ctx, self.nodes, self.gens, self.display)
        self.handlers: dict[type, Callable[[Node, Any], None]] = {
            MicroBatchesDone: lambda n, m: self.steps.on_micro_batches_done(m),
            RoundDone: lambda n, m: self.steps.on_round_done(m),
            EvalDone: lambda n, m: self.steps.on_eval_done(m),
            StepReport: lambda n, m: self.steps.on_step_report(n.node, m),
            LayerParams: lambda n, m: self.results.on_params(m),
            Ready: self._on_ready,
            GenerationReady: self._on_generation_ready,
            GenerationEnd: lambda n, m: self.gens.on_end(n, m, self.failures.abandon),
            CheckpointPart: lambda n, m: self.checkpoints.on_part(m),
            Notice: self._on_notice,
            Left: lambda n, m: self._on_left(n),
            Done: lambda n, m: self.nodes.set_state(n, NodeState.DONE),
            WorkerError: self._on_worker_error,
        }

    def _load_trace(self) -> None:
        cfg = self.cfg.cluster
        if cfg.trace is None:
            return
        from bamboo.traces.replay import TraceReplay
        from bamboo.traces.trace import load_trace
        trace = load_trace(cfg.trace)  # validated by the command line already
        replay = TraceReplay(trace, initial=self.cfg.layout.nodes, time_scale=cfg.replay_time_scale)
        self.preemptions.replay = replay
        self.preemptions.trace_live.update(replay.initial_added)
        self.events.write("trace", file=cfg.trace, rows=len(trace.times),
                          preemptions=trace.preemptions, time_scale=cfg.replay_time_scale,
                          window_s=round(replay.window_s(), 2))

    # -- messages ---------------------------------------------------------------------------

    def _on_ready(self, n: Node, msg: Ready) -> None:
        n.own_processor = msg.own_processor
        if msg.cpus:
            self.events.write("pinned", node=n.name, cpus=list(msg.cpus))
        if n.state is NodeState.STARTING:
            self.nodes.set_state(n, NodeState.READY)
        self.nodes.beats[n.slot] = max(self.nodes.beats[n.slot], self.ctx.clock())
        if n.rank is None:
            self.events.write("standby", node=n.name)

    def _on_generation_ready(self, n: Node, msg: GenerationReady) -> None:
        if self.gens.on_ready(n, msg):
            if self.preemptions.trace_t0 is None:
                self.preemptions.trace_t0 = self.ctx.clock()
                self.steps.last_commit_t = self.preemptions.trace_t0
            if self.gens.step_begins_pending is not None:
                self.preemptions.step_begins(self.gens.step_begins_pending)
                self.gens.step_begins_pending = None

    def _on_notice(self, n: Node, msg: Notice) -> None:
        if self.preemptions.on_notice(n, msg.source) and self.gens.interval.enabled:
            self.gens.checkpoint_due = True

    def _on_left(self, n: Node) -> None:
        self.nodes.set_state(n, NodeState.LEFT)
        if self.ctx.reconf is not None:
            self.ctx.reconf.ending.discard(n.node)

    def _on_worker_error(self, n: Node, msg: WorkerError) -> None:
        self.events.write("worker_error", node=n.name, step=msg.step, error=msg.error,
                          peer_lost=msg.peer_lost, traceback=msg.traceback)
        if not msg.peer_lost:
            if self.debug:
                print(msg.traceback, file=sys.stderr, flush=True)
            raise Stop(f"worker {n.name} ({self.gens.where(n)}) failed in step {msg.step}: "
                       f"{describe(msg.error)}")
        # The lost peer's own exit normally arrives within moments and explains this.
        self.peer_lost_message = self.peer_lost_message or (
            f"node {n.name} lost its connection to a peer in step {msg.step} and no node "
            f"was reported lost (the backend's error is in events.jsonl: worker_error)")
        self.peer_lost_at = self.peer_lost_at or self.ctx.clock()

    # -- glue between the parts -------------------------------------------------------------

    def _respawn(self, old: Node) -> Node:
        """Checkpoint-restart: a fresh worker in place of `old` (same trace node)."""
        owner = self.preemptions.trace_owner
        owned = old.trace_node is not None and owner.get(old.trace_node) == old.node
        return self.spawn(first_gen=self.ctx.plan.gen + 1, trace_node=old.trace_node,
                          owns_trace_node=owned)

    def _gone_nodes(self) -> set[int]:
        return {n.node for n in self.nodes if n.is_gone or n.exited}

    def _boundary(self, step: int) -> frozenset[BoundaryFlag]:
        return self.gens.boundary_flags(step)

    def _on_commit(self, step: int, flags: frozenset[BoundaryFlag]) -> None:
        if self.auto is not None:
            self.auto.step_ran(step)
        if BoundaryFlag.RECONFIGURE in flags:
            self.gens.begin(self.gens.next_reason, abandoned=False)
            self.gens.step_begins_pending = step + 1  # once the next generation runs
        else:
            self.preemptions.step_begins(step + 1)

    def _on_eval(self, step: int, loss: float) -> None:
        self.results.record_eval(step, loss)
        if step >= self.cfg.training.steps:  # no step record follows: close the last pass
            self.failures.close(step, [], 0.0, self.results.records)

    def _on_record(self, p: PendingStep, reports: list[StepReport]) -> None:
        names = {id(r): self.nodes[node].name for node, r in p.reports.items()}
        own = {id(r): self.nodes[node].own_processor for node, r in p.reports.items()}
        record = self.results.record(p, reports, lambda r: names[id(r)],
                                     own_processor=lambda r: own[id(r)])
        self.failures.close(p.step, reports, record["wall_s"], self.results.records)

    def _rewind(self, step: int) -> None:
        self.steps.rewind(step)
        self.checkpoints.forget_after(step)

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
                           f"{now - r.started:.0f} s, waiting for {self.source.awaited(self)}: "
                           f"stopped the run" + (f" (the last checkpoint is in "
                                                 f"{checkpoint_location(self.cfg)})"
                                                 if self.checkpoints.last else ""))
            raise Stop(f"no worker reported progress for {self.stall_s:.0f} s; stopped the run "
                       f"(raise --comm-timeout if steps are that slow)")
