"""Where a run's nodes come from (`NodeSource`): worker processes this machine starts
(`LocalWorkers`, `bamboo train`), or agents on other machines that join over the network
(`Agents`, `bamboo coordinator`). The command line picks one and hands it to
`loop.run_job`; the core asks it for nodes, the process loop for the store's address."""
from __future__ import annotations

import queue
import signal
import time
from typing import TYPE_CHECKING, Any, Protocol

from bamboo.config import JobConfig
from bamboo.control.nodes import Node, Supervisor
from bamboo.control.preemptions import Preemptions
from bamboo.control.state import Events, RunContext, Stop

if TYPE_CHECKING:
    from bamboo.fleet.membership import EtcdMembership

__all__ = ["NodeSource", "CoordinatorCore", "LocalWorkers", "Agents"]

_HANG_UP_S = 3.0
"""How long a finished run waits, at most and for all its agents at once, for each agent to
read the run's end and hang up before its connection is closed."""


class CoordinatorCore(Protocol):
    """What a node source uses of the coordinator (`bamboo.control.core.CoordinatorCore` is
    the one): declared here so the sources need not import the core that calls them."""

    cfg: JobConfig
    ctx: RunContext
    nodes: Supervisor
    events: Events
    preemptions: Preemptions

    @property
    def committed(self) -> int:
        """Steps committed so far."""

    def spawn(self, *, first_gen: int, trace_node: int | None = None,
              owns_trace_node: bool = True) -> Node:
        """One more node from the source, announced with its role."""


class NodeSource(Protocol):
    """Where a run's nodes come from (local worker processes, agents, scripted workers)."""

    interrupted: int | None
    """The first of the user's signals, once one came (set by the process loop)."""

    def store_address(self) -> tuple[str, int, str | None]:
        """Where the run's store listens (host, port; 0: any free one) and the address the
        workers are given (None: whatever address each agent joined on)."""

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

    def close(self, final_status: str | None) -> None:
        """The run ended ("completed", "failed"; None: interrupted, or it never started)."""


class LocalWorkers:
    """Worker processes from this machine's fork server (`bamboo train`)."""

    interrupted: int | None = None

    def store_address(self) -> tuple[str, int, str | None]:
        return "127.0.0.1", 0, "127.0.0.1"

    def initial(self, core: CoordinatorCore) -> None:
        replay = core.preemptions.replay
        for trace_node in (replay.initial if replay is not None
                           else [None] * core.cfg.layout.nodes):
            core.spawn(first_gen=0, trace_node=trace_node)

    def start_node(self, core: CoordinatorCore, first_gen: int) -> Node:
        return core.nodes.spawn_local(first_gen=first_gen)

    def poll(self, core: CoordinatorCore) -> None:
        death = core.nodes.fork_server_death()
        if death is not None:
            raise Stop(death)

    def none_coming(self, core: CoordinatorCore) -> bool:
        return True  # only the trace adds local workers (`Preemptions.trace_finished`)

    def awaited(self, core: CoordinatorCore) -> str:
        return "the trace to add a node"

    def close(self, final_status: str | None) -> None:
        pass


class Agents:
    """Workers of agents that join (`bamboo coordinator`), and with --etcd their leases."""

    def __init__(self, listener: Any, membership: EtcdMembership | None = None) -> None:
        self.listener, self.membership = listener, membership
        """The join listener (`fleet.remote.AgentListener`) and, with --etcd, the leases."""
        self.interrupted: int | None = None
        self.remote: list[Any] = []
        """RemoteAgents: the machines whose workers are nodes."""

    def store_address(self) -> tuple[str, int, str | None]:
        """The fixed --store-port on the listener's address (all interfaces for a wildcard
        bind), advertised as --advertise, or the bind address, or (a wildcard bind) as
        whatever address each agent joined on."""
        bind, _ = self.listener.address
        wildcard = bind in ("0.0.0.0", "::", "")
        return (bind or "0.0.0.0", self.listener.store_port,
                self.listener.advertise or (None if wildcard else bind))

    def initial(self, core: CoordinatorCore) -> None:
        """The first `--nodes` workers the joining agents offer (progress every 2 s); short
        of them after --join-timeout, the run stops (exit code 1)."""
        if self.membership is not None:
            self.membership.watch(lambda ev: ev.kind == "expired"
                                  and core.nodes.expired.append(ev.node_id))
        count, nodes = core.cfg.layout.nodes, core.nodes.nodes
        host, port = self.listener.address
        timeout_s = self.listener.join_timeout_s
        core.ctx.say(f"waiting for {count} worker(s) on {host}:{port}: bamboo agent --join "
                     f"{host}:{port} --token-file <the job's token file> [--workers K]")
        start = last = time.monotonic()
        while len(nodes) < count:
            signum = self.interrupted
            if signum is not None:
                raise Stop(f"interrupted by {signal.Signals(signum).name} while waiting for "
                           f"agents", exit_code=128 + signum)
            try:
                channel, hello = self.listener.joined.get(timeout=0.2)
            except queue.Empty:
                channel = None
            if channel is not None:
                self._admit(core, channel, hello, first_gen=0, limit=count - len(nodes))
            now = time.monotonic()
            refused = self.listener.refused
            if now - start > timeout_s:
                raise Stop(f"{len(nodes)}/{count} workers joined within --join-timeout "
                           f"{timeout_s:g} s ({len(self.remote)} agent(s)"
                           + (f", {refused} refused for a wrong token" if refused else "")
                           + "): start more agents, or lower --nodes", exit_code=1)
            if now - last > 2.0:
                last = now
                core.ctx.say(f"  {len(nodes)}/{count} workers joined from "
                             f"{len(self.remote)} agent(s)"
                             + (f", {refused} refused (wrong token)" if refused else ""))

    def start_node(self, core: CoordinatorCore, first_gen: int) -> Node:
        raise Stop("a run on agents cannot start a worker itself (the command line refuses "
                   "--trace and checkpoint-restart with agents)")

    def poll(self, core: CoordinatorCore) -> None:
        """Agents that join while the job runs give standbys; so does a GPU whose worker
        ended while its machine stayed."""
        next_gen = core.ctx.plan.gen + 1
        while not self.listener.joined.empty():
            channel, hello = self.listener.joined.get()
            self._admit(core, channel, hello, first_gen=next_gen)
        for agent in self.remote:
            if agent.spares and not agent.gone and core.committed < core.cfg.training.steps:
                agent.spares -= 1
                self._start_workers(core, agent, first_gen=next_gen, limit=1)

    def none_coming(self, core: CoordinatorCore) -> bool:
        """Agents may still join (a machine replaced, restarted) until --join-timeout has
        passed since the reconfiguration began."""
        r = core.ctx.reconf
        return r is not None and core.ctx.clock() - r.started > self.listener.join_timeout_s

    def awaited(self, core: CoordinatorCore) -> str:
        connected = [a for a in self.remote if not a.gone]
        if not connected:
            return (f"an agent to join (none is connected; --join-timeout "
                    f"{self.listener.join_timeout_s:g} s)")
        stuck = sum(len(a.workers) for a in connected)
        return (f"an agent to offer a worker ({len(connected)} connected, none with a free "
                f"worker slot" + (f"; {stuck} of their workers were fenced and never confirmed "
                                  f"gone" if stuck else "") + ")")

    def close(self, final_status: str | None) -> None:
        """At the end: a finished or failed run lets its agents go; an interrupted one (a
        coordinator being restarted) just closes, and its agents try to rejoin."""
        for agent in self.remote:
            if final_status is None:
                agent.lost()
            else:
                agent.finish(final_status)
        if final_status is not None:  # each agent reads its end before its connection goes
            deadline = time.monotonic() + _HANG_UP_S
            for agent in self.remote:
                agent.closed_by(deadline)
        # agents that rejoined but were not admitted yet (or finish their handshake now)
        # are told too: else they would try to rejoin a coordinator that is gone for good
        self.listener.close(final_status)
        if self.membership is not None:
            self.membership.close()

    def _admit(self, core: CoordinatorCore, channel: Any, hello: Any, *, first_gen: int,
               limit: int | None = None) -> None:
        from bamboo.fleet.remote import RemoteAgent
        agent = RemoteAgent(channel, hello, core.nodes.progress)
        self.remote.append(agent)
        started = self._start_workers(core, agent, first_gen=first_gen, limit=limit)
        if started:
            core.ctx.say(f"agent {agent.machine} joined from {channel.peer}: "
                         f"{', '.join(n.name for n in started)}")

    def _start_workers(self, core: CoordinatorCore, agent: Any, *, first_gen: int,
                       limit: int | None) -> list[Node]:
        m = self.membership
        etcd = {"url": m.url, "job": m.job} if m is not None else None
        started = core.nodes.admit_agent(agent, first_gen=first_gen, etcd=etcd, limit=limit)
        for n in started:  # roles come with the first plan (placed across machines): `role`
            core.events.write("node_up", node=n.name, pid=n.process.pid, host=n.process.host,
                              machine=n.machine, worker=n.process.index,
                              pipeline=None, stage=None)
        return started
