"""A worker's line to the coordinator: its pipe for reports, the store for decisions.

Reports go up the worker's own pipe as `bamboo.protocol.messages` messages (one writer per
pipe, guarded by a lock so the heartbeat thread and the training loop never interleave a
message). Decisions come down through the coordinator's store under the keys that
`bamboo.protocol.messages` defines. `CoordinatorLink` is the engine's `Votes`.

A vote's answer is never waited for past the moment it became moot: once a newer role
epoch is published, the coordinator answers an older epoch's vote only with abort/redo,
so the link settles a still-unanswered old vote with exactly that (an atomic
compare-and-set, in case the coordinator's own answer lands at the same time).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

from bamboo.plan.roles import RoleMap
from bamboo.protocol.messages import (
    Decision,
    EvalDone,
    Go,
    MicroBatchesDone,
    Progress,
    RoundDone,
    StepReport,
    Verdict,
    WorkerMessage,
    decide_key,
    epoch_key,
    eval_key,
    go_key,
)

__all__ = ["CoordinatorLink", "CoordinatorGone"]


class CoordinatorGone(RuntimeError):
    """The coordinator did not answer within the timeout."""


@dataclass(frozen=True, slots=True)
class _PendingVote:
    key: str
    epoch: int
    moot: str
    """The only answer the coordinator can still give once a newer epoch exists."""


class CoordinatorLink:
    def __init__(self, *, rank: int, conn: Connection, store: dist.Store, timeout_s: float,
                 watch_store: dist.Store | None = None) -> None:
        self.rank, self.conn, self.store = rank, conn, store
        self.timeout = timedelta(seconds=timeout_s)
        store.set_timeout(self.timeout)
        self.lock = threading.Lock()
        self.latest_epoch = 0
        self.on_epoch: Callable[[], None] = lambda: None
        self._vote: _PendingVote | None = None
        self.vote_s = 0.0
        """Seconds spent waiting for vote answers (the engine resets it each step)."""
        self._watch_store = watch_store
        if watch_store is not None:
            threading.Thread(target=self._watch_epochs, args=(watch_store,), daemon=True,
                             name="epoch-watch").start()

    def _watch_epochs(self, store: dist.Store) -> None:
        """Background thread (own store client): keep `latest_epoch` up to date."""
        while True:
            try:
                store.wait([epoch_key(self.latest_epoch + 1)], timedelta(days=1))
                self.latest_epoch += 1
                self._settle_moot(store)
                self.on_epoch()
            except dist.DistStoreError:
                continue
            except Exception:  # noqa: BLE001 (the coordinator is gone; the main thread will notice)
                return

    def _settle_moot(self, store: dist.Store) -> None:
        vote = self._vote
        if vote is not None and vote.epoch < self.latest_epoch:
            store.compare_set(vote.key, "", vote.moot)

    def send(self, message: WorkerMessage | StepReport) -> None:
        with self.lock:
            self.conn.send(message)

    def report(self, kind: type[WorkerMessage], **values: Any) -> None:
        """Send a `kind` message from this node (its current rank filled in)."""
        self.send(kind(rank=self.rank, **values))

    def _get(self, key: str) -> str:
        # get waits for the key itself (one round trip, not wait's and then get's): the
        # store's timeout is the link's (set in __init__)
        try:
            return self.store.get(key).decode()
        except dist.DistStoreError as e:
            raise CoordinatorGone(f"no answer from the coordinator for '{key}' within "
                                  f"{self.timeout.total_seconds():.0f} s: {e}") from e

    def _vote_answer(self, key: str, epoch: int, moot: str) -> str:
        self._vote = _PendingVote(key, epoch, moot)
        start = time.perf_counter()
        try:
            if self.latest_epoch > epoch:  # the watcher may have looked before _vote was set
                self.store.compare_set(key, "", moot)
            return self._get(key)
        finally:
            self._vote = None
            self.vote_s += time.perf_counter() - start

    def phase_a_done(self, step: int, epoch: int) -> Go:
        self.report(MicroBatchesDone, step=step, epoch=epoch)
        return Go(self._vote_answer(go_key(step, epoch), epoch, Go.ABORT.value))

    def round_done(self, step: int, epoch: int, ok: bool,
                   losses: list[tuple[int, float, float]], grad_norm: float = 0.0,
                   metrics: list[tuple[int, str, float]] | None = None) -> Verdict:
        self.report(RoundDone, step=step, epoch=epoch, ok=ok, losses=losses, grad_norm=grad_norm,
                    metrics=metrics or [])
        return Verdict.decode(self._vote_answer(decide_key(step, epoch), epoch,
                                                Decision.REDO.value))

    def eval_done(self, step: int, epoch: int, losses: list[tuple[int, float, float]],
                  metrics: list[tuple[int, str, float]] | None = None) -> Go:
        self.report(EvalDone, step=step, epoch=epoch, losses=losses, metrics=metrics or [])
        return Go(self._vote_answer(eval_key(step, epoch), epoch, Go.ABORT.value))

    def next_epochs(self, current: int, wait: bool) -> list[RoleMap]:
        """Role maps newer than `current`: waits for the first one if `wait`."""
        if wait:
            self._get(epoch_key(current + 1))
        out = []
        while self.store.check([epoch_key(current + 1)]):
            current += 1
            out.append(RoleMap.from_json(self.store.get(epoch_key(current)).decode()))
        return out

    @staticmethod
    def heartbeat_forever(period_s: float, progress: Progress, slot: int) -> None:
        """Background thread body: stamp this node's slot of the shared heartbeat array."""
        while True:
            progress.beats[slot] = time.monotonic()
            time.sleep(period_s)

