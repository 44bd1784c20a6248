"""The coordinator: one run, from the store and the first workers to the summary.

`bamboo train` runs this in its own process, so the store outlives every worker. The
loop waits on every node's pipe and process at once, never longer than a fraction of a
second, and hands each typed message to the part that owns it:

    nodes.Supervisor          processes, agents, leases and fencing
    steps.StepProtocol        go/decide votes, commits, step records
    failures.FailureHandler   a lost node -> failover, peer restore, abandon, restart
    generations.Generations   plans, boundary flags, reconfiguration
    restore.RestorePoints     checkpoint or initial state when no live copy exists
    preemptions.Preemptions   --kill, notices, trace replay
    checkpoints.CheckpointAssembly
    results.Results           step records, model, summary
    display.RunView           layout panel, `role` events, notes on long waits

A worker's software error stops the run with that error (never failed over: a
deterministic bug would only cascade through the shadows).
"""
from __future__ import annotations

import dataclasses
import queue
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch.distributed as dist

from bamboo.checkpoint import Checkpoint, checkpoint_location
from bamboo.cluster.coordinator.checkpoints import CheckpointAssembly
from bamboo.cluster.coordinator.display import RunView
from bamboo.cluster.coordinator.failures import FailureHandler
from bamboo.cluster.coordinator.generations import Generations
from bamboo.cluster.coordinator.nodes import Node, NodeState, Supervisor
from bamboo.cluster.coordinator.preemptions import Preemptions
from bamboo.cluster.coordinator.restore import RestorePoints
from bamboo.cluster.coordinator.results import Results
from bamboo.cluster.coordinator.state import RunContext, RunFailed, Stop
from bamboo.cluster.coordinator.steps import PendingStep, StepProtocol
from bamboo.cluster.protocol import (SHUTDOWN_KEY, BoundaryFlag, CheckpointPart, Done, EvalDone,
                                     GenerationEnd, GenerationReady, LayerParams, Left,
                                     MicroBatchesDone, Notice, Ready, RoundDone, StepReport,
                                     WorkerError, WorkerMessage)
from bamboo.config import JobConfig
from bamboo.faults import Fault
from bamboo.models import layer_param_counts
from bamboo.progress import ProgressDisplay
from bamboo.runlog import RunDir, RunDirError, write_atomic

__all__ = ["Coordinator", "run_local", "RunFailed"]

_POLL_S = 0.1
_ROOT_CAUSE_GRACE_S = 2.0


class Coordinator:
    """One training run on local worker processes, or on agents."""

    def __init__(self, cfg: JobConfig, run: RunDir, display: ProgressDisplay,
                 extra_faults: dict[int, list[Fault]] | None = None, debug: bool = False,
                 check_replicas: bool = False, resume: Checkpoint | None = None,
                 agents: Any = None, membership: Any = None,
                 http: tuple[str, int] | None = None) -> None:
        # The workers write checkpoints and the final layers under the run directory (unless
        # --checkpoint-dir says elsewhere): they get its absolute path with the job.
        cfg = dataclasses.replace(cfg, out=str(run.path.resolve()))
        self.cfg, self.rundir, self.display, self.debug = cfg, run, display, debug
        self.http = http
        """`--http`: (host, port) to serve /healthz and /metrics on (bamboo.cluster.http)."""
        self.agents = agents
        """An AgentListener when nodes are agents on other machines (`bamboo coordinator`)."""
        self.membership = membership
        """(EtcdMembership, url, job) with `--etcd`: an expired lease is a lost node."""
        self.check_replicas = check_replicas
        self.resume = resume
        self.extra_faults = extra_faults
        self.interrupted: int | None = None
        self.peer_lost_message = ""
        self.peer_lost_at: float | None = None
        self.remote: list[Any] = []
        """RemoteAgents: the machines whose workers are nodes (agents)."""
        self.health: Any = None
        """The --http feed (bamboo.cluster.coordinator.health), while the run lasts."""
        self.scalars: Any = None
        """--tensorboard / --wandb logging (`scalars.ScalarLog`), fed from the event log."""
        self.final_status: str | None = None
        """"completed" or "failed" once the run has ended so (not when interrupted)."""

    # -- the run, top to bottom -------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        # First: a bad --http leaves no run directory behind (HttpServeError, one line).
        if self.http is not None:
            from bamboo.cluster.coordinator.health import HealthFeed  # prometheus_client
            self.health = HealthFeed(self.http, self.cfg)
        try:
            self.rundir.create(resume=self.resume is not None)
        except BaseException:
            self._close_health()
            raise
        t0 = time.monotonic()
        self.events = self.rundir.events(t0)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._start_scalars()
            self.events.write("run_start", config=self.cfg.to_dict(),
                              resumed_from=str(self.resume.path) if self.resume else None)
            if self.health is not None:
                host, port = self.health.address
                self.events.write("http", address=f"{host}:{port}")
            self._start_store()
            self._build_parts(t0)
            self._load_trace()
            self._start_nodes()
            self._supervise()
            return self._finish()
        except Stop as e:
            raise self._failed(str(e), e.exit_code) from None
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if hasattr(self, "nodes"):
                self.nodes.stop_all()
            self._release_agents()
            if self.membership is not None:
                self.membership[0].close()
            self.display.close()
            if self.scalars is not None:
                self.scalars.close()
            self._close_health()
            self.events.close()

    def _close_health(self) -> None:
        if self.health is not None:
            self.health.close()
            self.health = None

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.interrupted = signum

    def _start_store(self) -> None:
        """The store: on loopback and any free port for local workers; for agents on the
        fixed --store-port (all interfaces), advertised as --advertise, or the bind address,
        or (a wildcard bind) whatever address each agent joined on."""
        timeout = timedelta(seconds=self.cfg.comm_timeout_s)
        if self.agents is None:
            self.store_host: str | None = "127.0.0.1"
            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timeout)
            return
        bind_host, port = self.agents.address
        self.store_host = self.agents.advertise or (
            None if bind_host in ("0.0.0.0", "::", "") else bind_host)
        try:
            self.store = dist.TCPStore(bind_host or "0.0.0.0", self.agents.store_port,
                                       is_master=True, wait_for_workers=False, timeout=timeout)
        except (RuntimeError, OSError) as e:
            raise Stop(f"cannot serve the store on port {self.agents.store_port} "
                       f"({str(e).splitlines()[0][:120]}): choose another --store-port",
                       exit_code=2) from None
        self.events.write("store", port=self.store.port,
                          advertised=self.store_host or "the address each agent joined on")

    def _start_scalars(self) -> None:
        """--tensorboard / --wandb: scalars from every event from now on."""
        cfg = self.cfg
        if cfg.tensorboard is None and cfg.wandb is None:
            return
        from bamboo.cluster.coordinator.scalars import ScalarLog
        try:
            self.scalars = ScalarLog(cfg, self.rundir.path, self.display.message,
                                     live_nodes=lambda: self.nodes.alive_count()
                                     if hasattr(self, "nodes") else None)
        except Exception as e:
            which = "--wandb" if cfg.wandb is not None else "--tensorboard"
            raise Stop(f"cannot start {which} logging: {type(e).__name__}: {e}".splitlines()[0],
                       exit_code=2) from None
        self.events.listeners.append(self.scalars.on_event)

    def _build_parts(self, t0: float) -> None:
        cfg, resume = self.cfg, self.resume
        start = resume.step if resume is not None else 0
        counts = layer_param_counts(cfg.model_preset())
        ctx = self.ctx = RunContext(
            cfg=cfg, store=self.store, events=self.events, display=self.display,
            run_path=self.rundir.path, param_counts=counts,
            partition_costs=cfg.partition_costs(counts),
            t0=t0, rc=cfg.redundancy != "off", committed=start,
            losses=list(resume.meta.get("losses", []))[:start] if resume else [],
            eval_losses=[e for e in resume.meta.get("eval_losses", []) if e[0] <= start]
            if resume else [],
            resume_step=resume.step if resume else None,
            resume_path=resume.path if resume else None)
        slots = 2 * max(cfg.nodes, cfg.node_cap) + 4
        self.nodes = Supervisor(ctx, slots, self._worker_spec)
        if self.membership is not None:
            self.membership[0].watch(lambda ev: ev.kind == "expired"
                                     and self.nodes.expired.append(ev.node_id))
        self.preemptions = Preemptions(ctx, self.nodes, where=lambda n: self.gens.where(n),
                                       extra_faults=self.extra_faults)
        self.steps = StepProtocol(ctx, member_node=lambda r: self.gens.member(r).node,
                                  gone=self._gone_nodes, boundary=self._boundary,
                                  on_commit=self._on_commit, on_record=self._on_record,
                                  on_eval=self._on_eval,
                                  check_replicas=self.check_replicas)
        self.steps.evaluated.update(step for step, _ in ctx.eval_losses)
        self.checkpoints = CheckpointAssembly(ctx)
        self.restore = RestorePoints(ctx, rewind=self._rewind)
        self.gens = Generations(ctx, self.nodes, self.restore,
                                fired_kills=self.preemptions.fired_kills,
                                layout_shown=lambda: self.view.layout_changed())
        self.failures = FailureHandler(ctx, self.nodes, self.steps, self.gens,
                                       kill_fired=self.preemptions.kill_fired,
                                       respawn=self._respawn,
                                       layout_changed=lambda: self.view.layout_changed())
        self.results = Results(ctx, self.display.step, self.display.evaluation)
        if self.health is not None:
            self.health.attach(ctx, self.nodes, self.results, self.failures, self.gens)
        self.auto = None
        if cfg.redundancy == "auto":
            from bamboo.cluster.coordinator.auto import AutoRedundancy
            self.auto = AutoRedundancy(ctx, self.nodes, self.results, self.failures, self.gens)
            self.gens.choose_redundancy = self.auto.choose
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
            Left: self._on_left,
            Done: self._on_done,
            WorkerError: self._on_worker_error,
        }

    def _load_trace(self) -> None:
        if self.cfg.trace is None:
            return
        from bamboo.cluster.replay import TraceReplay
        from bamboo.sim.traces import load_trace
        trace = load_trace(self.cfg.trace)  # validated by the command line already
        replay = TraceReplay(trace, initial=self.cfg.nodes, time_scale=self.cfg.time_scale)
        self.preemptions.replay = replay
        self.events.write("trace", file=self.cfg.trace, rows=len(trace.times),
                          preemptions=trace.preemptions, time_scale=self.cfg.time_scale,
                          window_s=round(replay.window_s(), 2))

    def _start_nodes(self) -> None:
        cfg, replay = self.cfg, self.preemptions.replay
        if self.agents is not None:
            self._wait_for_agents(cfg.nodes)
        else:
            for trace_node in (replay.initial if replay is not None else [None] * cfg.nodes):
                self._spawn(first_gen=0, trace_node=trace_node)
        self.gens.enter(self.gens.first_plan())
        plan = self.ctx.plan
        self.ctx.say(f"started {cfg.nodes} workers: {plan.pipelines} pipeline(s) x "
                     f"{plan.stages} stage(s), model {cfg.model}, redundancy "
                     f"{plan.redundancy if self.ctx.rc and plan.stages > 1 else 'off'}"
                     + (f", replaying {cfg.trace} at {cfg.time_scale:g}x" if replay else ""))
        self.steps.last_commit_t = time.monotonic()

    def _supervise(self) -> None:
        stall_s = self.cfg.comm_timeout_s + 30.0
        self.last_news = time.monotonic()
        while not self._finished():
            if self.interrupted is not None:
                raise Stop(f"interrupted by {signal.Signals(self.interrupted).name}; all "
                           f"workers stopped", exit_code=128 + self.interrupted)
            self._wait_and_read()
            self.nodes.check_leases()
            self.view.note_waits()
            self._accept_agents()
            self.preemptions.tick(lambda trace_node: self._spawn(
                first_gen=self.ctx.plan.gen + 1, trace_node=trace_node))
            self._try_plan()
            self._check_stalls(stall_s)
            if self.health is not None:
                self.health.update()
        if self.health is not None:
            self.health.update(finished=True)
        self.store.set(SHUTDOWN_KEY, "1")

    def _finish(self) -> dict[str, Any]:
        missing = self.results.missing_layers()
        if missing:
            raise Stop(f"the node writing layer {missing[0]}'s final parameters was lost after "
                       f"the last step, before it wrote them: the trained model is incomplete"
                       + (f"; the last checkpoint is in {checkpoint_location(self.cfg)}"
                          if self.checkpoints.last else ""), exit_code=3)
        summary = self._summary("completed", None)
        try:
            model = self.results.model_bytes()
            if model is not None:
                write_atomic(self.rundir.path / "model.pt", model)
            self.rundir.write_json("summary.json", summary)
        except RunDirError as e:
            raise self._failed(str(e), 1, write_summary=False) from None
        self.events.write("run_done", steps=summary["steps_completed"], wall_s=summary["wall_s"])
        self.final_status = "completed"
        return summary

    # -- reading the nodes ------------------------------------------------------------------

    def _wait_and_read(self) -> None:
        live = {n.conn: n for n in self.nodes if not n.exited}
        sentinels = {n.process.sentinel: n for n in self.nodes if not n.exited}
        ready = wait(list(live) + list(sentinels), timeout=_POLL_S)
        for obj in ready:
            if obj in live:
                self.last_news = time.monotonic()
                self._drain(live[obj])
        for obj in ready:
            if obj in sentinels:
                n = sentinels[obj]
                self._drain(n)
                self.failures.on_exit(n)

    def _drain(self, n: Node) -> None:
        """Hand every message waiting on `n`'s pipe to its handler."""
        try:
            while n.conn.poll():
                msg: WorkerMessage = n.conn.recv()
                handler = self.handlers.get(type(msg))
                if handler is None:
                    raise Stop(f"node {n.name} sent a message this coordinator does not know "
                               f"({type(msg).__name__}): are the worker and the coordinator "
                               f"the same version of bamboo?")
                handler(n, msg)
        except (EOFError, OSError):
            pass

    def _on_ready(self, n: Node, _msg: Ready) -> None:
        if n.state is NodeState.STARTING:
            n.state = NodeState.READY
        self.nodes.beats[n.slot] = max(self.nodes.beats[n.slot], time.monotonic())
        if n.rank is None:
            self.events.write("standby", node=n.name)

    def _on_generation_ready(self, n: Node, msg: GenerationReady) -> None:
        if self.gens.on_ready(n, msg):
            if self.preemptions.trace_t0 is None:
                self.preemptions.trace_t0 = time.monotonic()
                self.steps.last_commit_t = self.preemptions.trace_t0
            if self.gens.step_begins_pending is not None:
                self.preemptions.step_begins(self.gens.step_begins_pending)
                self.gens.step_begins_pending = None

    def _on_notice(self, n: Node, msg: Notice) -> None:
        if self.preemptions.on_notice(n, msg.source) and self.cfg.checkpoint_every:
            self.gens.checkpoint_due = True

    def _on_left(self, n: Node, _msg: Left) -> None:
        n.state = NodeState.LEFT
        if self.ctx.reconf is not None:
            self.ctx.reconf.ending.discard(n.node)

    def _on_done(self, n: Node, _msg: Done) -> None:
        n.state = NodeState.DONE

    def _on_worker_error(self, n: Node, msg: WorkerError) -> None:
        self.events.write("worker_error", node=n.name, step=msg.step, error=msg.error,
                          peer_lost=msg.peer_lost, traceback=msg.traceback)
        if not msg.peer_lost:
            if self.debug:
                print(msg.traceback, file=sys.stderr, flush=True)
            raise Stop(f"worker {n.name} ({self.gens.where(n)}) failed in step {msg.step}: "
                       f"{msg.error}")
        # The lost peer's own exit normally arrives within moments and explains this.
        self.peer_lost_message = self.peer_lost_message or (
            f"node {n.name} lost a peer in step {msg.step} ({msg.error}) and no other "
            f"cause was reported")
        self.peer_lost_at = self.peer_lost_at or time.monotonic()

    # -- agents -----------------------------------------------------------------------------

    def _wait_for_agents(self, count: int) -> None:
        """The initial nodes: the first `count` workers the joining agents offer (progress
        every 2 s); short of them after --join-timeout, the run stops (exit code 1)."""
        host, port = self.agents.address
        timeout_s = self.agents.join_timeout_s
        self.ctx.say(f"waiting for {count} worker(s) on {host}:{port}: bamboo agent --join "
                     f"{host}:{port} --token-file <the job's token file> [--workers K]")
        start = last = time.monotonic()
        while len(self.nodes.nodes) < count:
            if self.interrupted is not None:
                raise Stop(f"interrupted by {signal.Signals(self.interrupted).name} while "
                           f"waiting for agents", exit_code=128 + self.interrupted)
            try:
                channel, hello = self.agents.joined.get(timeout=0.2)
            except queue.Empty:
                channel = None
            if channel is not None:
                self._admit_agent(channel, hello, first_gen=0, limit=count - len(self.nodes.nodes))
            now = time.monotonic()
            if now - start > timeout_s:
                raise Stop(f"{len(self.nodes.nodes)}/{count} workers joined within "
                           f"--join-timeout {timeout_s:g} s ({len(self.remote)} agent(s)"
                           + (f", {self.agents.refused} refused for a wrong token"
                              if self.agents.refused else "")
                           + "): start more agents, or lower --nodes", exit_code=1)
            if now - last > 2.0:
                last = now
                self.ctx.say(f"  {len(self.nodes.nodes)}/{count} workers joined from "
                             f"{len(self.remote)} agent(s)"
                             + (f", {self.agents.refused} refused (wrong token)"
                                if self.agents.refused else ""))

    def _accept_agents(self) -> None:
        """Agents that join while the job runs give standbys; so does a GPU whose worker
        ended while its machine stayed."""
        if self.agents is None:
            return
        while not self.agents.joined.empty():
            channel, hello = self.agents.joined.get()
            self._admit_agent(channel, hello, first_gen=self.ctx.plan.gen + 1)
        for agent in self.remote:
            if agent.spares and not agent.gone and self.ctx.committed < self.cfg.steps:
                agent.spares -= 1
                self._start_agent_workers(agent, first_gen=self.ctx.plan.gen + 1, limit=1)

    def _admit_agent(self, channel: Any, hello: Any, *, first_gen: int,
                     limit: int | None = None) -> None:
        from bamboo.cluster.remote import RemoteAgent
        agent = RemoteAgent(channel, hello, self.nodes.progress)
        self.remote.append(agent)
        started = self._start_agent_workers(agent, first_gen=first_gen, limit=limit)
        if started:
            self.ctx.say(f"agent {agent.machine} joined from {channel.peer}: "
                         f"{', '.join(n.name for n in started)}")

    def _start_agent_workers(self, agent: Any, *, first_gen: int, limit: int | None) -> list:
        etcd = {"url": self.membership[1], "job": self.membership[2]} if self.membership else None
        started = self.nodes.admit_agent(agent, first_gen=first_gen, etcd=etcd, limit=limit)
        for n in started:  # roles come with the first plan (placed across machines): `role`
            self.events.write("node_up", node=n.name, pid=n.process.pid, host=n.process.host,
                              machine=n.machine, worker=n.process.index,
                              pipeline=None, stage=None)
        return started

    def _release_agents(self) -> None:
        """At the end: a finished or failed run lets its agents go; an interrupted one (a
        coordinator being restarted) just closes, and its agents try to rejoin."""
        for agent in self.remote:
            if self.final_status is None:
                agent.lost()
            else:
                agent.finish(self.final_status)

    # -- local workers ----------------------------------------------------------------------

    def _worker_spec(self, node: int, slot: int, first_gen: int) -> Any:
        from bamboo.cluster.worker import WorkerSpec
        return WorkerSpec(node=node, slot=slot, first_gen=first_gen,
                          store_host=self.store_host,  # type: ignore[arg-type]
                          store_port=self.store.port, config=self.cfg,
                          faults=self.preemptions.faults_for(node, first_gen),
                          check_replicas=self.check_replicas)

    def _spawn(self, *, first_gen: int, trace_node: int | None = None,
               owns_trace_node: bool = True) -> Node:
        n = self.nodes.spawn_local(first_gen=first_gen, trace_node=trace_node)
        replay = self.preemptions.replay
        if trace_node is not None and owns_trace_node:
            self.preemptions.trace_owner[trace_node] = n.node
        role = self.gens.initial_role(n.node) if first_gen == 0 else (None, None)
        self.events.write("node_up", node=n.name, pid=n.process.pid, pipeline=role[0],
                          stage=role[1], trace_node=replay.name(trace_node)
                          if trace_node is not None and replay else None)
        return n

    def _respawn(self, old: Node) -> Node:
        """Checkpoint-restart: a fresh worker in place of `old` (same trace node)."""
        owner = self.preemptions.trace_owner
        owned = old.trace_node is not None and owner.get(old.trace_node) == old.node
        return self._spawn(first_gen=self.ctx.plan.gen + 1, trace_node=old.trace_node,
                           owns_trace_node=owned)

    # -- glue between the parts -------------------------------------------------------------

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
        if step >= self.cfg.steps:  # no step record follows: close the losses of the last pass
            self.failures.close(step, [], 0.0, self.results.records)

    def _on_record(self, p: PendingStep, reports: list[StepReport]) -> None:
        names = {id(r): self.nodes[node].name for node, r in p.reports.items()}
        record = self.results.record(p, reports, lambda r: names[id(r)])
        self.failures.close(p.step, reports, record["wall_s"], self.results.records)

    def _rewind(self, step: int) -> None:
        self.steps.rewind(step)
        self.checkpoints.forget_after(step)

    def _try_plan(self) -> None:
        none_coming = self.preemptions.trace_finished()
        if self.agents is not None:  # agents may still join (a machine replaced, restarted)
            r = self.ctx.reconf
            none_coming = r is not None and \
                self.ctx.clock() - r.started > self.agents.join_timeout_s
        if self.gens.try_plan(trace_finished=none_coming) is not None:
            self.steps.round_failed_at = None

    def _finished(self) -> bool:
        ctx = self.ctx
        if ctx.committed < self.cfg.steps or ctx.reconf is not None:
            return False
        active = [self.gens.member(r) for r in ctx.roles.active_ranks()]
        return all(n.state in (NodeState.DONE, NodeState.LOST) for n in active)

    def _check_stalls(self, stall_s: float) -> None:
        now = time.monotonic()
        if self.peer_lost_at is not None and now - self.peer_lost_at > _ROOT_CAUSE_GRACE_S:
            raise Stop(self.peer_lost_message)
        if self.steps.stalled_round():
            raise Stop("a node reported a failed commit round but no node was lost; stopped "
                       "the run (see events.jsonl)")
        if now - self.last_news > stall_s:
            raise Stop(f"no worker reported progress for {stall_s:.0f} s; stopped the run "
                       f"(raise --comm-timeout if steps are that slow)")

    # -- the end ----------------------------------------------------------------------------

    def _summary(self, status: str, error: str | None) -> dict[str, Any]:
        return self.results.summary(
            status=status, error=error, losses=self.failures.losses,
            standby_losses=self.failures.standby_losses,
            reconfigurations=self.gens.reconfigurations, redone_steps=self.restore.redone_steps,
            reconf_times=self.gens.times)

    def _failed(self, message: str, exit_code: int, write_summary: bool = True) -> RunFailed:
        self.nodes.stop_all()
        self.failures.stopped()
        self.events.write("run_failed", error=message)
        if self.interrupted is None:
            self.final_status = "failed"
        summary = self._summary("failed", message)
        if write_summary:
            try:
                self.rundir.write_json("summary.json", summary)
            except RunDirError as e:
                message = f"{message}; and {e}"
        return RunFailed(message, summary, exit_code)


def run_local(cfg: JobConfig, run: RunDir, display: ProgressDisplay,
              extra_faults: dict[int, list[Fault]] | None = None,
              debug: bool = False, check_replicas: bool = False,
              resume: Checkpoint | None = None, agents: Any = None,
              membership: Any = None,
              http: tuple[str, int] | None = None) -> dict[str, Any]:
    """Train `cfg` on a local cluster (or on agents, when `agents` listens for them);
    the summary, or RunFailed (HttpServeError when `http`, --http's address, cannot be
    served)."""
    return Coordinator(cfg, run, display, extra_faults, debug, check_replicas, resume,
                       agents, membership, http=http).run()
