"""The coordinator's side of agents' connections: the join listener, and agents' workers seen as processes.

`bamboo coordinator --bind ADDR:PORT` listens for agents there. Each connection gets its
own handshake thread with a deadline (bamboo.protocol.frames): the agent proves it knows
the job's token (HMAC of a random challenge), and a client that connects and closes,
sends garbage or stalls is dropped without affecting anyone else. Nothing from the
network is unpickled: messages are JSON frames decoded into this project's dataclasses.

An agent runs K workers. `RemoteAgent` reads its connection on one relay thread:
heartbeats update the coordinator's shared arrays, each worker's reports go to that
worker's local pipe, and the end of the connection is the end of every worker on that
machine at once (a machine loss). `RemoteProcess` makes one of those workers look like
a local worker process (pid, sentinel, kill, exit code), so one supervisor serves both.
A ping every second lets agents tell a live coordinator from a vanished one.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
import time
import weakref
from typing import Any

from bamboo.protocol.agent_wire import objects_messages, register_wire_types
from bamboo.protocol.frames import Channel, Refusal, serve_handshake
from bamboo.protocol.messages import (
    Beat,
    Exit,
    Finished,
    FromWorker,
    Hello,
    Job,
    KillOrder,
    NoticeOrder,
    Ping,
    Progress,
)

__all__ = ["AgentListener", "RemoteAgent", "RemoteProcess"]

HANDSHAKE_S = 10.0
"""A joining client must finish the handshake within this many seconds."""
_MAX_HANDSHAKES = 64
_PING_S = 1.0
_IO_S = 10.0
"""A send to an agent that does not read for this long ends its connection."""


_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""The join token each admitted agent's channel proved (to sign what it is sent)."""


def _hello(data: dict) -> Hello:
    try:
        hello = Hello(pid=int(data["pid"]), host=str(data["host"])[:200],
                      workers=int(data.get("workers", 1)), machine=str(data.get("machine", ""))[:200])
    except (KeyError, TypeError, ValueError):
        raise ValueError("a malformed hello") from None
    if not 1 <= hello.workers <= 256:
        raise ValueError(f"an agent offering {hello.workers} workers")
    return hello


class AgentListener:
    """Accepts agents on a background thread; each connection is checked on a thread of its
    own, and those that pass land in `joined` as (Channel, Hello)."""

    def __init__(self, address: tuple[str, int], token: str, *, advertise: str | None = None,
                 store_port: int | None = None, join_timeout_s: float = 600.0,
                 handshake_s: float = HANDSHAKE_S) -> None:
        register_wire_types()
        self.token, self.handshake_s = token, handshake_s
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.sock = socket.create_server(address, family=family, backlog=128)
        self.address: tuple[str, int] = tuple(self.sock.getsockname()[:2])  # type: ignore[assignment]  # an inet address: its first two fields
        self.advertise = advertise
        """The host workers reach the store at (None: see the coordinator's store)."""
        self.store_port = store_port if store_port is not None else \
            (self.address[1] + 1 if address[1] else 0)
        self.join_timeout_s = join_timeout_s
        self.joined: queue.Queue[tuple[Channel, Hello]] = queue.Queue()
        self.refused = 0
        """Connections that gave a wrong token."""
        self.dropped = 0
        """Connections that did not speak the protocol (probes, garbage, stalls)."""
        self._slots = threading.BoundedSemaphore(_MAX_HANDSHAKES)
        self._closed = False
        self._final: str | None = None
        self._closing = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="agent-accept").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self.sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # EMFILE and the like: never end the accept loop
                continue
            if not self._slots.acquire(blocking=False):
                sock.close()  # a flood of half-open clients: shed, do not queue
                self.dropped += 1
                continue
            threading.Thread(target=self._handshake, args=(sock,), daemon=True,
                             name="agent-handshake").start()

    def _handshake(self, sock: socket.socket) -> None:
        channel = Channel(sock, io_timeout=self.handshake_s)
        try:
            hello = _hello(serve_handshake(channel, self.token, self.handshake_s))
            channel.set_io_timeout(_IO_S)
        except Refusal:
            self.refused += 1
            channel.close()
        except Exception:  # noqa: BLE001 - whatever a client sends, it only loses its own seat
            self.dropped += 1
            channel.close()
        else:
            with self._closing:
                if not self._closed:
                    _TOKENS[channel] = self.token
                    self.joined.put((channel, hello))
                    return
            self._let_go(channel)
        finally:
            self._slots.release()

    def _let_go(self, channel: Channel) -> None:
        """A joined agent the run will never admit: told the run's end (it exits 0), or
        just closed when the coordinator is being restarted (it rejoins)."""
        if self._final is not None:
            try:
                channel.send(Finished(status=self._final))
            except (OSError, ValueError):
                pass
        channel.close()

    def close(self, final_status: str | None = None) -> None:
        """Stop accepting; agents that joined but were never admitted are let go."""
        with self._closing:
            self._closed, self._final = True, final_status
        self.sock.close()
        while not self.joined.empty():
            self._let_go(self.joined.get()[0])


class RemoteAgent:
    """One agent's connection: K workers on one machine."""

    def __init__(self, channel: Channel, hello: Hello) -> None:
        self.channel, self.hello = channel, hello
        self.progress: Progress | None = None
        """The run's heartbeat arrays, given with its first worker (`Agents.start`)."""
        self.machine = hello.machine or f"{hello.host}-{hello.pid}"
        self.free = list(range(hello.workers))
        """Local worker indices (GPUs) with no worker on them."""
        self._spares = 0
        """Workers that ended other than by finishing (killed, or fenced and then confirmed
        gone) while the machine stayed connected: a replacement may take each one's GPU.
        Counted by the relay thread, taken and given back by the run's (`_spare_lock`)."""
        self._spare_lock = threading.Lock()
        self.workers: dict[int, RemoteProcess] = {}
        self.token: str | None = _TOKENS.get(channel)
        self.objects_sent: set[str] = set()
        """The by-value references this agent was sent (`Objects`), each once."""
        self.gone = False
        self._stop = threading.Event()
        self._relay_done = threading.Event()
        """The relay thread read the connection's end (or failed): closing now resets nothing."""
        threading.Thread(target=self._relay, daemon=True, name=f"relay-{self.machine}").start()
        threading.Thread(target=self._ping, daemon=True, name=f"ping-{self.machine}").start()

    def start_worker(self, spec: Any, slot: int, etcd: dict | None, lease_s: float) -> RemoteProcess:
        k = self.free.pop(0)
        process = RemoteProcess(self, k, slot)
        self.workers[k] = process
        for objects in objects_messages(spec.config, self.token or "", self.objects_sent):
            self.send(objects)
        self.send(Job(worker=k, spec=spec, etcd=etcd, lease_s=lease_s))
        return process

    def take_spares(self) -> int:
        """How many spare rooms this machine has now, all taken (none once it is gone)."""
        with self._spare_lock:
            taken, self._spares = (0 if self.gone else self._spares), 0
        return taken

    def give_back_spare(self) -> None:
        """One more spare room (a worker ended while the machine stays, or a spare the run
        did not use this time)."""
        with self._spare_lock:
            self._spares += 1

    def send(self, msg: Any) -> bool:
        try:
            self.channel.send(msg)
            return True
        except (OSError, ValueError):
            self.lost()
            return False

    def _ping(self) -> None:
        while not self._stop.wait(_PING_S):
            if not self.send(Ping()):
                return

    def _relay(self) -> None:
        try:
            while True:
                msg = self.channel.recv(timeout=None)
                if isinstance(msg, Beat) and self.progress is not None:
                    now = time.monotonic()
                    for k, age, step, phase in msg.slots:
                        w = self.workers.get(int(k))
                        if w is not None and w.exitcode is None:
                            self.progress.beats[w.slot] = now - float(age)
                            self.progress.mark(w.slot, int(step), int(phase))
                elif isinstance(msg, FromWorker):
                    w = self.workers.get(msg.worker)
                    if w is not None and w.exitcode is None:
                        w.deliver(msg.msg)
                elif isinstance(msg, Exit):
                    w = self.workers.pop(msg.worker, None)
                    self.free.append(msg.worker)
                    if w is not None:
                        w.ended(msg.code)  # no-op for one already fenced (counted gone then)
                        # The machine is still here: its GPU can take a replacement, also
                        # after a fence (a link cut shorter than this connection's life).
                        if msg.code != 0:
                            self.give_back_spare()
        except Exception:  # noqa: BLE001 - EOF, a reset, garbage: the machine is lost
            pass
        finally:
            self._relay_done.set()
        self.lost()

    def lost(self) -> None:
        """The connection ended: every worker of this machine is gone (exit code -9)."""
        if self.gone:
            return
        self.gone = True
        self._stop.set()
        self.channel.close()
        for w in list(self.workers.values()):
            w.ended(-signal.SIGKILL)

    def finish(self, status: str) -> None:
        """The run is over: the agent stops its workers and exits without rejoining. The
        connection is closed by `closed_by`, once the agent has read this and hung up."""
        if not self.gone:
            try:
                self.channel.send(Finished(status=status))
            except (OSError, ValueError):
                pass
        self._stop.set()
        self.gone = True
        self.channel.end_sending()

    def closed_by(self, deadline: float) -> None:
        """Close the connection once the agent hung up (after `finish`), or at `deadline`
        (time.monotonic()) for one that does not."""
        self._relay_done.wait(max(0.0, deadline - time.monotonic()))
        self.channel.close()


class RemoteProcess:
    """Worker `index` of an agent, with a local process's handle."""

    def __init__(self, agent: RemoteAgent, index: int, slot: int) -> None:
        self.agent, self.index, self.slot = agent, index, slot
        self.pid, self.host, self.machine = agent.hello.pid, agent.hello.host, agent.machine
        self.exitcode: int | None = None
        self.reader, self._writer = mp.Pipe(duplex=False)
        self._sentinel_r, self._sentinel_w = os.pipe()
        self.sentinel = self._sentinel_r
        self._lock = threading.Lock()

    def deliver(self, msg: Any) -> None:
        try:
            self._writer.send(msg)
        except (OSError, ValueError):
            pass

    def ended(self, code: int | None) -> None:
        with self._lock:
            if self.exitcode is not None:
                return
            self.exitcode = code if code is not None else -signal.SIGKILL
            self._writer.close()
            os.close(self._sentinel_w)

    def is_alive(self) -> bool:
        return self.exitcode is None

    def close(self) -> None:
        """Release the pipes, once it has ended (as `multiprocessing.Process.close`)."""
        if self.exitcode is None:
            raise ValueError(f"worker {self.index} of {self.host} is still running")
        self.reader.close()
        os.close(self._sentinel_r)

    def kill(self) -> None:
        """Order the agent to kill this worker, and count it gone now: a frozen or cut-off
        machine would never answer (fencing)."""
        self.agent.send(KillOrder(worker=self.index))
        self.ended(-signal.SIGKILL)

    def terminate_notice(self) -> None:
        self.agent.send(NoticeOrder(worker=self.index))

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or 0)
        while self.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
