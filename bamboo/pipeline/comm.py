"""Point-to-point transfers between nodes over torch.distributed.

Sends are posted with `isend` and never block the schedule (a gloo send otherwise
waits for its receiver); they are completed at the end of the step. Receives wait
with the process group's timeout, so no call blocks forever. Tags keep transfers
apart: each (kind, stage, micro-batch) has its own. A failed call raises PeerLost,
so callers can tell a lost peer from a bug of their own. The default process group
outlives lost peers: traffic between survivors keeps flowing on it. Each generation
of the job (see `bamboo.reconfig`) has its own process group, passed in here.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

__all__ = ["PeerLost", "Interrupted", "P2P", "tag_for", "ACTIVATION", "GRADIENT", "DP_UP", "DP_DOWN",
           "REPLICA", "NORM_UP", "NORM_DOWN", "RESTORE"]

ACTIVATION, GRADIENT, DP_UP, DP_DOWN, REPLICA, NORM_UP, NORM_DOWN, RESTORE = range(8)


class PeerLost(RuntimeError):
    """A transfer failed because a peer is gone or stopped answering."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class Interrupted(Exception):
    """A wait was given up because the roles changed; the transfer stays posted."""



def tag_for(kind: int, stage: int, mb: int = 0) -> int:
    """A distinct tag per transfer of a step: kind < 8, stage < 1024, micro-batch < 2**18."""
    return (kind << 28) | (stage << 18) | mb


class P2P:
    """Posts sends and receives; counts bytes and the seconds spent waiting."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.pending: list[tuple[dist.Work, torch.Tensor, int]] = []
        self.posted: dict[tuple[int, int], tuple[dist.Work, torch.Tensor]] = {}
        self.wake = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="p2p-wait")
        self._waiting: dict[int, tuple[dist.Work, Future, int]] = {}
        """Transfers a helper thread waits on, by id of their Work (kept alive here). A Work
        is waited on once only: a gloo receive waited twice would wait for a second message."""
        self.wait_s = 0.0
        self.bytes_sent = 0

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.contiguous()
        try:
            work = self.group.send([tensor], dst, tag)
        except RuntimeError as e:
            raise PeerLost(f"send to rank {dst} failed: {e}", dst) from e
        self.pending.append((work, tensor, dst))
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def close(self) -> None:
        """Let the helper threads go once idle (a worker builds a P2P per generation; a
        transfer still blocked in gloo ends with its group's timeout)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def post_recv(self, buffer: torch.Tensor, src: int, tag: int) -> dist.Work:
        try:
            return self.group.recv([buffer], src, tag)
        except RuntimeError as e:
            raise PeerLost(f"receive from rank {src} failed: {e}", src) from e

    def wait(self, work: dist.Work, peer: int) -> None:
        start = time.perf_counter()
        try:
            work.wait()
        except RuntimeError as e:
            raise PeerLost(f"transfer with rank {peer} failed: {e}", peer) from e
        finally:
            self.wait_s += time.perf_counter() - start

    def recv(self, buffer: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        self.wait(self.post_recv(buffer, src, tag), src)
        return buffer

    def wait_interruptible(self, work: dist.Work, peer: int, interrupt: Callable[[], bool]) -> None:
        """Wait for `work`, giving up with Interrupted as soon as `interrupt()` is true.

        A gloo transfer can be neither cancelled nor polled (its completion flag is not
        kept up to date), so a helper thread blocks on it while this thread waits for
        either that or `wake` (set when the roles change). A node blocked behind a lost
        peer's successor, receiving from a live node that itself waits for the lost one,
        must still hear of the new roles, or the pipeline would wait forever.
        """
        start = time.perf_counter()
        try:
            entry = self._waiting.get(id(work))
            if entry is None or entry[0] is not work:  # an id can be reused once a Work is freed
                future = self._pool.submit(work.wait)
                future.add_done_callback(lambda _: self.wake.set())
                self._waiting[id(work)] = (work, future, peer)
            else:
                future = entry[1]
            while not future.done():
                if interrupt():
                    raise Interrupted()
                self.wake.wait(1.0)
                self.wake.clear()
            del self._waiting[id(work)]
            future.result()
        except RuntimeError as e:
            raise PeerLost(f"transfer with rank {peer} failed: {e}", peer) from e
        finally:
            self.wait_s += time.perf_counter() - start

    def recv_interruptible(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                           src: int, tag: int, interrupt: Callable[[], bool]) -> torch.Tensor:
        """Receive into a new buffer; a receive interrupted earlier is resumed, not re-posted
        (its message would otherwise land in the abandoned buffer)."""
        key = (src, tag)
        if key not in self.posted:
            buf = torch.empty(shape, dtype=dtype, device=device)
            self.posted[key] = (self.post_recv(buf, src, tag), buf)
        work, buf = self.posted[key]
        self.wait_interruptible(work, src, interrupt)
        del self.posted[key]
        return buf

    def flush(self, dead: set[int] | frozenset[int] = frozenset(),
              interrupt: Callable[[], bool] = lambda: False) -> None:
        """Wait for every posted send; sends to known-dead ranks are dropped.

        On a failure towards a rank not yet known dead, the unfinished sends stay
        pending and PeerLost is raised, so a later flush can finish them.
        """
        while self.pending:
            work, _, dst = self.pending[0]
            if dst not in dead:
                self.wait_interruptible(work, dst, interrupt)
            self.pending.pop(0)

    def forget(self, dead: set[int]) -> None:
        """Drop pending sends to, and posted receives from, lost ranks."""
        self.pending = [p for p in self.pending if p[2] not in dead]
        self.posted = {k: v for k, v in self.posted.items() if k[0] not in dead}
        self._waiting = {k: v for k, v in self._waiting.items() if v[2] not in dead}
