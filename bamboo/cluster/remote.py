"""Several machines: `bamboo coordinator --bind ADDR:PORT` and `bamboo agent --join ADDR:PORT`.

The coordinator listens on ADDR:PORT (127.0.0.1 unless told otherwise) with
`multiprocessing.connection.Listener`, whose HMAC challenge makes every agent prove it
knows the job's join token before a single message is read: a wrong token is refused
at the door. The token is generated once, printed once and stored with 0600
permissions in the run directory (`join-token`).

An agent is one node: it receives the job and its node id, starts the worker process
(the same `worker_main` the local cluster forks), forwards the worker's reports,
stamps a heartbeat every half second with the worker's own heartbeat age and
progress, and reports preemption notices (cloud metadata endpoints, or SIGTERM from
Kubernetes' preStop / the termination grace period) so the coordinator drains the node.

On the coordinator, `RemoteProcess` makes an agent look like a local worker process
(pid, sentinel, kill, exit code), so one supervisor serves both.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import secrets
import signal
import socket
import threading
import time
from multiprocessing.connection import Client, Connection, Listener, wait
from multiprocessing.sharedctypes import RawArray
from pathlib import Path
from typing import Any

from bamboo.cluster.protocol import (Beat, Done, Exit, Hello, Job, KillOrder, Notice, NoticeOrder,
                                     Progress, Refused)

__all__ = ["JoinError", "parse_address", "write_join_token", "AgentListener", "RemoteProcess",
           "run_agent"]

_BEAT_S = 0.5


class JoinError(RuntimeError):
    """An agent could not join; str() is the one line for the user."""


def parse_address(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{flag} '{text}' is not ADDRESS:PORT (e.g. 127.0.0.1:29400)")
    return host, int(port)


def write_join_token(path: Path) -> str:
    """A fresh token, stored readable by its owner only (0600)."""
    token = secrets.token_hex(16)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return token


class AgentListener:
    """Accepts agents on a background thread; authenticated connections land in `joined`."""

    def __init__(self, address: tuple[str, int], token: str) -> None:
        self.listener = Listener(address, authkey=token.encode())
        self.address = self.listener.address
        self.joined: queue.Queue[tuple[Connection, Hello]] = queue.Queue()
        self.refused = 0
        threading.Thread(target=self._accept, daemon=True, name="agent-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except mp.AuthenticationError:
                self.refused += 1
                continue
            except OSError:
                return
            try:  # the agent introduces itself at once; one that does not is dropped
                hello = conn.recv() if conn.poll(10) else None
            except (EOFError, OSError):
                hello = None
            if not isinstance(hello, Hello):
                conn.close()
                continue
            self.joined.put((conn, hello))

    def close(self) -> None:
        self.listener.close()


class RemoteProcess:
    """A worker on another machine, seen through its agent's connection.

    A relay thread reads the agent's connection: heartbeats update the coordinator's
    shared arrays, the worker's reports go to `reader` (a local pipe, like a local
    worker's), and the end of the connection is the process's exit (`sentinel`).
    """

    def __init__(self, conn: Connection, hello: Hello, slot: int, progress: Progress) -> None:
        self.conn, self.slot, self.progress = conn, slot, progress
        self.pid, self.host = hello.pid, hello.host
        self.exitcode: int | None = None
        self.reader, self._writer = mp.Pipe(duplex=False)
        self._sentinel_r, self._sentinel_w = os.pipe()
        self.sentinel = self._sentinel_r
        self._lock = threading.Lock()
        threading.Thread(target=self._relay, daemon=True, name=f"relay-{self.pid}").start()

    def _relay(self) -> None:
        code = -signal.SIGKILL  # a vanished machine is a preemption
        try:
            while True:
                msg = pickle.loads(self.conn.recv_bytes())
                if isinstance(msg, Beat):
                    self.progress.beats[self.slot] = time.monotonic() - msg.age
                    self.progress.mark(self.slot, msg.step, msg.phase)
                elif isinstance(msg, Exit):
                    code = msg.code
                    break
                else:
                    self._writer.send(msg)
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001 - a message this side cannot read: the agent is lost
            pass
        self.exitcode = code
        self._writer.close()
        os.close(self._sentinel_w)

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        """Tell the agent to kill its worker, and count the node gone now: a frozen
        machine would never answer (fencing)."""
        with self._lock:
            try:
                self.conn.send(KillOrder())
            except (OSError, ValueError):
                pass
            try:  # wakes the relay's blocked recv with EOF: exit code -9, sentinel ready
                sock = socket.fromfd(self.conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            except OSError:
                pass

    def terminate_notice(self) -> None:
        with self._lock:
            try:
                self.conn.send(NoticeOrder())
            except (OSError, ValueError):
                pass

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or 0)
        while self.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)


# -- the agent ----------------------------------------------------------------------------


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
    from bamboo.cluster.membership import EtcdMembership, MembershipError
    try:
        m = EtcdMembership.connect(etcd["url"], job=etcd["job"])
        presence = _EtcdPresence(m, f"n{node}", token, {"host": socket.gethostname(),
                                                        "pid": os.getpid()})
    except MembershipError as e:
        raise JoinError(str(e)) from None
    say(f"registered in etcd at {etcd['url']} (lease {presence.lease.ttl_s:g} s)")
    return presence



def run_agent(address: tuple[str, int], token: str, *, notice_sources: list[str],
              metadata_url: str | None, say: Any) -> int:
    """Join the coordinator at `address`, run one worker, relay until it ends. (One loop
    over the worker's pipe, the coordinator's connection and the worker's exit, whose
    local state the signal handler and the notice watcher share.)"""
    try:
        conn = Client(address, authkey=token.encode())
    except mp.AuthenticationError:
        raise JoinError(f"the coordinator at {address[0]}:{address[1]} refused the join token: "
                        f"use the token it printed (its run directory's join-token file)") from None
    except OSError as e:
        raise JoinError(f"cannot reach the coordinator at {address[0]}:{address[1]} "
                        f"({e.strerror or e}): is `bamboo coordinator` running there?") from None
    conn.send(Hello(pid=os.getpid(), host=socket.gethostname()))
    if not conn.poll(120):
        raise JoinError("the coordinator accepted the connection but sent no job within 120 s")
    job = conn.recv()
    if isinstance(job, Refused):
        raise JoinError(f"the coordinator at {address[0]}:{address[1]} refused this node: "
                        f"{job.why}")
    if not isinstance(job, Job):
        raise JoinError(f"unexpected first message from the coordinator: {type(job).__name__}")
    spec = job.spec
    say(f"joined {address[0]}:{address[1]} as node n{spec.node}")
    membership = _join_membership(job.etcd, spec.node, token, say)

    from bamboo.cluster import forkserver
    from bamboo.cluster.worker import worker_main
    ctx = forkserver.context()
    slots = spec.slot + 1
    beats = RawArray("d", [time.monotonic() + 60.0] * slots)
    cells = RawArray("i", [0] * Progress.cells_for(slots))
    progress = Progress(beats, cells)
    reader, writer = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=worker_main, args=(spec, writer, beats, cells),
                         name=f"bamboo-n{spec.node}")
    worker.start()
    writer.close()
    lock = threading.Lock()

    def send(msg: Any) -> None:
        # Plain pickle: tensors travel by value (multiprocessing's own pickler would pass
        # them as shared-memory handles, which only work within one machine).
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with lock:
            conn.send_bytes(data)

    # A notice (the cloud's, or SIGTERM from Kubernetes' preStop / termination grace) is
    # reported to the coordinator, which drains this node at the next step boundary.
    noticed: list[str] = []

    def on_signal(*_: Any) -> None:
        noticed.append("SIGTERM")

    signal.signal(signal.SIGTERM, on_signal)
    watcher = None
    sources = [s for s in notice_sources if s != "sigterm"]
    if sources:
        from bamboo.cluster.notices import NoticeWatcher, make_source
        watcher = NoticeWatcher([make_source(s, metadata_url) for s in sources],
                                lambda n: noticed.append(n.source)).start()
    reported = False
    last_beat = 0.0
    code = None
    finished = False  # the worker reported its last step: the job's end is not a failure
    try:
        while True:
            ready = wait([reader, conn, worker.sentinel], timeout=_BEAT_S / 2)
            if reader in ready:
                try:
                    while reader.poll():
                        msg = reader.recv()
                        finished |= isinstance(msg, Done)
                        send(msg)
                except (EOFError, OSError):
                    pass
            if conn in ready:
                try:
                    order = conn.recv()
                except (EOFError, OSError):
                    worker.kill()  # the coordinator is gone: so is the job
                    return 0 if finished else 1
                if isinstance(order, KillOrder):
                    worker.kill()
                elif isinstance(order, NoticeOrder):  # a notice relayed by the coordinator
                    noticed.append("coordinator")
            if worker.sentinel in ready:
                worker.join()
                code = worker.exitcode
                try:
                    while reader.poll():
                        send(reader.recv())
                except (EOFError, OSError):
                    pass
                send(Exit(code=code))
                return 0 if code == 0 else 1
            if noticed and not reported:
                reported = True
                say(f"preemption notice ({noticed[0]}): draining at the next step boundary")
                send(Notice(rank=spec.node, source=noticed[0]))
            now = time.monotonic()
            if now - last_beat >= _BEAT_S:
                last_beat = now
                send(Beat(age=max(0.0, now - beats[spec.slot]), step=progress.step_of(spec.slot),
                          phase=progress.phase_of(spec.slot)))
    except (OSError, EOFError) as e:
        say(f"lost the coordinator ({e!r})")
        worker.kill()
        return 1
    finally:
        if watcher is not None:
            watcher.stop()
        if membership is not None:
            membership.stop()
        if worker.is_alive():
            worker.kill()
        say("done" if finished else f"stopped (worker exit code {code})")
