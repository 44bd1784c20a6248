"""`bamboo agent --join ADDR:PORT`: one machine's workers, for a coordinator elsewhere.

The agent joins the coordinator (a token handshake, bamboo.protocol.frames), receives one
`Job` per worker it is given (worker k uses the machine's GPU k), starts the workers
(the same `worker_main` the local cluster forks), relays their reports and heartbeats,
and reports preemption notices (cloud metadata endpoints, or SIGTERM from Kubernetes'
preStop / the termination grace period) so the coordinator drains its nodes.

The coordinator pings every second. When it goes away (the connection ends, or nothing
arrives for the job's lease), the agent kills its workers at once (their state lives on
in the other nodes and the checkpoints) and tries to join again with backoff for
`--rejoin-s` seconds, so a restarted coordinator finds its machines again; past that it
exits. Its workers die with its fork server, which dies with the agent; a fork server
killed alone takes its workers along, and they are reported killed (lost nodes), not
failed. `Finished` from the coordinator ends the agent with exit code 0; a drain on a notice
with 3 (`EXIT_DRAINED`), so a controller replaces the machine.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.sharedctypes import RawArray
from typing import Any

from bamboo.node.output import AGENT_LOG_DIR
from bamboo.protocol.agent_wire import JoinError, Objects, install_objects, register_wire_types
from bamboo.protocol.frames import Channel, Refusal, WireError, client_handshake
from bamboo.protocol.messages import (
    Beat,
    Done,
    Exit,
    Finished,
    FromWorker,
    Hello,
    Job,
    KillOrder,
    Notice,
    NoticeOrder,
    Progress,
    Refused,
)

__all__ = ["run_agent", "AgentOptions", "EXIT_DRAINED"]

EXIT_DRAINED = 3
"""The agent drained on a preemption notice: its machine is going away. Distinct from 0
(the run finished) so a controller replaces a drained machine but not a finished one."""

_BEAT_S = 0.5
_CONNECT_S = 10.0
_IO_S = 10.0
_NO_JOB_LEASE_S = 30.0
"""Silence tolerated from a coordinator before it sent the job's lease."""


@dataclasses.dataclass(kw_only=True)
class AgentOptions:
    address: tuple[str, int]
    token: str
    workers: int = 1
    rejoin_s: float = 300.0
    notice_sources: list[str] = dataclasses.field(default_factory=list)
    metadata_url: str | None = None
    log_dir: str = AGENT_LOG_DIR
    """Where each worker's stdout and stderr go (`n<id>.log`, `bamboo.node.output`)."""
    say: Callable[[str], None] = lambda text: None
    machine: str | None = None
    """The machine's name in the job (default HOST-PID; a Ray actor names its Ray node)."""
    parent_pid: int | None = None
    """Exit, and take the workers along, when this process (the agent's starter: a Ray actor)
    is gone."""


class _EtcdPresence:
    """The node's lease in etcd, renewed by a heartbeat thread (`--etcd` jobs): when this
    machine freezes or vanishes, etcd expires the lease and the coordinator's watch sees it."""

    def __init__(self, membership: Any, node_id: str, token: str, info: dict) -> None:
        self.membership, self.node_id = membership, node_id
        self.lease = membership.join(node_id, info, token)
        self._stop = threading.Event()
        threading.Thread(target=self._beat, daemon=True, name="etcd-heartbeat").start()

    def _beat(self) -> None:
        period = max(0.2, self.lease.ttl_s / 3)
        while not self._stop.wait(period):
            try:
                self.membership.heartbeat(self.node_id)
            except Exception:  # noqa: BLE001 - expired or unreachable: the coordinator decides
                return

    def stop(self) -> None:
        self._stop.set()
        try:
            self.membership.leave(self.node_id)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        self.membership.close()


def _join_membership(etcd: dict | None, node: int, token: str, say: Any) -> _EtcdPresence | None:
    if not etcd:
        return None
    from bamboo.node.membership import EtcdMembership, MembershipError
    try:
        m = EtcdMembership.connect(etcd["url"], job=etcd["job"])
        presence = _EtcdPresence(m, f"n{node}", token, {"host": socket.gethostname(),
                                                        "pid": os.getpid()})
    except MembershipError as e:
        raise JoinError(str(e)) from None
    say(f"registered in etcd at {etcd['url']} (lease {presence.lease.ttl_s:g} s)")
    return presence


class _Worker:
    """One worker process of this agent (local index k)."""

    def __init__(self, k: int, job: Job, opts: AgentOptions, progress: Progress) -> None:
        from bamboo.node import forkserver
        from bamboo.node.worker import worker_main
        self.k = k
        self.spec = dataclasses.replace(job.spec, slot=k, device_index=k,
                                        local_workers=opts.workers,
                                        store_host=job.spec.store_host or opts.address[0])
        progress.reset(k, time.monotonic() + 60.0)
        ctx = forkserver.context()
        self.reader, writer = ctx.Pipe(duplex=False)
        self.log = os.path.abspath(os.path.join(opts.log_dir, f"{self.spec.name}.log"))
        self.process = ctx.Process(target=worker_main, args=(self.spec, writer, progress.beats,
                                                             progress.cells, self.log),
                                   name=f"bamboo-n{self.spec.node}")
        self.process.start()
        self.server = forkserver.server_pid()
        """The fork server that forked it (a later worker may come from a restarted one)."""
        writer.close()
        self.finished = False
        self.membership = _join_membership(job.etcd, self.spec.node, opts.token, opts.say)

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        if self.membership is not None:
            self.membership.stop()
            self.membership = None


class _Session:
    """One connection to the coordinator, from the handshake to its end."""

    def __init__(self, opts: AgentOptions, channel: Channel, noticed: list[str]) -> None:
        self.opts, self.channel, self.noticed = opts, channel, noticed
        self.workers: dict[int, _Worker] = {}
        slots = opts.workers
        self.beats = RawArray("d", [time.monotonic() + 60.0] * slots)
        self.cells = RawArray("i", [0] * Progress.cells_for(slots))
        self.progress = Progress(self.beats, self.cells)
        self.lease_s = _NO_JOB_LEASE_S
        self.heard = time.monotonic()
        self.reported: set[int] = set()
        self.had_job = False
        self.all_done = False
        self.object_parts: dict[str, list[bytes]] = {}
        """The parts received so far of each large object sent by value (`Objects`)."""

    def send(self, msg: Any) -> None:
        self.channel.send(msg)

    def run(self) -> str:
        """'finished' (the run is over), 'done' (every worker finished the last step),
        'drained' (a notice, and every worker left), 'refused' (the job is full), or
        'lost' (the coordinator went away)."""
        say = self.opts.say
        last_beat = 0.0
        try:
            while True:
                readers = {w.reader: w for w in self.workers.values()}
                sentinels = {w.process.sentinel: w for w in self.workers.values()}
                ready = wait([self.channel, *readers, *sentinels], timeout=_BEAT_S / 2)
                if self.channel in ready:
                    outcome = self._order(self.channel.recv(timeout=self.lease_s))
                    if outcome is not None:
                        return outcome
                for obj in ready:
                    if obj in readers:
                        self._forward(readers[obj])
                for obj in ready:
                    if obj in sentinels:
                        self._ended(sentinels[obj])
                if self.noticed:
                    self._report_notice()
                    if self.had_job and not self.workers:
                        return "drained"  # every worker handed its state over and left
                now = time.monotonic()
                if now - self.heard > self.lease_s and not wait([self.channel], timeout=0):
                    say(f"the coordinator has been silent for {now - self.heard:.1f} s")
                    return "done" if self._run_over() else "lost"
                if now - last_beat >= _BEAT_S and self.workers:
                    last_beat = now
                    self.send(Beat(slots=[[k, max(0.0, now - self.beats[k]),
                                           self.progress.step_of(k), self.progress.phase_of(k)]
                                          for k in self.workers]))
        except (OSError, EOFError, WireError) as e:
            if isinstance(e, WireError):
                say(f"unreadable message from the coordinator ({e})")
            return "done" if self._run_over() else "lost"
        finally:
            for w in self.workers.values():
                w.stop()

    def _run_over(self) -> bool:
        """Every worker of this machine finished the last step (reported Done): a coordinator
        gone quiet now is one that is finishing, not one to rejoin."""
        return self.all_done or (bool(self.workers) and
                                 all(w.finished for w in self.workers.values()))

    def _order(self, msg: Any) -> str | None:
        self.heard = time.monotonic()
        if isinstance(msg, Job):
            self.had_job = True
            self.lease_s = max(2.0, float(msg.lease_s))
            if msg.worker in self.workers or not 0 <= msg.worker < self.opts.workers:
                return None
            w = _Worker(msg.worker, msg, self.opts, self.progress)
            self.workers[msg.worker] = w
            self.opts.say(f"worker {msg.worker} is node n{w.spec.node} (its output: {w.log})")
        elif isinstance(msg, Objects):
            return self._objects(msg)
        elif isinstance(msg, KillOrder):
            w = self.workers.get(msg.worker)
            if w is not None and w.process.is_alive():
                w.process.kill()
        elif isinstance(msg, NoticeOrder):
            w = self.workers.get(msg.worker)
            if w is not None:
                self.send(FromWorker(worker=w.k, msg=Notice(rank=w.spec.node, source=msg.source)))
        elif isinstance(msg, Finished):
            self.opts.say(f"the run ended ({msg.status})")
            return "finished"
        elif isinstance(msg, Refused):
            self.opts.say(f"the coordinator has no room for this machine: {msg.why}")
            return "refused"
        return None

    def _objects(self, msg: Objects) -> str | None:
        """Keep the job's objects sent by value for the workers; 'refused' (this
        coordinator is not trusted: the agent ends) when one fails its checks."""
        from bamboo.config.objects import ObjectError
        try:
            kept = install_objects(msg, self.opts.token, self.object_parts)
        except (ObjectError, OSError) as e:
            self.opts.say(f"refused the job's objects: {e}")
            return "refused"
        if kept:
            self.opts.say(f"received {len(kept)} object(s) sent by value")
        return None

    def _forward(self, w: _Worker) -> None:
        """Relay every report waiting on the worker's pipe. A pipe that ended (the worker
        died mid-write) is its sentinel's business; a failed send means the coordinator is
        gone, and propagates."""
        while True:
            try:
                if not w.reader.poll():
                    return
                msg = w.reader.recv()
            except (EOFError, OSError):
                return
            w.finished |= isinstance(msg, Done)
            self.send(FromWorker(worker=w.k, msg=msg))

    def _ended(self, w: _Worker) -> None:
        self._forward(w)
        w.process.join()
        code = w.process.exitcode
        code = self._fork_server_loss(w, code)
        self.workers.pop(w.k).stop()
        self.send(Exit(worker=w.k, code=code))
        self.all_done = w.finished and not self.workers

    def _fork_server_loss(self, w: _Worker, code: int | None) -> int | None:
        """A worker whose exit status never came (code 255) because the fork server died:
        it was killed with it (SIGKILL, its parent-death signal), which the coordinator
        handles as a lost node; the next worker starts a fresh server."""
        from bamboo.node import forkserver
        if code != forkserver.LOST_SERVER_EXIT:
            return code
        how = forkserver.server_death(wait_s=2.0, pid=w.server)
        if how is None:
            return code
        self.opts.say(f"the fork server (pid {w.server}) {how}: worker {w.k} "
                      f"(node n{w.spec.node}) died with it")
        return -signal.SIGKILL

    def _report_notice(self) -> None:
        for w in self.workers.values():
            if w.k not in self.reported:
                self.reported.add(w.k)
                self.send(FromWorker(worker=w.k, msg=Notice(rank=w.spec.node,
                                                            source=self.noticed[0])))
                self.opts.say(f"preemption notice ({self.noticed[0]}): worker {w.k} drains at "
                              f"the next step boundary")


def _connect(opts: AgentOptions) -> Channel:
    host, port = opts.address
    sock = socket.create_connection((host, port), timeout=_CONNECT_S)
    channel = Channel(sock, io_timeout=_CONNECT_S)
    hello = Hello(pid=os.getpid(), host=socket.gethostname(), workers=opts.workers,
                  machine=opts.machine or f"{socket.gethostname()}-{os.getpid()}")
    try:
        client_handshake(channel, opts.token, dataclasses.asdict(hello), _CONNECT_S)
        channel.set_io_timeout(_IO_S)
    except BaseException:
        channel.close()
        raise
    return channel


def run_agent(opts: AgentOptions) -> int:
    """Join, serve sessions until the run is finished or the coordinator stays away for
    `rejoin_s`; the exit code."""
    register_wire_types()
    # torch's C++ store and sockets warn (or log an error) for every peer that vanishes or
    # has no resolvable name (hosts sharing one host name): the coordinator reports what
    # matters. TORCH_CPP_LOG_LEVEL=ERROR in the environment shows them.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    from bamboo.node import forkserver
    forkserver.start()  # torch imports in the background while the agent joins
    if opts.parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(opts.parent_pid, opts.say),
                         daemon=True, name="parent-watch").start()
    noticed: list[str] = []
    signal.signal(signal.SIGTERM, lambda *_: noticed.append("SIGTERM"))
    watcher = None
    sources = [s for s in opts.notice_sources if s != "sigterm"]
    if sources:
        from bamboo.node.notices import NoticeWatcher, make_source
        watcher = NoticeWatcher([make_source(s, opts.metadata_url) for s in sources],
                                lambda n: noticed.append(n.source)).start()
    try:
        return _serve(opts, noticed)
    finally:
        if watcher is not None:
            watcher.stop()


def _exit_with_parent(parent: int, say: Callable[[str], None]) -> None:
    """End this agent at once when `parent` is gone (re-parented): its fork server and
    workers go with it, as on a machine that vanished."""
    while os.getppid() == parent:
        time.sleep(0.2)
    say(f"the process that started this agent (pid {parent}) is gone: stopping")
    os.kill(os.getpid(), signal.SIGKILL)


def _serve(opts: AgentOptions, noticed: list[str]) -> int:
    """Join and rejoin until the run is over, a notice drains this machine, or the
    coordinator stays away for `rejoin_s`; the exit code."""
    host, port = opts.address
    say = opts.say
    away_since = time.monotonic()
    backoff = 0.5
    joined_once = False
    last_error = ""
    while True:
        try:
            channel = _connect(opts)
        except Refusal as e:
            if "token" in str(e):
                raise JoinError(f"the coordinator at {host}:{port} refused the join token: "
                                f"use the token it printed (its run directory's join-token "
                                f"file)") from None
            raise JoinError(f"the coordinator at {host}:{port} refused this agent: {e}") from None
        except (OSError, EOFError, WireError) as e:
            last_error = getattr(e, "strerror", None) or str(e) or type(e).__name__
            channel = None
        if channel is not None:
            say(f"{'rejoined' if joined_once else 'joined'} {host}:{port} with "
                f"{opts.workers} worker slot(s)")
            joined_once = True
            session = _Session(opts, channel, noticed)
            outcome = session.run()
            channel.close()
            if outcome in ("finished", "done"):
                return 0
            if outcome == "drained" or noticed:  # going away: nothing to rejoin for
                say("stopped after a preemption notice")
                return EXIT_DRAINED
            say("lost the coordinator; its workers are stopped" if outcome == "lost"
                else "no room in the job yet")
            away_since, backoff = time.monotonic(), 0.5
            last_error = "it went away" if outcome == "lost" else "the job was full"
        if noticed and not joined_once:
            return EXIT_DRAINED
        away = time.monotonic() - away_since
        if away >= opts.rejoin_s:
            if not joined_once:
                raise JoinError(f"cannot reach the coordinator at {host}:{port} "
                                f"({last_error}): is `bamboo coordinator` running there?"
                                + (f" (tried for {opts.rejoin_s:g} s)" if opts.rejoin_s else ""))
            say(f"the coordinator at {host}:{port} has been away for {away:.0f} s "
                f"(--rejoin-s {opts.rejoin_s:g}): giving up")
            return 1
        time.sleep(min(backoff, max(0.0, opts.rejoin_s - away)))
        backoff = min(backoff * 2, 5.0)
