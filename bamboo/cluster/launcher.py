"""The coordinator of a local cluster: hosts the store, starts, watches and fences workers,
decides each step's fate and plans every reconfiguration.

`bamboo train` runs this in its own process, so the store outlives every worker.
Workers come from a fork server that has already imported torch. The coordinator
waits on every worker's pipe and process at once, never longer than a fraction of a
second, and:

- notices a lost node within that fraction of a second (its process is gone) or when
  its heartbeat lease runs out (a frozen machine: it is fenced with SIGKILL first);
- publishes the new role map (`epoch/<e>`), which every survivor applies to the step
  under way (a failover, or a peer restore);
- says "go" to a step's commit round when every live node has finished its
  micro-batches, and "commit" when every live node's round succeeded (else "redo"),
  marked `+ckpt` when a checkpoint is due and `+reconf` when the generation ends at
  this boundary: a standby can replace a shadow or complete a pipeline, or a noticed
  node drains;
- when a loss leaves no in-flight copy of some stage, abandons the generation and
  plans the next one from the live copies (a peer restore, onto a new layout), or from
  the last durable checkpoint when no live node holds some layer (a checkpoint restore);
- replays a preemption trace (`--trace`): its removes preempt workers, its adds start
  new ones, which wait as standbys;
- stops the run with the worker's error when a worker raises (a software error is
  never failed over: a deterministic bug would only cascade through the shadows).
"""
from __future__ import annotations

import hashlib
import io
import math
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.sharedctypes import RawArray
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bamboo.checkpoint import CheckpointError, Checkpoint, load_latest, save_checkpoint
from bamboo.cluster import forkserver
from bamboo.cluster.worker import SHUTDOWN_KEY, WorkerSpec, plan_key, worker_main
from bamboo.config import JobConfig
from bamboo.faults import Fault
from bamboo.models import layer_param_counts, preset
from bamboo.pipeline.engine import PHASES
from bamboo.pipeline.partition import partition
from bamboo.progress import ProgressDisplay, pipeline_rows
from bamboo.reconfig.planner import GenerationPlan, NoLiveCopy, choose_layout, plan_generation
from bamboo.redundancy.roles import RoleMap, Unrecoverable, plan_failover
from bamboo.runlog import RunDir, write_atomic

__all__ = ["RunFailed", "LocalCluster", "run_local", "checkpoint_root"]

_POLL_S = 0.1
_ROOT_CAUSE_GRACE_S = 2.0
_START_GRACE_S = 60.0
"""A starting worker's heartbeat lease (importing torch on two busy cores takes a while)."""


class RunFailed(RuntimeError):
    """The run stopped before its last step; str() is the one line for the user."""

    def __init__(self, message: str, summary: dict[str, Any], exit_code: int = 1) -> None:
        super().__init__(message)
        self.summary, self.exit_code = summary, exit_code


def checkpoint_root(run_dir: str | Path) -> Path:
    """Where a run keeps its checkpoints: `<run dir>/checkpoints` (or the folder itself,
    when it is a checkpoints folder)."""
    path = Path(run_dir)
    return path if (path / "LATEST").exists() or path.name == "checkpoints" else path / "checkpoints"


@dataclass(slots=True)
class _Worker:
    node: int
    slot: int
    process: Any
    conn: Connection
    trace_node: int | None = None
    ready: bool = False
    rank: int | None = None
    """Rank in the current generation's process group; None while not a member."""
    done: bool = False
    exited: bool = False
    lost: bool = False
    fenced: bool = False
    left: bool = False
    noticed: bool = False
    kill_at: float | None = None
    retired: bool = False
    """Stopped by the coordinator itself (checkpoint-restart recovery restarts every worker)."""

    @property
    def name(self) -> str:
        return f"n{self.node}"


@dataclass(slots=True)
class _Failure:
    node: str
    rank: int | None
    step: int
    phase: str
    handled_as: str
    shadow: str | None
    t: float
    signal: str
    pause_s: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    in_flight: bool = False
    """Handled inside the step (a failover or peer restore by role change), with BRC."""


@dataclass(slots=True)
class _PendingStep:
    step: int
    loss: float
    wall_s: float
    expected: set[int]
    """Node ids whose step report is awaited."""
    reports: dict[int, dict] = field(default_factory=dict)


@dataclass(slots=True)
class _Reconfiguration:
    """A generation change under way."""

    reason: str
    started: float
    ending: set[int]
    """Node ids of the old generation whose `gen_end` is awaited."""
    holdings: dict[int, set[int]] = field(default_factory=dict)
    abandoned: bool = False
    lost: list[_Failure] = field(default_factory=list)
    """Losses the new generation must account for (peer or checkpoint restore)."""
    why: str = ""
    """Why no in-flight copy covered a loss: the run's last words if nothing else can."""
    restarting: set[int] | None = None
    """Checkpoint-restart recovery: the fresh workers the next generation waits for."""


class LocalCluster:
    """One training run on local worker processes."""

    def __init__(self, cfg: JobConfig, run: RunDir, display: ProgressDisplay,
                 extra_faults: dict[int, list[Fault]] | None = None, debug: bool = False,
                 check_replicas: bool = False, resume: Checkpoint | None = None,
                 agents: Any = None, membership: Any = None) -> None:
        self.cfg, self.rundir, self.display, self.debug = cfg, run, display, debug
        self.agents = agents
        self.membership = membership
        """(EtcdMembership, url, job) with `bamboo coordinator --etcd`: agents hold leases
        there, and an expired lease is a lost node."""
        self.expired: list[str] = []
        if membership is not None:
            membership[0].watch(lambda ev: ev.kind == "expired" and self.expired.append(ev.node_id))
        """An AgentListener when nodes are agents on other machines (`bamboo coordinator`)."""
        self.check_replicas = check_replicas
        self.rc = cfg.redundancy != "off"
        self.preset = preset(cfg.model)
        self.param_counts = layer_param_counts(self.preset)
        self.extra_faults = extra_faults or {}
        self.kill_faults = tuple(Fault("kill", k.step, pipeline=k.pipeline, stage=k.stage)
                                 for k in cfg.kills if not k.notice)
        self.fired_kills: set[str] = set()
        """`--kill` specs carried out (each preempts once, even if its step is redone)."""
        self.resume = resume
        self.workers: dict[int, _Worker] = {}
        self.interrupted: int | None = None
        self._peer_lost_message = ""
        start = resume.step if resume is not None else 0
        self.committed = start
        self.losses: list[float] = list(resume.meta.get("losses", []))[:start] if resume else []
        self.phase_a: dict[tuple[int, int], set[int]] = {}
        self.rounds: dict[tuple[int, int], dict[int, dict]] = {}
        self.written: set[str] = set()
        self.round_failed_at: float | None = None
        self.pending: dict[int, _PendingStep] = {}
        self.step_records: list[dict] = []
        self.failures: list[_Failure] = []
        self.params: dict[int, list] = {}
        self.standby_losses = 0
        self.reconfigurations = 0
        self.redone_steps = 0
        self.checkpoint_parts: dict[int, dict[int, torch.Tensor]] = {}
        self.last_checkpoint: Path | None = resume.path if resume else None
        self.checkpoint_due_on_notice = False
        self.reconf: _Reconfiguration | None = None
        self.reconf_times: list[dict] = []
        self.gen_ready: set[int] = set()
        self.trace_t0: float | None = None
        self.step_begins_pending: int | None = self.committed
        self.restore_step: int | None = None
        self._waiting_since: float | None = None
        self.known_roles: dict[int, tuple] = {}
        self._last_wait_note = 0.0
        self.replay = None
        self.trace_owner: dict[int, int] = {}
        self.next_node = 0

    # -- lifecycle --------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.t0 = time.monotonic()
        self.rundir.create(resume=self.resume is not None)
        self.events = self.rundir.events(self.t0)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.events.write("run_start", config=self.cfg.to_dict(),
                              resumed_from=str(self.resume.path) if self.resume else None)
            self._load_trace()
            self._start_store()
            self._start_workers()
            self._supervise()
            return self._finish()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self._stop_all()
            if self.membership is not None:
                self.membership[0].close()
            self.display.close()
            self.events.close()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.interrupted = signum

    def _say(self, text: str) -> None:
        self.display.message(text)

    def _load_trace(self) -> None:
        if self.cfg.trace is None:
            return
        from bamboo.cluster.replay import TraceReplay
        from bamboo.sim.traces import load_trace
        trace = load_trace(self.cfg.trace)  # validated by the command line already
        self.replay = TraceReplay(trace, initial=self.cfg.nodes, time_scale=self.cfg.time_scale)
        self.events.write("trace", file=self.cfg.trace, rows=len(trace.times),
                          preemptions=trace.preemptions, time_scale=self.cfg.time_scale,
                          window_s=round(self.replay.window_s(), 2))

    def _start_store(self) -> None:
        timeout = timedelta(seconds=self.cfg.comm_timeout_s)
        self.store_host = self.agents.address[0] if self.agents is not None else "127.0.0.1"
        self.store = dist.TCPStore(self.store_host, 0, is_master=True, wait_for_workers=False,
                                   timeout=timeout)

    def _start_workers(self) -> None:
        cfg = self.cfg
        slots = 2 * max(cfg.nodes, cfg.node_cap) + 4
        self.beats = RawArray("d", [time.monotonic() + _START_GRACE_S] * slots)
        self.progress = RawArray("i", [0] * (2 * slots))
        self.free_slots = list(range(slots))
        if self.agents is not None:
            self._wait_for_agents(cfg.nodes)
            initial = []
        else:
            initial = self.replay.initial if self.replay is not None else [None] * cfg.nodes
        for trace_node in initial:
            w = self._spawn(first_gen=0, trace_node=trace_node)
            if trace_node is not None:
                self.trace_owner[trace_node] = w.node
        self._publish_first_generation()
        self._say(f"started {cfg.nodes} workers: {self.plan.pipelines} pipeline(s) x "
                  f"{self.plan.stages} stage(s), model {cfg.model}, redundancy "
                  f"{cfg.redundancy if self.rc and self.plan.stages > 1 else 'off'}"
                  + (f", replaying {cfg.trace} at {cfg.time_scale:g}x" if self.replay else ""))
        self.last_commit_t = time.monotonic()

    def _spawn(self, *, first_gen: int, trace_node: int | None = None) -> _Worker:
        ctx = forkserver.context()
        node, self.next_node = self.next_node, self.next_node + 1
        slot = self.free_slots.pop(0)
        self.beats[slot] = time.monotonic() + _START_GRACE_S
        self.progress[2 * slot] = self.progress[2 * slot + 1] = 0
        reader, writer = ctx.Pipe(duplex=False)
        spec = self._worker_spec(node, slot, first_gen)
        process = ctx.Process(target=worker_main, args=(spec, writer, self.beats, self.progress),
                              name=f"bamboo-n{node}")
        process.start()
        writer.close()
        w = _Worker(node, slot, process, reader, trace_node=trace_node)
        self.workers[node] = w
        role = self._initial_role(node) if first_gen == 0 else (None, None)
        self.events.write("node_up", node=w.name, pid=process.pid, pipeline=role[0], stage=role[1],
                          trace_node=self.replay.name(trace_node) if trace_node is not None
                          and self.replay else None)
        return w

    def _worker_spec(self, node: int, slot: int, first_gen: int) -> WorkerSpec:
        # A worker started later gets only the kills still ahead (a step redone after a
        # restore must not preempt its new holder a second time).
        later = first_gen > 0
        faults = tuple(f for f in self.kill_faults
                       if f"{f.pipeline}:{f.stage}@{f.step}" not in self.fired_kills
                       and (not later or f.step >= self.committed)) + \
            tuple(self.extra_faults.get(node, []))
        return WorkerSpec(node=node, slot=slot, first_gen=first_gen, store_host=self.store_host,
                          store_port=self.store.port, config=self.cfg, faults=faults,
                          check_replicas=self.check_replicas)

    def _wait_for_agents(self, count: int) -> None:
        """The initial nodes: the first `count` agents to join (progress every 2 s)."""
        host, port = self.agents.address
        self._say(f"waiting for {count} agent(s) on {host}:{port}: "
                  f"bamboo agent --join {host}:{port} --token-file <the job's token file>")
        last = time.monotonic()
        while len(self.workers) < count:
            if self.interrupted is not None:
                self._fail(f"interrupted by {signal.Signals(self.interrupted).name} while "
                           f"waiting for agents", exit_code=128 + self.interrupted)
            try:
                conn, hello = self.agents.joined.get(timeout=0.2)
            except Exception:  # queue.Empty
                conn = None
            if conn is not None:
                self._register_agent(conn, hello, first_gen=0)
            if time.monotonic() - last > 2.0:
                last = time.monotonic()
                self._say(f"  {len(self.workers)}/{count} agents joined"
                          + (f", {self.agents.refused} refused (wrong token)"
                             if self.agents.refused else ""))

    def _check_memberships(self) -> None:
        """`--etcd`: a node whose lease etcd expired is fenced, like a missed heartbeat."""
        while self.expired:
            name = self.expired.pop(0)
            w = self.workers.get(int(name[1:])) if name[1:].isdigit() else None
            if w is None or w.exited or w.lost or w.fenced or w.done or w.left:
                continue
            w.fenced = True
            self.events.write("fenced", node=w.name, why="etcd lease expired")
            self._say(f"node {w.name}'s etcd lease expired; fenced")
            w.process.kill()

    def _accept_agents(self) -> None:
        """Agents that join while the job runs become standbys."""
        self._check_memberships()
        if self.agents is None:
            return
        while not self.agents.joined.empty():
            conn, hello = self.agents.joined.get()
            self._register_agent(conn, hello, first_gen=self.plan.gen + 1)

    def _register_agent(self, conn: Connection, hello: dict, *, first_gen: int) -> _Worker | None:
        from bamboo.cluster.remote import RemoteProcess
        alive = sum(1 for w in self.workers.values() if not w.exited and not w.lost)
        if alive >= self.cfg.node_cap or not self.free_slots:
            why = f"{alive} nodes already (--max-nodes {self.cfg.node_cap})"
            try:
                conn.send({"kind": "refused", "why": why})
                conn.close()
            except OSError:
                pass
            self.events.write("agent_refused", host=hello.get("host"), why=why)
            return None
        node, self.next_node = self.next_node, self.next_node + 1
        slot = self.free_slots.pop(0)
        self.beats[slot] = time.monotonic() + _START_GRACE_S
        self.progress[2 * slot] = self.progress[2 * slot + 1] = 0
        etcd = {"url": self.membership[1], "job": self.membership[2]} if self.membership else None
        conn.send({"kind": "job", "spec": self._worker_spec(node, slot, first_gen), "etcd": etcd})
        process = RemoteProcess(conn, hello, slot, self.beats, self.progress)
        w = _Worker(node, slot, process, process.reader)
        self.workers[node] = w
        role = self._initial_role(node) if first_gen == 0 else (None, None)
        self.events.write("node_up", node=w.name, pid=process.pid, host=process.host,
                          pipeline=role[0], stage=role[1])
        self._say(f"agent {w.name} joined from {process.host}")
        return w

    def _initial_role(self, node: int) -> tuple[int | None, int | None]:
        d, p = self.cfg.data_parallel, self.cfg.stages
        return (node // p, node % p) if node < d * p else (None, None)

    def _publish_first_generation(self) -> None:
        cfg = self.cfg
        d, p = cfg.data_parallel, cfg.stages
        parts = partition(self.param_counts, p)
        plan = GenerationPlan(gen=0, epoch=0, members=[f"n{i}" for i in range(d * p)],
                              pipelines=d, stages=p, parts=[[r.start, r.stop] for r in parts],
                              start_step=self.committed,
                              checkpoint=str(self.resume.path) if self.resume else None,
                              reason="start" if self.resume is None else "resume")
        self._enter(plan)

    def _enter(self, plan: GenerationPlan) -> None:
        """Make `plan` the current generation and publish it."""
        plan.fired_kills = sorted(self.fired_kills)
        self.plan = plan
        self.roles = plan.roles(self.rc)
        names = {w.name: w for w in self.workers.values()}
        for w in self.workers.values():
            w.rank = None
        for rank, name in enumerate(plan.members):
            names[name].rank = rank
        self.gen_ready = set()
        self.gen_started = time.monotonic()
        self.store.set(f"epoch/{plan.epoch}", self.roles.to_json())
        self.store.set(plan_key(plan.gen), plan.to_json())
        self._show_layout()

    def _show_layout(self) -> None:
        self.display.layout(pipeline_rows(self.roles.holders, self.plan.members, self.roles.dead),
                            [w.name for w in self._standbys()])
        self._write_roles()

    def _write_roles(self) -> None:
        """A `role` event for every live node whose role changed (which process holds which
        stage, for anyone watching the run from outside)."""
        for w in self.workers.values():
            if w.exited or w.lost or w.left:
                continue
            active = w.rank is not None and w.rank < self.plan.active
            d = self.roles.pipeline_of(w.rank) if active else None
            stages = self.roles.stages_of(w.rank) if active else []
            role = (d, tuple(stages))
            if self.known_roles.get(w.node) != role:
                if w.node in self.known_roles or role != self._initial_role_key(w.node):
                    self.events.write("role", node=w.name, pid=w.process.pid, pipeline=d,
                                      stage=stages[0] if stages else None, stages=stages)
                self.known_roles[w.node] = role

    def _initial_role_key(self, node: int) -> tuple:
        d, s = self._initial_role(node)
        return (d, (s,) if s is not None else ())

    def _stop_all(self) -> None:
        for w in self.workers.values():
            if w.process.is_alive():
                w.process.kill()
        for w in self.workers.values():
            w.process.join(timeout=5)

    # -- naming -----------------------------------------------------------------------------

    def _member(self, rank: int) -> _Worker:
        return self.workers[int(self.plan.members[rank][1:])]

    def _rank_name(self, rank: int | None) -> str | None:
        return None if rank is None else self.plan.members[rank]

    def _live_members(self) -> list[_Worker]:
        members = [self._member(r) for r in range(len(self.plan.members))]
        return [w for w in members if not (w.lost or w.left or w.retired)]

    # -- supervision ------------------------------------------------------------------------

    def _finished(self) -> bool:
        if self.committed < self.cfg.steps or self.reconf is not None:
            return False
        active = [self._member(r) for r in self.roles.active_ranks()]
        return all(w.done or w.lost for w in active)

    def _supervise(self) -> None:
        stall_s = self.cfg.comm_timeout_s + 30.0
        self.last_news = time.monotonic()
        peer_lost_at: float | None = None
        while not self._finished():
            if self.interrupted is not None:
                self._fail(f"interrupted by {signal.Signals(self.interrupted).name}; "
                           f"all workers stopped", exit_code=128 + self.interrupted)
            live = {w.conn: w for w in self.workers.values() if not w.exited}
            sentinels = {w.process.sentinel: w for w in self.workers.values() if not w.exited}
            ready = wait(list(live) + list(sentinels), timeout=_POLL_S)
            for obj in ready:
                if obj in live:
                    self.last_news = time.monotonic()
                    if self._drain(live[obj]) and peer_lost_at is None:
                        peer_lost_at = time.monotonic()
            for obj in ready:
                if obj in sentinels:
                    self._on_exit(sentinels[obj])
            self._check_leases()
            self._note_waits()
            self._accept_agents()
            self._tick_trace()
            self._tick_notices()
            self._try_plan()
            now = time.monotonic()
            if peer_lost_at is not None and now - peer_lost_at > _ROOT_CAUSE_GRACE_S:
                self._fail(self._peer_lost_message)
            if self.round_failed_at is not None and now - self.round_failed_at > self.cfg.lease_s + 5:
                self._fail("a node reported a failed commit round but no node was lost; "
                           "stopped the run (see events.jsonl)")
            if now - self.last_news > stall_s:
                self._fail(f"no worker reported progress for {stall_s:.0f} s; stopped the run "
                           f"(raise --comm-timeout if steps are that slow)")
        self.store.set(SHUTDOWN_KEY, "1")

    def _note_waits(self) -> None:
        """Anything that keeps the job from training for more than 2 s says so, every 2 s."""
        now = time.monotonic()
        waiting = None
        if self.reconf is not None:
            waiting = (f"reconfiguring: {len(self.reconf.ending)} node(s) still ending the "
                       f"generation" if self.reconf.ending else "reconfiguring: waiting for nodes")
        elif not self._generation_running():
            ready = len(self.gen_ready & self._active_members())
            waiting = (f"generation {self.plan.gen}: {ready}/{len(self._active_members())} "
                       f"node(s) ready")
        if waiting is None:
            self._waiting_since = None
            return
        if self._waiting_since is None:
            self._waiting_since = self._last_wait_note = now
        elif now - self._last_wait_note >= 2.0:
            self._last_wait_note = now
            self._say(f"{waiting} ({now - self._waiting_since:.0f} s)")

    def _check_leases(self) -> None:
        now = time.monotonic()
        for w in self.workers.values():
            if w.exited or w.done or w.fenced or w.left or w.retired:
                continue
            silent = now - self.beats[w.slot]
            if silent > self.cfg.lease_s and w.process.is_alive():
                w.fenced = True
                self.events.write("fenced", node=w.name, silent_s=round(silent, 2))
                self._say(f"node {w.name} stopped answering for {silent:.1f} s; fenced with SIGKILL")
                w.process.kill()

    def _drain(self, w: _Worker) -> bool:
        """Handle every message waiting on `w`'s pipe; True when it reported a lost peer."""
        peer_lost = False
        try:
            while w.conn.poll():
                peer_lost |= self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            pass
        return peer_lost

    def _handle(self, w: _Worker, msg: dict) -> bool:
        kind = msg["kind"]
        if kind == "phase_a_done":
            self._on_phase_a(msg)
        elif kind == "round_done":
            self._on_round(msg)
        elif kind == "step":
            self._on_step_report(w, msg)
        elif kind == "params":
            for layer_index, tensors in msg["layers"]:
                self.params[layer_index] = tensors
        elif kind == "ready":
            w.ready = True
            self.beats[w.slot] = max(self.beats[w.slot], time.monotonic())
            if w.rank is None:
                self.events.write("standby", node=w.name)
        elif kind == "gen_ready":
            self._on_gen_ready(w, msg)
        elif kind == "gen_end":
            self._on_gen_end(w, msg)
        elif kind == "ckpt":
            self._on_checkpoint_part(msg)
        elif kind == "notice":
            self._on_notice(w, msg.get("source", "SIGTERM"))
        elif kind == "left":
            w.left = True
            if self.reconf is not None:
                self.reconf.ending.discard(w.node)
        elif kind == "done":
            w.done = True
        elif kind == "error":
            self.events.write("worker_error", node=w.name, step=msg["step"], error=msg["error"],
                              peer_lost=msg["peer_lost"], traceback=msg["traceback"])
            if not msg["peer_lost"]:
                self._fail(self._software_error(w, msg))
            self._peer_lost_message = self._peer_lost_message or (
                f"node {w.name} lost a peer in step {msg['step']} ({msg['error']}) "
                f"and no other cause was reported")
            return True
        return False

    def _software_error(self, w: _Worker, msg: dict) -> str:
        if self.debug:
            print(msg["traceback"], file=sys.stderr, flush=True)
        return f"worker {w.name} ({self._where(w)}) failed in step {msg['step']}: {msg['error']}"

    def _where(self, w: _Worker) -> str:
        if w.rank is None or w.rank >= self.plan.active:
            return "standby"
        d = self.roles.pipeline_of(w.rank)
        stages = self.roles.stages_of(w.rank)
        if d is None or not stages:
            return "standby"
        return f"pipeline {d}, stage{'s' if len(stages) > 1 else ''} " + \
            " and ".join(map(str, stages))

    # -- the step protocol ------------------------------------------------------------------

    def _set(self, key: str, value: str) -> None:
        if key not in self.written:
            self.written.add(key)
            self.store.set(key, value)

    def _live_active(self) -> set[int]:
        return set(self.roles.active_ranks())

    def _on_phase_a(self, msg: dict) -> None:
        step, epoch = msg["step"], msg["epoch"]
        if epoch < self.roles.epoch or self.reconf is not None:
            self._set(f"go/{step}/{epoch}", "abort")
            return
        done = self.phase_a.setdefault((step, epoch), set())
        done.add(msg["rank"])
        if done >= self._live_active():
            self._set(f"go/{step}/{epoch}", "go")

    def _on_round(self, msg: dict) -> None:
        step, epoch = msg["step"], msg["epoch"]
        if epoch < self.roles.epoch or self.reconf is not None:
            self._set(f"decide/{step}/{epoch}", "redo")
            return
        reports = self.rounds.setdefault((step, epoch), {})
        reports[msg["rank"]] = msg
        if not msg["ok"] and self.round_failed_at is None:
            self.round_failed_at = time.monotonic()
        if set(reports) >= self._live_active() and all(r["ok"] for r in reports.values()):
            flags = self._boundary_flags(step)
            self._set(f"decide/{step}/{epoch}", "+".join(["commit"] + flags))
            self._commit(step, reports)
            if "reconf" in flags:
                self._begin_reconfiguration(self._reconf_reason, abandoned=False)
                self.step_begins_pending = step + 1  # once the next generation runs
            else:
                self._step_begins(step + 1)

    def _commit(self, step: int, reports: dict[int, dict]) -> None:
        self.round_failed_at = None
        mb_losses = sorted(x for r in reports.values() for x in r["losses"])
        loss = math.fsum(l * w for _, l, w in mb_losses)
        now = time.monotonic()
        expected = {self._member(r).node for r in self._live_active()}
        self.pending[step] = _PendingStep(step, loss, now - self.last_commit_t, expected)
        self.last_commit_t = now
        self.committed = step + 1
        del self.losses[step:]
        self.losses.append(loss)
        self._emit_steps()

    def _on_step_report(self, w: _Worker, msg: dict) -> None:
        pending = self.pending.get(msg["step"])
        if pending is not None:
            pending.reports[w.node] = msg | {"node": w.name}
            self._emit_steps()

    def _emit_steps(self) -> None:
        """Write step_done for every committed step whose reports are all in, in order."""
        gone = {w.node for w in self.workers.values() if w.lost or w.retired or w.exited}
        while self.pending:
            first = min(self.pending)
            p = self.pending[first]
            if not (p.expected - gone) <= set(p.reports):
                return
            del self.pending[first]
            self._step_done(p)

    def _step_done(self, p: _PendingStep) -> None:
        reports = sorted(p.reports.values(), key=lambda r: r["rank"])
        record = {"step": p.step, "loss": p.loss, "wall_s": p.wall_s,
                  "grad_norm": reports[0]["grad_norm"] if reports else None,
                  "lr": reports[0]["lr"] if reports else None,
                  "attempts": max((r["attempts"] for r in reports), default=1),
                  "nodes": [self._node_timers(r) for r in reports]}
        self.step_records.append(record)
        self.events.write("step_done", **record)
        self._check_digests(reports, p.step)
        self._close_failures(p.step, reports)
        samples = self.cfg.global_micro_batches * self.cfg.micro_batch_size
        self.display.step(p.step, p.loss, samples / max(p.wall_s, 1e-9),
                          [1000 * r["step_s"] for r in reports])

    @staticmethod
    def _node_timers(r: dict) -> dict:
        keys = ("step_s", "compute_s", "frc_s", "wait_s", "reduce_s", "optim_s")
        return {"node": r["node"], "stages": r["stages"]} | \
            {k: round(r[k], 6) for k in keys} | \
            {k: r[k] for k in ("bytes_sent", "bytes_replica", "saved_bytes", "frc_saved_bytes",
                               "state_bytes")}

    def _check_digests(self, reports: list[dict], step: int) -> None:
        if not self.check_replicas:
            return
        primaries, replicas = {}, {}
        for r in reports:
            for name, digest in r["digests"].items():
                (replicas if name.startswith("replica") else primaries)[
                    (self.roles.pipeline_of(r["rank"]), int(name.removeprefix("replica")
                                                           .removeprefix("stage")))] = digest
        for key, digest in replicas.items():
            if key in primaries and primaries[key] != digest:
                self._fail(f"replica of stage {key[1]} in pipeline {key[0]} differs from its "
                           f"primary after step {step}")
        self.events.write("replicas_checked", step=step, replicas=len(replicas))

    # -- step boundaries: checkpoints and reconfiguration -----------------------------------

    def _boundary_flags(self, step: int) -> list[str]:
        flags = []
        nxt = step + 1
        if nxt >= self.cfg.steps:
            return flags
        every = self.cfg.checkpoint_every
        if every and (nxt % every == 0 or self.checkpoint_due_on_notice):
            flags.append("ckpt")
            self.checkpoint_due_on_notice = False
        reason = self._reconfiguration_reason()
        if reason:
            self._reconf_reason = reason
            flags.append("reconf")
        return flags

    def _standbys(self) -> list[_Worker]:
        return [w for w in self.workers.values() if w.ready and w.rank is None and not w.exited
                and not (w.lost or w.noticed or w.left or w.retired or w.fenced)
                and w.kill_at is None]

    def _reconfiguration_reason(self) -> str | None:
        """Why the generation should end at this boundary, if it should."""
        members = self._live_members()
        active = [w for w in members if w.rank is not None and w.rank < self.plan.active
                  and w.rank in self._live_active()]
        draining = [w for w in active if w.noticed]
        if draining:
            return "drain " + ", ".join(w.name for w in draining)
        standbys = self._standbys()
        d, p = self._layout_for(len(active) + len(standbys))
        if d * p > len(active):
            return f"{len(standbys)} standby node(s) join: {d} x {p} layout"
        exposed = self._exposed_stages() if self.rc else []
        if exposed and p > 1 and d * p >= len(active):
            return (f"stage{'s' if len(exposed) > 1 else ''} {', '.join(map(str, exposed))} "
                    f"left with one copy: rebalance onto a {d} x {p} layout")
        return None

    def _exposed_stages(self) -> list[int]:
        """Stages whose only live copy is one node (a second loss would need a checkpoint).

        This is the risk trigger: with one pipeline, a failover leaves the shadow's two
        stages without replicas, so the planner spreads the layers over the survivors and
        every stage has a replica again. With more pipelines, the peers' copies cover it."""
        gone = {w.rank for w in self.workers.values() if w.lost and w.rank is not None}
        exposed = []
        for s in range(self.roles.stages):
            copies = {self.roles.holders[d][s] for d in range(self.roles.pipelines)} | \
                {self.roles.replicas[d][s] for d in range(self.roles.pipelines)}
            if len(copies - gone - {None}) <= 1:
                exposed.append(s)
        return exposed

    def _layout_for(self, nodes: int) -> tuple[int, int]:
        return choose_layout(nodes, stages=self.cfg.stages, layers=len(self.param_counts),
                             global_micro_batches=self.cfg.global_micro_batches,
                             max_pipelines=self.cfg.pipelines)

    def _begin_reconfiguration(self, reason: str, *, abandoned: bool) -> None:
        ending = self._active_members()  # leaving sources send `left`, not `gen_end`
        if self.reconf is not None:  # a loss while one is already under way
            self.reconf.ending &= ending
            self.reconf.abandoned |= abandoned
            return
        self.reconf = _Reconfiguration(reason=reason, started=time.monotonic(), ending=ending,
                                       abandoned=abandoned)
        self.events.write("reconfiguration_start", reason=reason, step=self.committed,
                          abandoned=abandoned, gen=self.plan.gen)
        self._say(f"reconfiguring at step {self.committed}: {reason}")

    def _abandon(self, reason: str) -> None:
        """End the generation mid-step: every survivor drops the step under way."""
        old_epoch = self.roles.epoch
        new = RoleMap.from_json(self.roles.to_json())
        new.epoch += 1
        new.takeovers = []
        new.abandon = True
        new.dead = sorted(set(new.dead) | {w.rank for w in self.workers.values()
                                           if w.lost and w.rank is not None})
        self.roles = new
        self.store.set(f"epoch/{new.epoch}", new.to_json())
        self._set(f"go/{self.committed}/{old_epoch}", "abort")
        self._set(f"decide/{self.committed}/{old_epoch}", "redo")
        self.round_failed_at = None
        self._begin_reconfiguration(reason, abandoned=True)

    def _active_members(self) -> set[int]:
        return {x.node for x in self._live_members() if x.rank is not None
                and x.rank < self.plan.active}

    def _generation_running(self) -> bool:
        """Every live active member has its state and trains."""
        return self.gen_ready >= self._active_members()

    def _on_gen_ready(self, w: _Worker, msg: dict) -> None:
        if msg["gen"] != self.plan.gen or self.reconf is not None:
            return
        self.gen_ready.add(w.node)
        if self._generation_running():
            took = time.monotonic() - self.gen_started
            self.events.write("generation_ready", gen=self.plan.gen, took_s=round(took, 4))
            if self.reconf_times and self.reconf_times[-1]["gen"] == self.plan.gen:
                self.reconf_times[-1]["setup_s"] = took
                self.reconf_times[-1]["total_s"] = time.monotonic() - self.reconf_times[-1]["t"]
            if self.trace_t0 is None:
                self.trace_t0 = time.monotonic()
                self.last_commit_t = self.trace_t0
            if self.step_begins_pending is not None:
                self._step_begins(self.step_begins_pending)
                self.step_begins_pending = None

    def _on_gen_end(self, w: _Worker, msg: dict) -> None:
        if msg["gen"] != self.plan.gen:
            return
        if self.reconf is None:
            # A transfer failed: the generation cannot start; plan the next one.
            self._abandon(f"state transfer failed ({msg.get('failed')})")
        if msg.get("step") == self.committed:  # else held at another step: not usable
            self.reconf.holdings[w.node] = set(msg["layers"])
        self.reconf.ending.discard(w.node)

    def _try_plan(self) -> None:
        """Publish the next generation once every live member of the old one has ended it."""
        r = self.reconf
        if r is None or r.ending:
            return
        names = {w.node: w.name for w in self.workers.values()}
        old_members = [self._member(i) for i in range(len(self.plan.members))]
        if r.restarting is not None and not all(self.workers[n].ready or self.workers[n].exited
                                                for n in r.restarting):
            return  # checkpoint-restart: wait for the fresh workers
        staying = [w for w in old_members
                   if not (w.lost or w.left or w.noticed or w.retired or w.fenced or w.exited)
                   and w.rank is not None and w.rank < self.plan.active]
        nodes = [w.name for w in staying] + [w.name for w in self._standbys()]
        leaving = [w.name for w in old_members if w.noticed and not w.lost and not w.left]
        holdings = {names[n]: layers for n, layers in r.holdings.items()
                    if not self.workers[n].lost}
        if not nodes:
            if self.replay is None or self.replay.finished:
                self._fail(self._last_words(r, "no live node is left to train on and none is "
                                               "coming"), exit_code=3)
            return  # wait for the trace to add nodes
        kwargs = dict(gen=self.plan.gen + 1, epoch=self.roles.epoch + 1, nodes=nodes,
                      holdings=holdings, leaving=leaving, stages=self.cfg.stages,
                      param_counts=self.param_counts,
                      global_micro_batches=self.cfg.global_micro_batches, redundancy=self.rc,
                      max_pipelines=self.cfg.pipelines, reason=r.reason)
        handled = "peer_restore"
        try:
            plan = plan_generation(start_step=self.committed, **kwargs)
        except NoLiveCopy as e:
            plan = self._checkpoint_plan(kwargs, str(e))
            handled = "checkpoint_restore"
        for f in r.lost:
            f.handled_as = handled if f.handled_as == "pending" else f.handled_as
        self.reconfigurations += 1
        decided = time.monotonic()
        moved = sum(3 * self.param_counts[layer] + 1 for layer, _, _ in plan.transfers) * 4
        self.reconf = None
        self._enter(plan)
        self.reconf_times.append({"gen": plan.gen, "t": r.started, "decision_s": decided - r.started,
                                  "bytes": moved, "from_nodes": len(old_members),
                                  "to_nodes": plan.active})
        self.events.write("reconfigured", gen=plan.gen, reason=r.reason, step=plan.start_step,
                          pipelines=plan.pipelines, stages=plan.stages, members=plan.members,
                          leavers=plan.leavers, transfers=len(plan.transfers), bytes=moved,
                          checkpoint=plan.checkpoint, parts=plan.parts)
        self._say(f"generation {plan.gen}: {plan.pipelines} pipeline(s) x {plan.stages} stage(s) "
                  f"on {plan.active} node(s) from step {plan.start_step}"
                  + (f", {len(plan.transfers)} layer state(s) moved" if plan.transfers else "")
                  + (f", restored from {Path(plan.checkpoint).name}" if plan.checkpoint else ""))

    def _checkpoint_plan(self, kwargs: dict, why: str) -> GenerationPlan:
        root = checkpoint_root(self.rundir.path)
        if not root.exists() and self.resume is not None:
            root = self.resume.path.parent
        try:
            ckpt = load_latest(root)
        except CheckpointError as e:
            if self.cfg.recovery == "checkpoint-restart" and self.reconf and self.reconf.restarting:
                return self._fresh_start_plan(kwargs)  # no checkpoint yet: from step 0
            self._fail(self._last_words(self.reconf, f"{why} and {e}"), exit_code=3)
        if ckpt.warning:
            self._say(ckpt.warning)
            self.events.write("checkpoint_fallback", warning=ckpt.warning)
        redone = self.committed - ckpt.step
        self.redone_steps += redone
        self.events.write("checkpoint_restore", checkpoint=str(ckpt.path), step=ckpt.step,
                          redone_steps=redone)
        self.committed = ckpt.step
        del self.losses[ckpt.step:]
        self.pending = {k: v for k, v in self.pending.items() if k < ckpt.step}
        return plan_generation(start_step=ckpt.step, checkpoint=str(ckpt.path), **kwargs)

    def _fresh_start_plan(self, kwargs: dict) -> GenerationPlan:
        self.redone_steps += self.committed
        self.events.write("checkpoint_restore", checkpoint=None, step=0,
                          redone_steps=self.committed)
        self.committed = 0
        self.losses.clear()
        self.pending.clear()
        plan = plan_generation(start_step=0, checkpoint="", **kwargs)
        plan.checkpoint = None  # every worker is fresh: layers built from the seed
        return plan

    def _last_words(self, r: _Reconfiguration | None, detail: str) -> str:
        """The one line a run that cannot continue stops with."""
        head = r.why if r is not None and r.why else detail
        hint = "" if self.cfg.checkpoint_every else \
            " (with --checkpoint-every K it would restart from a checkpoint instead)"
        return f"{head}{hint}"

    def _on_checkpoint_part(self, msg: dict) -> None:
        step = msg["step"]
        parts = self.checkpoint_parts.setdefault(step, {})
        parts.update(msg["layers"])
        if len(parts) < len(self.param_counts):
            return
        del self.checkpoint_parts[step]
        meta = {"unit": "layer", "model": self.cfg.model, "seed": self.cfg.seed,
                "global_micro_batches": self.cfg.global_micro_batches,
                "micro_batch_size": self.cfg.micro_batch_size, "steps": self.cfg.steps,
                "losses": self.losses[:step]}
        start = time.monotonic()
        try:
            path = save_checkpoint(checkpoint_root(self.rundir.path), step,
                                   {i: {"state": v} for i, v in parts.items()}, {}, meta)
        except CheckpointError as e:
            self.events.write("checkpoint_failed", step=step, error=str(e))
            self._say(f"warning: {e}")
            return
        self.last_checkpoint = path
        self.events.write("checkpoint", step=step, path=str(path),
                          took_s=round(time.monotonic() - start, 4))

    # -- notices, kills and the trace -------------------------------------------------------

    def _on_notice(self, w: _Worker, source: str) -> None:
        if w.noticed or w.lost:
            return
        w.noticed = True
        self.events.write("notice", node=w.name, source=source, step=self.committed,
                          role=self._where(w))
        self._say(f"node {w.name} ({self._where(w)}) got a preemption notice ({source}); it "
                  f"drains at the next step boundary")
        if self.cfg.checkpoint_every:
            self.checkpoint_due_on_notice = True

    def _preempt(self, w: _Worker, why: str) -> None:
        """A cloud takes `w` away: SIGKILL now, or a notice (SIGTERM) and SIGKILL later."""
        if w.exited or w.lost:
            return
        notice = self.cfg.notice_s
        self.events.write("preempt", node=w.name, why=why, notice_s=notice)
        if notice is None:
            w.process.kill()
            return
        w.kill_at = time.monotonic() + notice
        if hasattr(w.process, "terminate_notice"):  # an agent on another machine
            w.process.terminate_notice()
            return
        try:
            os.kill(w.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def _step_begins(self, step: int) -> None:
        """`--kill D:S@K+notice`: notice the holder of (D, S) as step K begins; a `--kill`
        naming a stage no node holds by then (the layout changed) is reported."""
        for k in self.cfg.kills:
            if k.step != step:
                continue
            if k.pipeline >= self.roles.pipelines or k.stage >= self.roles.stages:
                self.events.write("kill_unmatched", kill=str(k), step=step,
                                  layout=[self.roles.pipelines, self.roles.stages])
                self._say(f"warning: --kill {k} names no node in step {step}: the layout is "
                          f"now {self.roles.pipelines} x {self.roles.stages}")
                continue
            if k.notice and str(k) not in self.fired_kills:
                self.fired_kills.add(str(k))
                holder = self._member(self.roles.holders[k.pipeline][k.stage])
                self._preempt(holder, f"--kill {k}")

    def _tick_notices(self) -> None:
        now = time.monotonic()
        for w in self.workers.values():
            if w.kill_at is not None and now >= w.kill_at:
                w.kill_at = None
                if not w.exited:
                    w.process.kill()

    def _tick_trace(self) -> None:
        if self.replay is None or self.trace_t0 is None:
            return
        for ev in self.replay.due(time.monotonic() - self.trace_t0):
            if ev.kind == "add":
                alive = sum(1 for w in self.workers.values() if not w.exited and not w.lost
                            and not w.left and not w.noticed)
                if alive < self.cfg.node_cap:
                    w = self._spawn(first_gen=self.plan.gen + 1, trace_node=ev.node)
                    self.trace_owner[ev.node] = w.node
                else:
                    self.events.write("trace_add_ignored", trace_node=ev.name,
                                      why=f"{alive} nodes alive (--max-nodes {self.cfg.node_cap})")
            else:
                node = self.trace_owner.pop(ev.node, None)
                if node is not None:
                    self._preempt(self.workers[node], f"trace remove {ev.name}")

    # -- lost nodes -------------------------------------------------------------------------

    def _on_exit(self, w: _Worker) -> None:
        w.exited = True
        self._drain(w)
        self.free_slots.append(w.slot)
        if self.reconf is not None:
            self.reconf.ending.discard(w.node)
        code = w.process.exitcode
        if w.retired:
            return
        if w.left:
            self._on_left(w)
            return
        if w.done and code == 0:
            return
        if code is not None and code < 0:
            self._on_lost(w, signal.Signals(-code).name)
            return
        if not w.done:
            self._fail(f"worker {w.name} ({self._where(w)}) exited with code {code} "
                       f"before finishing (see events.jsonl)")

    def _on_left(self, w: _Worker) -> None:
        """A noticed node handed its state over at a step boundary and left: a drain."""
        failure = _Failure(node=w.name, rank=w.rank, step=self.committed, phase="boundary",
                           handled_as="drain", shadow=None, t=time.monotonic() - self.t0,
                           signal="notice")
        self.failures.append(failure)
        self.events.write("node_lost", node=w.name, step=self.committed, phase="boundary",
                          handled_as="drain", pause_s=0.0)
        failure.counts = {"frc_reused": 0, "brc": 0, "resent_grads": 0}

    def _on_lost(self, w: _Worker, signame: str) -> None:
        w.lost = True
        step = self.committed
        if w.rank is not None and self.plan.members[w.rank] == w.name:
            for k in self.cfg.kills:
                if k.step == step and k.pipeline < self.roles.pipelines and \
                        k.stage < self.roles.stages and self.roles.holders[k.pipeline][k.stage] == w.rank:
                    self.fired_kills.add(f"{k.pipeline}:{k.stage}@{k.step}")
        in_gen = w.rank is not None and self.plan.members[w.rank] == w.name
        active = in_gen and w.rank < self.plan.active and w.rank in self._live_active()
        phase = PHASES[self.progress[2 * w.slot + 1]] if self.progress[2 * w.slot] == step \
            else "between steps"
        where = self._where(w)
        if not in_gen:
            self.standby_losses += 1
            self.events.write("node_lost", node=w.name, step=step, phase="standby",
                              handled_as="standby", signal=signame)
            self._say(f"standby node {w.name} lost ({signame})")
            return
        failure = _Failure(node=w.name, rank=w.rank, step=step, phase=phase,
                           handled_as="pending", shadow=None, t=time.monotonic() - self.t0,
                           signal=signame)
        self.failures.append(failure)
        if step >= self.cfg.steps:
            # After the last commit: nothing to redo; the final parameters come from the
            # layers' other copies (every node also reports its replica's parameters).
            failure.handled_as, failure.phase = "failover", "after the last step"
            failure.counts = {"frc_reused": 0, "brc": 0, "resent_grads": 0}
            self.events.write("node_lost", node=w.name, step=step, phase=failure.phase,
                              handled_as="failover", signal=signame, pause_s=0.0)
            return
        if self.reconf is not None or not active or not self._generation_running():
            # Between generations: the next plan covers it from live copies or a checkpoint.
            failure.phase = "reconfiguration"
            self._abandon(f"node {w.name} lost during reconfiguration")
            self.reconf.lost.append(failure)
            if self.cfg.recovery == "checkpoint-restart":
                self._restart_all()
            self._announce(failure, where, "covered by the next generation")
            return
        restoring = any(t.get("source") == w.rank and t.get("kind") == "peer_restore"
                        for t in self.roles.takeovers) and self.restore_step == step
        try:
            if restoring:
                raise Unrecoverable("it was the source of a peer restore under way")
            if not self.rc or self.roles.stages == 1:
                why = ("--redundancy off keeps no copy of its stage" if not self.rc
                       else "a one-stage pipeline keeps no replica")
                raise Unrecoverable(f"{why}, so the run stops here")
            plan = plan_failover(self.roles, w.rank)
        except Unrecoverable as e:
            self.events.write("fault_detected", node=w.name, step=step, phase=phase,
                              signal=signame, handled_as="reconfiguration", error=str(e))
            self._abandon(f"node {w.name} lost in step {step}: {e}")
            self.reconf.lost.append(failure)
            self.reconf.why = f"node {w.name} ({where}) was lost in step {step} ({signame}); {e}"
            if self.cfg.recovery == "checkpoint-restart":
                self._restart_all()
            self._announce(failure, where, "no in-flight copy; the next generation restores it")
            return
        old_epoch = self.roles.epoch
        self.roles = plan.roles
        self.store.set(f"epoch/{self.roles.epoch}", self.roles.to_json())
        self._set(f"go/{step}/{old_epoch}", "abort")
        self._set(f"decide/{step}/{old_epoch}", "redo")
        self.round_failed_at = None
        shadow = plan.takeovers[0].new_holder if plan.takeovers else None
        failure.handled_as = plan.handled_as
        failure.in_flight = True
        if plan.handled_as == "peer_restore":
            self.restore_step = step
        failure.shadow = self._rank_name(shadow)
        self.events.write("fault_detected", node=w.name, step=step, phase=phase, signal=signame,
                          handled_as=plan.handled_as, shadow=failure.shadow,
                          roles=self.roles.holders)
        self._announce(failure, where, f"{plan.handled_as.replace('_', ' ')} by {failure.shadow}")
        self._show_layout()
        self._emit_steps()
        # A role change also completes a go/commit that only the lost node was missing.
        for (s, e), done in list(self.phase_a.items()):
            if e == self.roles.epoch and done >= self._live_active():
                self._set(f"go/{s}/{e}", "go")

    def _restart_all(self) -> None:
        """Checkpoint-restart recovery (the baseline, as torchrun does it): stop every worker,
        start fresh ones in their place, and load the last checkpoint."""
        r = self.reconf
        assert r is not None
        if r.restarting is None:
            r.restarting = set()
        for w in list(self.workers.values()):
            if w.exited or w.lost or w.left or w.retired or w.fenced or w.noticed or \
                    w.kill_at is not None or not w.process.is_alive() or w.node in r.restarting:
                continue  # gone or going: counted when it ends, never restarted
            w.retired = True
            w.process.kill()
            fresh = self._spawn(first_gen=self.plan.gen + 1, trace_node=w.trace_node)
            if w.trace_node is not None and self.trace_owner.get(w.trace_node) == w.node:
                self.trace_owner[w.trace_node] = fresh.node
            r.restarting.add(fresh.node)
        r.ending.clear()
        r.holdings.clear()
        self.events.write("restart_all", step=self.committed, workers=len(r.restarting))

    def _announce(self, f: _Failure, where: str, how: str) -> None:
        self._say(f"node {f.node} ({where}) lost in step {f.step} during {f.phase}; {how}")

    def _close_failures(self, step: int, reports: list[dict]) -> None:
        here = [f for f in self.failures if f.step == step and not f.counts]
        if not here:
            return
        totals = {k: sum(r[k] for r in reports) for k in ("frc_reused", "brc", "resent_grads")}
        extra = max(0.0, self.step_records[-1]["wall_s"] - self._median_clean_step())
        for f in here:
            f.counts = totals if f.in_flight else {"frc_reused": 0, "brc": 0, "resent_grads": 0}
            f.pause_s = extra / len(here)
            self.events.write("node_lost", node=f.node, step=f.step, phase=f.phase,
                              handled_as=f.handled_as, shadow=f.shadow, signal=f.signal,
                              pause_s=round(f.pause_s, 4), **f.counts)

    def _median_clean_step(self) -> float:
        failed = {f.step for f in self.failures}
        clean = [r["wall_s"] for r in self.step_records[1:] if r["step"] not in failed]
        return statistics.median(clean) if clean else 0.0

    def _fail(self, message: str, exit_code: int = 1) -> None:
        self._stop_all()
        for f in self.failures:
            if f.handled_as == "pending":  # the loss that the run could not survive
                f.handled_as = "stopped"
                self.events.write("node_lost", node=f.node, step=f.step, phase=f.phase,
                                  handled_as="stopped", signal=f.signal)
        self.events.write("run_failed", error=message)
        summary = self._summary(status="failed", error=message)
        self.rundir.write_json("summary.json", summary)
        raise RunFailed(message, summary, exit_code)

    # -- results ----------------------------------------------------------------------------

    def _finish(self) -> dict[str, Any]:
        missing = sorted(set(range(len(self.param_counts))) - set(self.params))
        if missing:
            self._fail(f"every node holding layer {missing[0]} was lost after the last step, "
                       f"before it sent its parameters: the trained model is incomplete"
                       + (f"; the last checkpoint is in {checkpoint_root(self.rundir.path)}"
                          if self.last_checkpoint else ""), exit_code=3)
        summary = self._summary(status="completed", error=None)
        self._save_model()
        self.rundir.write_json("summary.json", summary)
        self.events.write("run_done", steps=summary["steps_completed"], wall_s=summary["wall_s"])
        return summary

    def _ordered_params(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for layer_index in sorted(self.params):
            out += [(f"layers.{layer_index}.{n}", t) for n, t in self.params[layer_index]]
        return out

    def _save_model(self) -> None:
        params = self._ordered_params()
        if params:
            buffer = io.BytesIO()
            torch.save(dict(params), buffer)
            write_atomic(self.rundir.path / "model.pt", buffer.getvalue())

    def _summary(self, *, status: str, error: str | None) -> dict[str, Any]:
        params = self._ordered_params()
        l2 = math.sqrt(math.fsum(float(t.double().square().sum()) for _, t in params))
        sha = hashlib.sha256()
        for _, t in params:
            sha.update(t.contiguous().numpy().tobytes())
        steps = len(self.losses)
        batch = self.cfg.global_micro_batches * self.cfg.micro_batch_size
        samples = steps * batch
        here = (steps - (self.resume.step if self.resume else 0)) * batch  # this process's share
        wall = time.monotonic() - self.t0
        kinds = [f.handled_as for f in self.failures]
        step_walls = [r["wall_s"] for r in self.step_records[1:]]
        return {
            "status": status, "error": error,
            "steps_completed": steps, "samples": samples, "losses": self.losses,
            "param_l2": l2 if params else None,
            "param_sha256": sha.hexdigest() if params else None,
            "preemptions": len(self.failures) + self.standby_losses,
            "failovers": kinds.count("failover"), "drains": kinds.count("drain"),
            "peer_restores": kinds.count("peer_restore"),
            "checkpoint_restores": kinds.count("checkpoint_restore"),
            "standby_losses": self.standby_losses, "reconfigurations": self.reconfigurations,
            "redone_steps": self.redone_steps,
            "pause_s": [round(f.pause_s, 4) for f in self.failures],
            "reconfiguration_s": [round(r.get("total_s", float("nan")), 4)
                                  for r in self.reconf_times],
            "resumed_from_step": self.resume.step if self.resume else None,
            "wall_s": wall, "throughput": here / wall if wall > 0 else 0.0,
            "median_step_s": statistics.median(step_walls) if step_walls else None,
            "config": self.cfg.summary_fields(),
        }


def run_local(cfg: JobConfig, run: RunDir, display: ProgressDisplay,
              extra_faults: dict[int, list[Fault]] | None = None,
              debug: bool = False, check_replicas: bool = False,
              resume: Checkpoint | None = None, agents: Any = None,
              membership: Any = None) -> dict[str, Any]:
    """Train `cfg` on a local cluster (or on agents, when `agents` listens for them);
    the summary, or RunFailed."""
    return LocalCluster(cfg, run, display, extra_faults, debug, check_replicas, resume,
                        agents, membership).run()
