"""Point-to-point transfers and collectives between nodes over torch.distributed.

Every transfer has a key `(kind, stage, micro-batch)`. How keys become wire matches
depends on the communication contract (`--comm`):

- **strict** (NCCL's rules, on every backend): no tags. Between two nodes, messages in
  one direction are matched by the order they are posted, so both sides post in one
  fixed order (docs/architecture.md, "Transfer order"); where two nodes exchange in both
  directions the operations go out as one batch (`exchange`, NCCL's group call).
  Gradients travel on a group of their own (a second lane), so between two nodes each
  direction of each lane carries one kind of message, in micro-batch order, even when a
  node holds two stages that are not adjacent (stage 0 and the last, after stage 0's
  failover): its activations and gradients towards one peer cannot overtake each other
  on one lane in an order the peer does not expect. A group
  is never used after a peer in it was lost: the survivors `abandon` it (NCCL: abort the
  communicator) and form a new one among themselves.
- **tagged** (gloo only): each key has its own tag, and the group outlives lost peers,
  so traffic between survivors keeps flowing on it.

Sends are posted asynchronously and completed at the end of the step; waits are
interruptible (a helper thread blocks on the transfer) and bounded by the group's
timeout, so no call blocks forever. A failed call raises PeerLost, so callers can tell
a lost peer from a bug of their own.

gloo reads and writes a tensor's memory directly, host memory only; on a gloo group (several
workers sharing one GPU, where NCCL refuses two ranks on one device) a tensor on an
accelerator is staged through host memory: a send copies it to the host first, a receive
lands in a host buffer and is copied into the caller's buffer by the wait
(`needs_host_staging`, `StagedWork`). CPU tensors travel as they are.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PeerLost", "Interrupted", "P2P", "Key", "GroupFormer", "tag_for", "ACTIVATION",
           "GRADIENT", "DP_UP", "DP_DOWN", "REPLICA", "NORM_UP", "NORM_DOWN", "RESTORE",
           "MANIFEST", "EVAL", "TIE_UP", "TIE_DOWN", "bury", "form_interruptibly",
           "needs_host_staging", "StagedWork", "BatchedWork", "coalescing"]

(ACTIVATION, GRADIENT, DP_UP, DP_DOWN, REPLICA, NORM_UP, NORM_DOWN, RESTORE, MANIFEST,
 EVAL, TIE_UP, TIE_DOWN) = range(12)

Key = tuple[int, int, int]
"""(kind, stage, micro-batch): what a transfer carries."""

GroupFormer = Callable[[str, Sequence[int]], dist.ProcessGroup]
"""Forms the process group `name` among the given node ranks (this node among them);
blocks until every member has joined or the timeout passes."""

_RELEASE_GRACE_S = 1.0
"""How long a buried entry is kept before its release begins: the peers that abandon the same
group in the same event do so within this, so none of them sees it closed first."""


def bury(entry: Any) -> None:
    """Drop `entry` (abandoned groups, transfers that cannot be cancelled, their buffers, a
    finished generation's engine) on a thread of its own, after a short grace. A gloo
    transfer cannot be cancelled, and dropping a group whose collective is still blocked
    waits (its destructor joins its threads, the GIL released) until that collective's
    timeout: no caller waits for that. Nor may a group be kept longer than needed: bytes a
    peer sent that this node will never read (a collective launched before a loss, given up
    here) wake gloo's level-triggered loop without end, a share of a core spent on nothing
    for as long as the group lives (docs/results.md, "The spinning gloo loop"). What sits in
    reference cycles (an engine and its parts) is not freed by this: break them first (the
    worker hands over a finished engine's attributes, the engine emptied)."""
    box = [entry]
    del entry

    def release() -> None:
        time.sleep(_RELEASE_GRACE_S)
        box.clear()  # the destructors run here

    threading.Thread(target=release, daemon=True, name="release").start()


class PeerLost(RuntimeError):
    """A transfer failed because a peer is gone or stopped answering."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class Interrupted(Exception):
    """A wait was given up because the roles changed."""


def tag_for(kind: int, stage: int, mb: int = 0) -> int:
    """A distinct tag per transfer of a step: kind < 16, stage < 512, micro-batch < 2**18
    (31 bits: gloo's tags are signed 32-bit integers)."""
    return (kind << 27) | (stage << 18) | mb


def needs_host_staging(backend: str, device: torch.device | str) -> bool:
    """Whether a transfer of a tensor on `device` over `backend` ("gloo", "nccl") goes
    through host memory: gloo's point-to-point calls read the tensor's memory as host memory,
    so a tensor anywhere but the CPU is copied there first. NCCL takes device memory."""
    return backend == "gloo" and torch.device(device).type != "cpu"


def _backend_of(group: Any) -> str:
    """"gloo", "nccl", or the group's own name for another kind (a stand-in: "")."""
    for name, cls in (("gloo", getattr(dist, "ProcessGroupGloo", None)),
                      ("nccl", getattr(dist, "ProcessGroupNCCL", None))):
        if cls is not None and isinstance(group, cls):
            return name
    return ""


class StagedWork:
    """A transfer staged through a host buffer: `wait` waits for the wire transfer (a
    receive or an all-reduce on `host`), then copies `host` into the caller's tensor `into`.
    The copy is synchronous: when `wait` returns the data
    is in `into`, whichever thread or CUDA stream reads it next. Waited on once, like a
    Work; a second `wait` neither waits nor copies again."""

    def __init__(self, work: dist.Work, host: torch.Tensor, into: torch.Tensor) -> None:
        self.work, self.host, self.into = work, host, into
        self.done = False

    def wait(self, timeout: Any = None) -> bool:
        if self.done:
            return True
        ok = self.work.wait() if timeout is None else self.work.wait(timeout)
        if ok is False:  # a wait with a timeout that ran out: nothing to copy yet
            return False
        self.into.copy_(self.host)  # non_blocking=False
        if self.into.device.type == "cuda":  # the copy is queued on a stream: finish it here
            torch.cuda.current_stream(self.into.device).synchronize()
        self.done = True
        return True

    def __getattr__(self, name: str) -> Any:  # is_completed, exception, ...: the wire's
        if name == "work":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.work, name)


def coalescing(group: Any, device: torch.device, begin: bool) -> Any:
    """Begin (`begin`) or end a batch of NCCL operations on `group`; the end gives the batch's
    Work. A `dist.ProcessGroup` takes the device; a backend built directly (the workers'
    `dist.ProcessGroupNCCL`) takes none."""
    if isinstance(group, dist.ProcessGroup):
        return group._start_coalescing(device) if begin else group._end_coalescing(device)
    return group._start_coalescing() if begin else group._end_coalescing()


class BatchedWork:
    """One operation of a coalesced batch: NCCL returns no Work for an operation inside a
    batch (None), only one for the whole batch at its end, so waiting for the operation is
    waiting for the batch. A distinct object per operation, as each is waited on once."""

    def __init__(self, batch: dist.Work) -> None:
        self.batch = batch

    @classmethod
    def of(cls, work: Any, batch: dist.Work) -> Any:
        """`work` itself where the operation has one, else the batch's stand-in."""
        return work if work is not None else cls(batch)

    def wait(self, timeout: Any = None) -> bool:
        return self.batch.wait() if timeout is None else self.batch.wait(timeout)

    def __getattr__(self, name: str) -> Any:  # is_completed, exception, ...: the batch's
        if name == "batch":
            raise AttributeError(name)
        return getattr(self.batch, name)


def form_interruptibly(former: GroupFormer, name: str, ranks: Sequence[int],
                       interrupt: Callable[[], bool]) -> dist.ProcessGroup:
    """Form a group on a helper thread; Interrupted when `interrupt()` turns true first (a
    member was lost before it joined: the coordinator has published new roles)."""
    result: list[Any] = []

    def build() -> None:
        try:
            result.append(former(name, list(ranks)))
        except Exception as e:  # noqa: BLE001 - re-raised below as PeerLost
            result.append(e)

    thread = threading.Thread(target=build, daemon=True, name=f"form-{name}")
    thread.start()
    while thread.is_alive():
        thread.join(0.02)
        if thread.is_alive() and interrupt():
            bury(result)  # the formation ends by itself, with its store's timeout
            raise Interrupted()
    if isinstance(result[0], Exception):
        raise PeerLost(f"forming process group {name} failed: "
                       f"{str(result[0]).splitlines()[0][:200]}")
    return result[0]


class P2P:
    """One process group's transfers; counts bytes and the seconds spent waiting.

    `ranks[i]` is the node rank of the group's rank i (default: the same numbers), so a
    group formed among the survivors is addressed by node ranks as before.
    """

    def __init__(self, group: dist.ProcessGroup, *, strict: bool = True,
                 gradient_group: dist.ProcessGroup | None = None,
                 ranks: Sequence[int] | None = None, device: torch.device | None = None,
                 former: GroupFormer | None = None, name: str = "g",
                 staged: bool | None = None) -> None:
        self.group, self.strict, self.name = group, strict, name
        self.backend = _backend_of(group)
        self.staged = staged
        """Stage transfers through host memory: None (the default) where
        `needs_host_staging(backend, tensor.device)`, i.e. accelerator tensors on gloo;
        True: every tensor (tests, with CPU tensors standing in); False: none."""
        self.gradient_group = gradient_group
        """strict: the lane gradients travel on (None: the main group)."""
        self.gradient_ranks: list[int] | None = None
        """The gradient lane's node ranks, where they differ from `ranks`."""
        self.ranks = list(ranks) if ranks is not None else list(range(group.size()))
        self.device = device or torch.device("cpu")
        self.former = former
        self.abandoned = False
        self.pending: list[tuple[dist.Work, torch.Tensor, int]] = []
        self.posted: dict[tuple[int, Key], tuple[dist.Work, torch.Tensor]] = {}
        self.wake = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="p2p-wait")
        self._waiting: dict[int, tuple[dist.Work, Future, int]] = {}
        """Transfers a helper thread waits on, by id of their Work (kept alive here). A Work
        is waited on once only: a gloo receive waited twice would wait for a second message."""
        self._subgroups: dict[str, dist.ProcessGroup] = {}
        self.wait_s = 0.0
        self.bytes_sent = 0

    # -- addressing ----------------------------------------------------------------------------

    def tag(self, key: Key) -> int:
        return 0 if self.strict else tag_for(*key)

    def _lane(self, key: Key, node: int) -> tuple[dist.ProcessGroup, int]:
        """The group a transfer of `key` with `node` goes on, and the node's rank there."""
        if self.abandoned:
            raise RuntimeError(f"transfer on the abandoned process group {self.name}")
        group, ranks = self.group, self.ranks
        if key[0] == GRADIENT and self.gradient_group is not None:
            group = self.gradient_group
            ranks = self.gradient_ranks if self.gradient_ranks is not None else self.ranks
        if node not in ranks:
            raise PeerLost(f"rank {node} is not in process group {self.name}", node)
        return group, ranks.index(node)

    def _staged(self, tensor: torch.Tensor) -> bool:
        if self.staged is None:
            return needs_host_staging(self.backend, tensor.device)
        return self.staged

    # -- point to point ------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int, key: Key) -> None:
        tensor = tensor.contiguous()
        if self._staged(tensor):  # a host copy, referenced in `pending` until flushed
            tensor = tensor.to("cpu", copy=True)
        group, peer = self._lane(key, dst)
        try:
            work = group.send([tensor], peer, self.tag(key))
        except RuntimeError as e:
            raise PeerLost(f"send to rank {dst} failed: {e}", dst) from e
        self.pending.append((work, tensor, dst))
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def post_recv(self, buffer: torch.Tensor, src: int, key: Key) -> dist.Work | StagedWork:
        """Post a receive into `buffer`; its data is there once the returned work was waited
        on (staged: the wait copies it there from a host buffer)."""
        group, peer = self._lane(key, src)
        try:
            if self._staged(buffer):
                host = torch.empty(buffer.shape, dtype=buffer.dtype, device="cpu")
                return StagedWork(group.recv([host], peer, self.tag(key)), host, buffer)
            return group.recv([buffer], peer, self.tag(key))
        except RuntimeError as e:
            raise PeerLost(f"receive from rank {src} failed: {e}", src) from e

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int, Key]],
                 recvs: Sequence[tuple[torch.Tensor, int, Key]]) -> list[tuple[dist.Work, int]]:
        """Post `sends` and `recvs` as one batch (NCCL: one group call, so two nodes that
        send to each other cannot wait on each other); the receives' works, in order.
        The sends complete with `flush`."""
        coalesce = self.backend == "nccl"
        if coalesce:  # what dist.batch_isend_irecv does, on a group outside the default world
            coalescing(self.group, self.device, begin=True)
        first, works, batch = len(self.pending), [], None
        try:
            for tensor, dst, key in sends:
                self.send(tensor, dst, key)
            for buffer, src, key in recvs:
                works.append((self.post_recv(buffer, src, key), src))
        finally:
            if coalesce:
                batch = coalescing(self.group, self.device, begin=False)
        if batch is not None:  # an op inside a batch may have no Work of its own
            self.pending[first:] = [(BatchedWork.of(w, batch), t, d)
                                    for w, t, d in self.pending[first:]]
            works = [(BatchedWork.of(w, batch), src) for w, src in works]
        return works

    def wait(self, work: dist.Work, peer: int) -> None:
        start = time.perf_counter()
        try:
            work.wait()
        except RuntimeError as e:
            raise PeerLost(f"transfer with rank {peer} failed: {e}", peer) from e
        finally:
            self.wait_s += time.perf_counter() - start

    def recv(self, buffer: torch.Tensor, src: int, key: Key) -> torch.Tensor:
        self.wait(self.post_recv(buffer, src, key), src)
        return buffer

    def wait_interruptible(self, work: dist.Work, peer: int, interrupt: Callable[[], bool],
                           idle: Callable[[], bool] | None = None) -> None:
        """Wait for `work`, giving up with Interrupted as soon as `interrupt()` is true.

        A gloo transfer can be neither cancelled nor polled (its completion flag is not
        kept up to date), so a helper thread blocks on it while this thread waits for
        either that or `wake` (set when the roles change). A node blocked behind a lost
        peer's successor, receiving from a live node that itself waits for the lost one,
        must still hear of the new roles, or the pipeline would wait forever.

        `idle()` is other work the node can do meanwhile (eager FRC): called, one unit at a
        time, while the transfer is not done; it returns False when it has nothing left. Its
        time is not counted as waiting, and its errors are its own (not a lost peer).
        """
        start, busy = time.perf_counter(), 0.0
        try:
            entry = self._waiting.get(id(work))
            if entry is None or entry[0] is not work:  # an id can be reused once a Work is freed
                future = self._pool.submit(work.wait)
                future.add_done_callback(lambda _: self.wake.set())
                self._waiting[id(work)] = (work, future, peer)
            else:
                future = entry[1]
            grace = idle is not None  # a transfer already complete shows so within moments
            while not future.done():
                if interrupt():
                    raise Interrupted()
                if grace:
                    grace = False
                    self.wake.wait(0.002)
                    self.wake.clear()
                    continue
                if idle is not None:
                    began = time.perf_counter()
                    if idle():
                        busy += time.perf_counter() - began
                        continue
                    idle = None
                self.wake.wait(1.0)
                self.wake.clear()
            del self._waiting[id(work)]
            try:  # only the transfer's own failure is a lost peer, not one of `idle`'s
                future.result()
            except RuntimeError as e:
                raise PeerLost(f"transfer with rank {peer} failed: {e}", peer) from e
        finally:
            self.wait_s += time.perf_counter() - start - busy

    def recv_interruptible(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                           src: int, key: Key, interrupt: Callable[[], bool],
                           idle: Callable[[], bool] | None = None) -> torch.Tensor:
        """Receive into a new buffer; a receive interrupted earlier is resumed, not re-posted
        (its message would otherwise land in the abandoned buffer)."""
        slot = (src, key)
        if slot not in self.posted:
            buf = torch.empty(shape, dtype=dtype, device=device)
            self.posted[slot] = (self.post_recv(buf, src, key), buf)
        work, buf = self.posted[slot]
        self.wait_interruptible(work, src, interrupt, idle)
        del self.posted[slot]
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

    # -- collectives ---------------------------------------------------------------------------

    def subgroup(self, name: str, members: Sequence[int],
                 interrupt: Callable[[], bool]) -> dist.ProcessGroup:
        """The group of `members` (node ranks, this node among them) named `name`, formed at
        first use (every member must give the name alike; a new set of members needs a new
        name)."""
        group = self._subgroups.get(name)
        if group is None:
            if self.former is None:
                raise RuntimeError("this P2P cannot form groups (no former given)")
            group = form_interruptibly(self.former, f"{self.name}.{name}", members, interrupt)
            self._subgroups[name] = group
        return group

    def subgroup_if_formed(self, name: str) -> dist.ProcessGroup | None:
        """The group `name` if it was formed already (forming one waits for every member)."""
        return None if self.abandoned else self._subgroups.get(name)

    def host_staged(self, device: torch.device) -> bool:
        """Whether tensors on `device` travel through host memory here."""
        return self.staged if self.staged is not None else \
            needs_host_staging(self.backend, device)

    # -- endings -------------------------------------------------------------------------------

    def abandon(self) -> None:
        """Drop this group and everything pending on it (a peer in it was lost). NCCL's
        communicator is aborted; a gloo group has no abort that cancels a transfer, so its
        blocked transfers end with the timeout on helper threads, never waited on again;
        either way the groups are released off this thread (`bury`)."""
        if self.abandoned:
            return
        self.abandoned = True
        if self.backend == "nccl":  # not gloo: its abort closes pairs peers still use
            for group in [self.group, self.gradient_group, *self._subgroups.values()]:
                try:
                    group.abort()
                except (RuntimeError, AttributeError):
                    pass
        bury((self.group, self.gradient_group, self._subgroups, self.pending, self.posted,
               self._waiting))
        self.pending, self.posted, self._waiting, self._subgroups = [], {}, {}, {}
        self._pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Let the helper threads go once idle (a worker builds a P2P per generation; a
        transfer still blocked in gloo ends with its group's timeout)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
