"""Nodes as workers of agents on other machines (`bamboo coordinator`, `bamboo agent --join`).

`open_join` opens the way in: the join listener on --bind with the job's token and, with
--etcd, the membership whose leases fence a silent node. An agent that joins offers one room
a GPU (`Offer`); a worker started there is a `RemoteProcess` (`bamboo.launch.agent_link`),
which the coordinator handles as it does a local process. A worker that ends while its
machine stays frees a room again (a spare); the end of an agent's connection is the end of
all its workers at once (a machine loss).
"""
from __future__ import annotations

import os
import queue
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bamboo.launch.agent_link import AgentListener, RemoteAgent, RemoteProcess
from bamboo.protocol.agent_wire import JoinError
from bamboo.protocol.launch import LaunchError, Offer, Started, StoreAddress, WorkerSpec
from bamboo.protocol.messages import Progress, Refused

if TYPE_CHECKING:
    from bamboo.config.join import JoinConfig
    from bamboo.node.membership import EtcdMembership, MembershipEvent

__all__ = ["Agents", "JoinError", "open_join", "write_join_token"]

_HANG_UP_S = 3.0
"""How long a finished run waits, at most and for all its agents at once, for each agent to
read the run's end and hang up before its connection is closed."""


class Agents:
    """Workers of agents that join, and with --etcd their leases."""

    on_demand = False

    def __init__(self, listener: AgentListener, membership: EtcdMembership | None = None
                 ) -> None:
        self.listener, self.membership = listener, membership
        self.remote: list[RemoteAgent] = []
        """The machines whose workers are nodes."""
        self._expired: list[tuple[str, str]] = []
        if membership is not None:
            membership.watch(self._on_membership)

    def store_address(self) -> StoreAddress:
        """The fixed --store-port on the listener's address (all interfaces for a wildcard
        bind), advertised as --advertise, or the bind address, or (a wildcard bind) as
        whatever address each agent joined on."""
        bind, _ = self.listener.address
        wildcard = bind in ("0.0.0.0", "::", "")
        return StoreAddress(bind or "0.0.0.0", self.listener.store_port,
                            self.listener.advertise or (None if wildcard else bind))

    def start(self, spec: WorkerSpec, heartbeats: Progress, offer: Offer | None = None
              ) -> Started:
        if offer is None:
            raise LaunchError("a run on agents cannot start a worker itself (the command line "
                              "refuses --trace and checkpoint-restart with agents)")
        agent: RemoteAgent = offer.ticket
        agent.progress = heartbeats
        m = self.membership
        etcd = {"url": m.url, "job": m.job} if m is not None else None
        process: RemoteProcess = agent.start_worker(spec, spec.slot, etcd,
                                                    spec.config.runtime.lease_s)
        return Started(process, process.reader, host=process.host, machine=agent.machine,
                       device_slot=process.index, worker=process.index)

    def offers(self, timeout_s: float = 0.0) -> list[Offer]:
        """A room for each free GPU of every agent that joined since the last call (waiting
        up to `timeout_s` for one), and one for each worker of a connected agent that ended
        while its machine stayed (a spare)."""
        rooms: list[Offer] = []
        for agent in self.remote:
            rooms += [Offer(agent.machine, spare=True, ticket=agent)
                      for _ in range(agent.take_spares())]
        joined = self.listener.joined
        try:
            arrived = [joined.get(timeout=timeout_s) if timeout_s > 0 else joined.get_nowait()]
        except queue.Empty:
            arrived = []
        while not joined.empty():
            arrived.append(joined.get())
        for channel, hello in arrived:
            agent = RemoteAgent(channel, hello)
            self.remote.append(agent)
            arrival = f"agent {agent.machine} joined from {channel.peer}"
            rooms += [Offer(agent.machine, arrival=arrival, ticket=agent) for _ in agent.free]
        return rooms

    def decline(self, offer: Offer, why: str) -> str | None:
        """An agent given no worker at all is told why; it retries while its --rejoin-s
        lasts. A room of an agent that has workers stays unused; a spare is offered again
        on the next call (the run may decline it only because the loss that freed it is
        not handled yet, and may need it a moment later)."""
        agent: RemoteAgent = offer.ticket
        if offer.spare:
            agent.give_back_spare()
            return None
        if agent.workers or agent.gone:
            return None
        agent.send(Refused(why=why))
        agent.lost()
        return agent.hello.host

    def _on_membership(self, event: MembershipEvent) -> None:
        if event.kind == "expired":
            self._expired.append((event.node_id, "etcd lease expired"))

    def expired(self) -> list[tuple[str, str]]:
        names, self._expired = self._expired, []
        return names

    def broken(self, exit_code: int | None = None) -> str | None:
        return None  # each agent is one machine: its loss is its workers' ends, no more

    def waiting(self, count: int) -> str | None:
        host, port = self.listener.address
        return (f"waiting for {count} worker(s) on {host}:{port}: bamboo agent --join "
                f"{host}:{port} --token-file <the job's token file> [--workers K]")

    def progress(self, started: int, count: int) -> str:
        refused = self.listener.refused
        return (f"  {started}/{count} workers joined from {len(self.remote)} agent(s)"
                + (f", {refused} refused (wrong token)" if refused else ""))

    def gave_up(self, started: int, count: int) -> str:
        refused = self.listener.refused
        return (f"{started}/{count} workers joined within --join-timeout "
                f"{self.listener.join_timeout_s:g} s ({len(self.remote)} agent(s)"
                + (f", {refused} refused for a wrong token" if refused else "")
                + "): start more agents, or lower --nodes")

    def patience_s(self) -> float:
        return self.listener.join_timeout_s

    def awaited(self) -> str:
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


def write_join_token(path: Path, token: str | None = None) -> str:
    """`token` (default: a fresh one) stored readable by its owner only (0600), whole or not
    at all: a script waiting for the file never reads half a token."""
    token = token or secrets.token_hex(16)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return token


def open_join(join: JoinConfig, run_path: Path,
              lease_s: float) -> tuple[AgentListener, EtcdMembership | None, str | None]:
    """`bamboo coordinator`'s way in for agents: the join listener on --bind with the job's
    token (--token-file, or a fresh one written to `run_path`/join-token once the listener
    is up) and, with --etcd, the membership. (listener, membership or None, the line that
    tells the user the generated token, or None); JoinError (one line) when it cannot."""
    token_file = Path(join.token_file) if join.token_file else run_path / "join-token"
    generated = not token_file.exists()
    if generated:
        token = secrets.token_hex(16)
    else:
        token = token_file.read_text().strip()
        if len(token) < 16:
            raise JoinError(f"--token-file {token_file} holds a token of {len(token)} "
                            f"characters: use at least 16 (openssl rand -hex 32)")
    run_path.mkdir(parents=True, exist_ok=True)
    try:
        listener = AgentListener(join.address(), token, advertise=join.advertise,
                                 store_port=join.store_port, join_timeout_s=join.join_timeout_s)
    except OSError as e:
        raise JoinError(f"cannot listen on {join.bind} ({e.strerror or e}): choose another "
                        f"--bind") from None
    if generated:  # only now: whoever waits for the file may connect at once
        write_join_token(token_file, token)
    membership = None
    if join.etcd:
        from bamboo.node.membership import EtcdMembership, MembershipError
        try:
            membership = EtcdMembership.host(join.etcd, token, job=run_path.resolve().name,
                                             ttl_s=min(3.0, lease_s))
        except MembershipError as e:
            listener.close()
            if generated:  # leave nothing behind for a job that never started
                token_file.unlink(missing_ok=True)
                if not any(run_path.iterdir()):
                    run_path.rmdir()
            raise JoinError(str(e)) from None
    announce = None if join.token_file else \
        f"join token: {token} (also in {token_file}, mode 0600)"
    return listener, membership, announce


