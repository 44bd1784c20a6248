"""Supervision of nodes: worker processes started here and agents on other machines.

Every node is a `Node` record with one `NodeState` and a process handle: a local worker
from the fork server, or a `RemoteProcess` that makes an agent look like one. Both come in
through one path (`Supervisor.admit`). The supervisor owns the shared heartbeat/progress
arrays, fences nodes whose heartbeat lease ran out (or whose etcd lease expired) with
SIGKILL, and answers the questions the other parts ask: who is a live member of the
generation, who waits as a standby, who may be planned.
"""
from __future__ import annotations

import enum
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import RawArray
from pathlib import Path
from typing import Any

from bamboo.control.kills import Kills
from bamboo.control.state import RunContext
from bamboo.protocol.launch import Launcher, LaunchError, Offer, ReportChannel, WorkerSpec
from bamboo.protocol.messages import Progress

__all__ = ["NodeState", "Node", "Supervisor", "START_GRACE_S", "LOCAL_START_GRACE_S"]

START_GRACE_S = 60.0
"""The heartbeat lease of an agent's worker before its first beat (it may import torch
itself: seconds on two busy cores)."""

LOCAL_START_GRACE_S = 8.0
"""The same for a local worker, counted from the moment the warm fork server forked it
(torch is already imported there): it beats within about a second here, so one frozen as
it starts is fenced after this plus `--lease`, not after a minute."""


def _oom_killed(pid: int, path: str = "/dev/kmsg") -> bool:
    """Whether the kernel log has the OOM killer's "Killed process PID" line."""
    needle = f"Killed process {pid} ".encode()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                return False
            except OSError:  # EPIPE: a record was overwritten while reading; go on
                continue
            if not record:
                return False
            if needle in record:
                return True
    finally:
        os.close(fd)


class NodeState(enum.Enum):
    STARTING = "starting"
    """The process runs; it has not said it is ready."""
    READY = "ready"
    """Up: a member of a generation, or a standby."""
    NOTICED = "noticed"
    """A preemption notice arrived: it drains at the next step boundary."""
    FENCED = "fenced"
    """Silent past its lease: killed by the coordinator; its exit is a loss."""
    RETIRED = "retired"
    """Stopped by the coordinator itself (checkpoint-restart restarts every worker)."""
    LEFT = "left"
    """Drained: handed its state over and left."""
    DONE = "done"
    """Finished the last step."""
    LOST = "lost"
    """Its process ended by a signal: preempted (or fenced)."""


@dataclass(frozen=True, slots=True)
class EndedProcess:
    """What is left of a node's process once its exit is handled: its pid and exit code.
    The real handle (a local process's sentinel, an agent worker's pipes) is closed, so a
    long run that loses many nodes holds no descriptor for any of them."""

    pid: int | None
    exitcode: int | None
    host: str | None = None
    """The agent's host, for a worker of another machine (None: a local process)."""

    @staticmethod
    def of(process: Any) -> EndedProcess:
        ended = EndedProcess(process.pid, process.exitcode, getattr(process, "host", None))
        process.close()
        return ended

    def is_alive(self) -> bool:
        return False

    def kill(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass


@dataclass(slots=True)
class Node:
    node: int
    slot: int
    process: Any
    conn: ReportChannel
    trace_node: int | None = None
    state: NodeState = NodeState.STARTING
    exited: bool = False
    """The process is gone (whatever the state says about why)."""
    rank: int | None = None
    """Rank in the current generation's process group; None while not a member."""
    kill_at: float | None = None
    """A preemption with notice: SIGKILL at this time."""
    kill_sent: bool = False
    """The coordinator sent (or ordered) its SIGKILL."""
    machine: str | None = None
    """The machine it shares with other nodes (an agent's; None: a local worker, a machine
    of its own)."""
    host: str | None = None
    """The host it runs on, where that is not this one."""
    device_slot: int | None = None
    """Its slot on its machine (its GPU, `WorkerSpec.device_index`)."""
    own_processor: bool = False
    """Its `Ready` said it has a processor of its own (see `protocol.Ready`)."""
    labels: dict[str, str] = field(default_factory=dict)
    """What its launcher says of where it runs (`Started.labels`), in its node events."""

    @property
    def name(self) -> str:
        return f"n{self.node}"

    @property
    def pid_local(self) -> int | None:
        """The pid of a worker process on this machine (None for an agent's)."""
        return None if getattr(self.process, "host", None) is not None else self.process.pid

    @property
    def is_gone(self) -> bool:
        """No longer part of the run (its last words may still be in its pipe)."""
        return self.state in (NodeState.LOST, NodeState.LEFT, NodeState.RETIRED)

    @property
    def is_alive(self) -> bool:
        """Counts against --max-nodes."""
        return not self.exited and self.state is not NodeState.LOST

    @property
    def is_leased(self) -> bool:
        """Its heartbeat is watched (a silent one is fenced); a DONE node too, since an
        abandon after the last step waits for its `GenerationEnd`."""
        return not self.exited and self.state in (NodeState.STARTING, NodeState.READY,
                                                  NodeState.NOTICED, NodeState.DONE)

    @property
    def can_stay(self) -> bool:
        """May be planned into the next generation."""
        return not self.exited and self.state in (NodeState.STARTING, NodeState.READY) and \
            self.kill_at is None

    @property
    def is_standby(self) -> bool:
        return self.rank is None and self.state is NodeState.READY and not self.exited and \
            self.kill_at is None


class Supervisor:
    """The nodes of the run and their processes."""

    def __init__(self, ctx: RunContext, slots: int, kills: Kills, store_host: str | None,
                 launcher: Launcher) -> None:
        self.ctx, self.launcher = ctx, launcher
        self.kills = kills
        """Which faults a new worker starts with."""
        self.store_host = store_host
        """The store's address the workers are given (None: whatever address each agent
        joined on)."""
        now = ctx.clock()
        self.beats = RawArray("d", [now + START_GRACE_S] * slots)
        self.cells = RawArray("i", [0] * Progress.cells_for(slots))
        self.progress = Progress(self.beats, self.cells)
        self.free_slots = list(range(slots))
        self.nodes: dict[int, Node] = {}
        self.next_node = 0


    def __iter__(self) -> Iterator[Node]:
        return iter(list(self.nodes.values()))

    def __getitem__(self, node: int) -> Node:
        return self.nodes[node]

    def by_name(self, name: str) -> Node:
        return self.nodes[int(name[1:])]

    def alive_count(self) -> int:
        return sum(1 for n in self.nodes.values() if n.is_alive)

    def standbys(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.is_standby]

    def coming(self) -> list[Node]:
        """Nodes started and not yet up: each says it is ready within its start lease, or
        is fenced, so a reconfiguration with no node to plan waits for them."""
        return [n for n in self.nodes.values() if n.state is NodeState.STARTING and
                n.rank is None and not n.exited and n.kill_at is None and not n.kill_sent]

    # -- admission --------------------------------------------------------------------------

    def _take_slot(self) -> tuple[int, int]:
        node, self.next_node = self.next_node, self.next_node + 1
        slot = self.free_slots.pop(0)
        self.progress.reset(slot, self.ctx.clock() + START_GRACE_S)
        return node, slot

    def admit(self, *, first_gen: int, trace_node: int | None = None,
              offer: Offer | None = None) -> Node:
        """Take a node id and a slot and have the launcher start the node (in `offer`'s
        room; None: on demand); LaunchError, with nothing taken, when it cannot."""
        node, slot = self._take_slot()
        ctx = self.ctx
        spec = WorkerSpec(node=node, slot=slot, first_gen=first_gen,
                          store_host=self.store_host or "",  # "": the address each agent joined on
                          store_port=ctx.store.port,  # type: ignore[attr-defined]  # the run's store is a TCPStore, whose port torch types loosely
                          config=ctx.cfg, faults=self.kills.faults_for(node, first_gen))
        try:
            started = self.launcher.start(spec, self.progress, offer)
        except LaunchError:
            self.next_node -= 1
            self.free_slots.insert(0, slot)
            raise
        grace = START_GRACE_S if started.machine is not None else LOCAL_START_GRACE_S
        self.progress.reset(slot, ctx.clock() + grace)  # from now: the process exists
        n = Node(node, slot, started.process, started.reports, trace_node=trace_node,
                 machine=started.machine, host=started.host, device_slot=started.device_slot,
                 labels=dict(started.labels))
        self.nodes[node] = n
        return n

    def log_path(self, name: str) -> Path:
        """Where the local worker `name` writes its stdout and stderr (`bamboo.node.output`)."""
        from bamboo.node.output import LOG_DIR
        return self.ctx.run_path.resolve() / LOG_DIR / f"{name}.log"

    # -- liveness ---------------------------------------------------------------------------

    def check_leases(self) -> None:
        """Fence every leased node silent for longer than --lease, or whose etcd lease
        expired: SIGKILL now, and its exit is handled as a loss."""
        now = self.ctx.clock()
        for n in self:
            silent = now - self.beats[n.slot]
            if n.is_leased and silent > self.ctx.cfg.runtime.lease_s and n.process.is_alive():
                self.fence(n, f"stopped answering for {silent:.1f} s", silent_s=round(silent, 2))
        for name, why in self.launcher.expired():
            n = self.nodes.get(int(name[1:])) if name[1:].isdigit() else None
            if n is not None and n.is_leased:
                self.fence(n, why, why=why)

    def heard_from(self, n: Node) -> None:
        """A message from `n` is also a heartbeat."""
        self.beats[n.slot] = max(self.beats[n.slot], self.ctx.clock())

    def set_state(self, n: Node, state: NodeState) -> None:
        """The one place a node's state changes (see `NodeState` for what each means)."""
        n.state = state

    def fence(self, n: Node, what: str, **fields: Any) -> None:
        self.set_state(n, NodeState.FENCED)
        n.kill_sent = True
        self.ctx.events.write("fenced", node=n.name, **fields)
        self.ctx.say(f"node {n.name} {what}; fenced with SIGKILL")
        n.process.kill()

    def kill(self, n: Node, *, at: float | None = None) -> None:
        """SIGKILL `n` now, or (a notice given) once the clock reaches `at` (`kill_due`)."""
        n.kill_sent = True
        if at is None:
            n.process.kill()
        else:
            n.kill_at = at

    def kill_due(self, now: float) -> None:
        """The SIGKILL of every node whose notice ran out."""
        for n in self:
            if n.kill_at is not None and now >= n.kill_at:
                n.kill_at = None
                if not n.exited:
                    n.process.kill()

    def retire(self, n: Node) -> None:
        """Stop `n` for good (checkpoint-restart replaces every worker): its exit is no loss."""
        self.set_state(n, NodeState.RETIRED)
        self.kill(n)

    def ready(self, n: Node, own_processor: bool) -> None:
        """`n` said it is up (`Ready`): a member or a standby from now on."""
        n.own_processor = own_processor
        if n.state is NodeState.STARTING:
            self.set_state(n, NodeState.READY)
        self.heard_from(n)

    @staticmethod
    def plays(n: Node, trace_node: int | None) -> None:
        """`n` plays trace node `trace_node` (`--trace`; None: no trace node)."""
        n.trace_node = trace_node

    def launcher_broken(self, code: int | None = None) -> str | None:
        """Why every node of the launcher died at once (its fork server ended), asked when a
        node exited with `code`; None while it works."""
        return self.launcher.broken(code)

    @staticmethod
    def oom_killed(n: Node) -> bool:
        """The kernel log says its OOM killer killed `n`'s process (a local worker; False
        where the log cannot be read)."""
        return isinstance(n.pid_local, int) and _oom_killed(n.pid_local)

    def exited(self, n: Node) -> None:
        """The process of `n` is gone: free its slot."""
        n.exited = True
        self.free_slots.append(n.slot)

    @staticmethod
    def release(n: Node) -> None:
        """`n`'s exit is handled: close its pipe and its process handle (descriptors)."""
        n.conn.close()
        if not isinstance(n.process, EndedProcess):
            n.process = EndedProcess.of(n.process)

    def stop_all(self) -> None:
        for n in self.nodes.values():
            if n.process.is_alive():
                n.process.kill()
        deadline = time.monotonic() + 5
        for n in self.nodes.values():
            n.process.join(timeout=max(0.0, deadline - time.monotonic()))
