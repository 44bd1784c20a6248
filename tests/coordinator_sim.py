"""A cluster without processes: the real coordinator core, driven by scripted workers.

`SimCluster` starts a `CoordinatorCore` through its public API (`start`, `handle`,
`node_exited`, `tick`) with a dict store, a list of events and a fake clock, and plays
every worker by the protocol (reading the store through `bamboo.protocol.messages`'s
keys): vote micro-batches done and the commit round for each step under the newest role epoch, report the step, end a generation with the
layers it holds, enter the next one. Losses, notices, joins and checkpoints are methods,
so a test can put them anywhere, including while a generation forms. No torch process,
no sockets: a scenario runs in milliseconds.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bamboo.config import JobConfig
from bamboo.control.core import CoordinatorCore
from bamboo.control.nodes import Node, NodeState
from bamboo.control.state import Stop
from bamboo.launch.local import LocalWorkers
from bamboo.plan.planner import GenerationPlan
from bamboo.plan.roles import RoleMap
from bamboo.protocol.launch import Offer, Started, WorkerSpec
from bamboo.protocol.messages import (
    CheckpointPart,
    Done,
    GenerationEnd,
    GenerationReady,
    LayerParams,
    Left,
    MicroBatchesDone,
    Notice,
    Ready,
    RoundDone,
    StepReport,
    decide_key,
    epoch_key,
    final_request_key,
    go_key,
    plan_key,
)
from bamboo.run.checkpoint import checkpoint_location, final_dir, step_dir, write_layers
from bamboo.run.writers import stages_written_by


class DictStore:
    port = 0

    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self.data)


class ListEvents:
    def __init__(self) -> None:
        self.items: list[dict] = []
        self.bytes_written = 0

    def write(self, event: str, **fields: Any) -> dict:
        record = {"event": event, **json.loads(json.dumps(fields, default=str))}
        self.items.append(record)
        return record

    def close(self) -> None:
        pass

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.items if e["event"] == kind]


class QuietDisplay:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def message(self, text: str) -> None:
        self.lines.append(text)

    def layout(self, rows: Any, standbys: Any = ()) -> None:
        pass

    def step(self, *args: Any) -> None:
        pass

    def evaluation(self, step: int, loss: float) -> None:
        self.lines.append(f"eval after {step} steps: loss {loss:.4f}")

    def close(self) -> None:
        pass


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class FakeProcess:
    pid: int
    exitcode: int | None = None
    sentinel: int = -1

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        if self.exitcode is None:
            self.exitcode = -9

    notices: int = 0

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate_notice(self) -> None:
        self.notices += 1

    def close(self) -> None:
        assert self.exitcode is not None, "closed while running"


class FakePipe:
    """A node's pipe: the simulation hands messages to the handlers directly."""

    closed = False

    def close(self) -> None:
        self.closed = True


@dataclass
class SimWorker:
    """What a worker process would know: its generation, roles and held layers."""

    node: Node
    gen: float = -1
    epoch: int = -1
    layers: set[int] | None = None
    held_step: int = -1
    said_ready: bool = False
    frozen: bool = False
    """SIGSTOP: it neither beats nor sends (its process stays alive until fenced)."""


class SimNodes(LocalWorkers):
    """The simulation's launcher: local workers as the real one brings them, each a
    scripted worker with a fake process."""

    def __init__(self, sim: SimCluster) -> None:
        super().__init__()
        self.sim = sim

    def start(self, spec: WorkerSpec, heartbeats: Any, offer: Offer | None = None) -> Started:
        self.sim.started.append(spec.node)
        return Started(FakeProcess(pid=10_000 + spec.node), FakePipe())  # type: ignore[arg-type]  # a pipe the simulation never reads


class SimCluster:
    def __init__(self, cfg: JobConfig, run_dir: Path, *, work: dict[str, float] | None = None,
                 own_processor: bool = False) -> None:
        """`work`: timers (compute_s, wait_s, optim_s, ...) every step report carries, with
        the stages its node holds; without it a report names no stage and times nothing.
        `own_processor`: what every worker's `Ready` says."""
        self.cfg = cfg
        self.work, self.own_processor = work, own_processor
        self.clock = FakeClock()
        run_dir.mkdir(parents=True, exist_ok=True)
        self._workers: dict[int, SimWorker] = {}
        self.started: list[int] = []
        """Nodes the launcher started that have no scripted worker yet."""
        self.stopped: str | None = None
        self.core = CoordinatorCore(cfg.replace(out=str(run_dir.resolve())), run_dir,
                                    QuietDisplay(), SimNodes(self))
        self.store, self.events = DictStore(), ListEvents()
        self.core.start(self.store, self.events, self.clock, store_host="sim")
        self._say_ready()

    # -- processes --------------------------------------------------------------------------

    @property
    def workers(self) -> dict[int, SimWorker]:
        """The scripted worker of every node started so far."""
        while self.started:
            node = self.started.pop(0)
            self._workers[node] = SimWorker(self.core.nodes[node])
        return self._workers

    def _admit(self, first_gen: int) -> SimWorker:
        node = self.core.nodes.admit(first_gen=first_gen)
        return self.workers[node.node]

    def join(self) -> SimWorker:
        """A new node starts (a trace add, an agent) and waits as a standby."""
        w = self._admit(first_gen=self.ctx.plan.gen + 1)
        self._say_ready()
        return w

    def kill(self, *nodes: int) -> None:
        """SIGKILL from outside: the processes are gone, all of them before the coordinator
        handles the first exit (nodes killed together)."""
        for node in nodes:
            self.workers[node].node.process.exitcode = -9
        for node in nodes:
            if not self.workers[node].node.exited:  # else handled while syncing the others
                self._guard(self.core.node_exited, self.workers[node].node)

    def notice(self, node: int) -> None:
        self._send(self.workers[node], Notice(rank=node, source="test"))

    def freeze(self, node: int) -> None:
        """SIGSTOP from outside: the process lives on, silent."""
        self.workers[node].frozen = True

    def _send(self, w: SimWorker, msg: Any) -> None:
        if not w.node.exited and not w.frozen:
            self._beat(w)
            self._guard(self.core.handle, w.node, msg)

    def _pass_time(self, seconds: float = 0.25) -> None:
        """The clock moves on; every live worker beats meanwhile."""
        self.clock.t += seconds
        for w in self.workers.values():
            if not w.node.exited and not w.frozen:
                self._beat(w)

    def _beat(self, w: SimWorker) -> None:
        """A message is also a heartbeat (a real worker beats every half second)."""
        self.core.nodes.heard_from(w.node)

    def _guard(self, fn: Any, *args: Any) -> None:
        if self.stopped is not None:
            return
        try:
            fn(*args)
        except Stop as e:  # as the coordinator's loop does: account, summarise, stop
            self.stopped = str(e)
            self.failed = self.core.fail(str(e))
            return
        self._sync_processes()

    def _say_ready(self) -> None:
        """A worker the coordinator started (a trace add, a restart) comes up and says so."""
        for w in list(self.workers.values()):
            if not w.said_ready and not w.node.exited:
                w.said_ready = True
                self._send(w, Ready(rank=w.node.node, own_processor=self.own_processor))

    def _sync_processes(self) -> None:
        """The coordinator's SIGKILLs (fences, restarts) end the processes it names, and the
        workers it started come up."""
        for w in list(self.workers.values()):
            n = w.node
            if not n.exited and n.process.exitcode is not None:
                self._guard(self.core.node_exited, n)
        self._say_ready()

    # -- the protocol, played by every live worker ------------------------------------------

    @property
    def ctx(self) -> Any:
        return self.core.ctx

    def _plan(self, gen: int) -> GenerationPlan | None:
        text = self.store.data.get(plan_key(gen))
        return GenerationPlan.from_json(text) if text else None

    def _roles(self) -> RoleMap:
        return RoleMap.from_json(self.store.data[epoch_key(self.ctx.roles.epoch)])

    def _members(self, plan: GenerationPlan) -> list[SimWorker]:
        return [self.workers[int(n[1:])] for n in plan.members]

    def _layers_of(self, plan: GenerationPlan, roles: RoleMap, rank: int) -> set[int]:
        stages = roles.stages_of(rank)
        replica = roles.replica_of(rank) if plan.redundancy != "off" else None
        out: set[int] = set()
        for s in stages + ([replica] if replica is not None else []):
            out |= set(range(*plan.parts[s]))
        return out

    def enter_generation(self) -> None:
        """Members of the newest plan that have not entered it report ready."""
        plan = self._plan(self.ctx.plan.gen)
        roles = self._roles()
        for rank, w in enumerate(self._members(plan)):
            if w.node.exited or w.gen == plan.gen:
                continue
            if rank >= plan.active:
                self._send(w, Left(rank=rank, gen=plan.gen))
                w.node.process.exitcode = 0
                self._guard(self.core.node_exited, w.node)
                continue
            w.gen, w.epoch = plan.gen, plan.epoch
            w.layers, w.held_step = self._layers_of(plan, roles, rank), plan.start_step
            self._send(w, GenerationReady(rank=rank, gen=plan.gen, stages=[], replica=None))
        for name in plan.leavers:
            w = self.workers[int(name[1:])]
            if not w.node.exited and name not in plan.members:
                self._send(w, Left(rank=w.node.node, gen=plan.gen))
                w.node.process.exitcode = 0
                self._guard(self.core.node_exited, w.node)

    def end_generation(self) -> None:
        """Every live member of the ending generation reports what it holds."""
        plan = self._plan(self.ctx.plan.gen)
        for rank, w in enumerate(self._members(plan)):
            if w.node.exited or w.gen > plan.gen or rank >= plan.active:
                continue
            if w.gen < plan.gen:  # still forming: it reports the last boundary's state
                self._send(w, GenerationEnd(rank=rank, gen=plan.gen, layers=sorted(w.layers or ()),
                                            step=w.held_step, failed="abandoned while forming"))
            else:
                roles = self._roles()
                layers = self._layers_of(plan, roles, rank) if not roles.abandon else w.layers
                self._send(w, GenerationEnd(rank=rank, gen=plan.gen, layers=sorted(layers or ()),
                                            step=self.ctx.committed))
            w.gen = plan.gen + 0.5  # ended; waits for the next plan

    def settle(self) -> None:
        """Let the coordinator plan, and the workers follow, until a generation runs (a
        reconfiguration that waits for nodes lets a quarter of a second pass each round)."""
        for attempt in range(40):
            if self.stopped is not None:
                return
            if self.ctx.reconf is not None:
                self.end_generation()
                if attempt:
                    self._pass_time()
                self._guard(self.core.tick, self.clock())
            if self.ctx.reconf is None:
                self.enter_generation()
                if self.core.gens.running():
                    return

    def step(self, *, before_round: Any = None) -> None:
        """Every live active node runs the next step to its commit (`before_round`: a
        callback between the two votes, e.g. a loss in the commit phase)."""
        self.settle()
        if self.stopped is not None or self.ctx.committed >= self.cfg.training.steps:
            return
        step = self.ctx.committed
        self._pass_time()  # every step takes a quarter of a second
        self._guard(self.core.tick, self.clock())  # time passed: the trace, leases, stalls
        for _attempt in range(10):
            if self.stopped is not None:
                return
            step = self.ctx.committed  # a restore (the trace's losses) may have gone back
            roles = self._roles()
            ranks = [r for r in roles.active_ranks()
                     if not self.core.gens.member(r).exited]
            for r in ranks:
                self._send(self._worker(r), MicroBatchesDone(rank=r, step=step, epoch=roles.epoch))
            if self.core.store.data.get(go_key(step, roles.epoch)) != "go":
                self.settle()
                continue
            if before_round is not None:
                before_round()
                before_round = None
                if self._roles().epoch != roles.epoch or self.stopped:
                    self.settle()
                    continue
            for r in ranks:
                self._send(self._worker(r), RoundDone(rank=r, step=step, epoch=roles.epoch,
                                                      ok=True, losses=[(r, 1.0 + step, 0.0)]))
            verdict = self.core.store.data.get(decide_key(step, roles.epoch), "")
            if verdict.startswith("commit"):
                plan = self._plan(self.ctx.plan.gen)
                for r in ranks:
                    w = self._worker(r)
                    w.layers = self._layers_of(plan, roles, r)
                    timed = dict(stages=roles.stages_of(r), **self.work) if self.work else \
                        dict(stages=[])
                    self._send(w, StepReport(rank=r, step=step, **timed))
                if "ckpt" in verdict:
                    self._checkpoint(step + 1, roles, ranks)
                return
            self.settle()
            if self.stopped is not None or self.ctx.committed != step:
                return
        raise AssertionError(f"step {step} never committed")

    def _worker(self, rank: int) -> SimWorker:
        return self.workers[self.core.gens.member(rank).node]

    def _checkpoint(self, step: int, roles: RoleMap, ranks: list[int]) -> None:
        """Each stage's first live holder writes its layers (the workers' own rule,
        `bamboo.run.writers`), then reports them durable."""
        plan = self._plan(self.ctx.plan.gen)
        for r in ranks:
            mine = sorted(i for s in stages_written_by(roles, r, roles.stages_of(r))
                          for i in range(*plan.parts[s]))
            if mine:
                write_layers(step_dir(checkpoint_location(self.ctx.cfg), step),
                             {i: {"state": torch.zeros(1)} for i in mine})
                self._send(self._worker(r), CheckpointPart(rank=r, step=step, layers=mine))

    def finish(self) -> None:
        while self.stopped is None and self.ctx.committed < self.cfg.training.steps:
            self.step()
        self.settle()
        if self.stopped is not None:
            return
        self.final_writes()

    def final_writes(self, lost_before_writing: int | None = None, *, serve: bool = True) -> None:
        """After the last step each stage's first live holder writes its layers (the
        workers' own rule, `bamboo.run.writers`); node `lost_before_writing` is killed first
        (after the last commit, before its write: no new roles follow the last step)."""
        if lost_before_writing is not None:
            self.kill(lost_before_writing)
        final = final_dir(checkpoint_location(self.ctx.cfg), self.ctx.end_step)
        roles, plan = self.ctx.roles, self.ctx.plan
        for r in roles.active_ranks():
            w = self._worker(r)
            if w.node.exited:
                continue
            mine = sorted(i for s in stages_written_by(roles, r, roles.stages_of(r))
                          for i in range(*plan.parts[s]))
            if mine:
                write_layers(final, {i: {"param.w": torch.zeros(1)} for i in mine})
            self._send(w, LayerParams(rank=r, layers=mine))
            self._send(w, Done(rank=r))
        if serve:  # else a copy asked to write has not written yet
            self.serve_final_requests()
        else:
            self._guard(self.core.finished)  # the core asks while it cannot finish

    def serve_final_requests(self) -> None:
        """A live worker asked to write final layers from its copy (their first holder was
        lost after the last step) writes them and reports them, as `worker.py` does."""
        final = final_dir(checkpoint_location(self.ctx.cfg), self.ctx.end_step)
        self._guard(self.core.finished)  # the core asks while it cannot finish
        for w in self.workers.values():
            text = self.store.data.get(final_request_key(w.node.name))
            if text is None or w.node.exited:
                continue
            layers = json.loads(text)
            write_layers(final, {i: {"param.w": torch.zeros(1)} for i in layers})
            self._send(w, LayerParams(rank=w.node.rank, layers=layers))

    # -- what the tests check ---------------------------------------------------------------

    def check_invariants(self) -> None:
        """Roles name only live nodes for every stage while the run goes on."""
        if self.stopped is not None or self.ctx.reconf is not None:
            return
        roles = self.ctx.roles
        for d in range(roles.pipelines):
            for s in range(roles.stages):
                holder = self.core.gens.member(roles.holders[d][s])
                assert holder.state is not NodeState.LOST or holder.rank in roles.dead, \
                    f"stage {s} of pipeline {d} is held by lost {holder.name} outside dead"

    def lost_events(self) -> list[dict]:
        return self.events.of("node_lost")
