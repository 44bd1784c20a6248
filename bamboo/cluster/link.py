"""A worker's line to the coordinator: its pipe for reports, the store for decisions.

Reports go up the worker's own pipe (one writer per pipe, guarded by a lock so the
heartbeat thread and the training loop never interleave a message). Decisions come
down through the coordinator's store under well-known keys:

    gen/<g>            the plan of generation g (bamboo.reconfig.planner, JSON)
    epoch/<e>          the role map after the e-th change of membership (JSON); epochs
                       count on across generations, so keys never repeat
    go/<step>/<e>      "go" when every live node finished its micro-batches, else "abort"
    decide/<step>/<e>  "commit" when every live node's commit round succeeded, else "redo"
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any
from collections.abc import Callable

import torch.distributed as dist

from bamboo.redundancy.roles import RoleMap

__all__ = ["CoordinatorLink", "CoordinatorGone"]


class CoordinatorGone(RuntimeError):
    """The coordinator did not answer within the timeout."""


class CoordinatorLink:
    def __init__(self, *, rank: int, conn: Connection, store: dist.Store, timeout_s: float,
                 watch_store: dist.Store | None = None) -> None:
        self.rank, self.conn, self.store = rank, conn, store
        self.timeout = timedelta(seconds=timeout_s)
        self.lock = threading.Lock()
        self.latest_epoch = 0
        self.on_epoch: Callable[[], None] = lambda: None
        if watch_store is not None:
            threading.Thread(target=self._watch_epochs, args=(watch_store,), daemon=True,
                             name="epoch-watch").start()

    def _watch_epochs(self, store: dist.Store) -> None:
        """Background thread (own store client): keep `latest_epoch` up to date."""
        while True:
            try:
                store.wait([f"epoch/{self.latest_epoch + 1}"], timedelta(days=1))
                self.latest_epoch += 1
                self.on_epoch()
            except dist.DistStoreError:
                continue
            except Exception:  # the coordinator is gone; the main thread will notice
                return

    def send(self, kind: str, **fields: Any) -> None:
        with self.lock:
            self.conn.send({"kind": kind, "rank": self.rank, **fields})

    def _get(self, key: str) -> str:
        try:
            self.store.wait([key], self.timeout)
        except dist.DistStoreError as e:
            raise CoordinatorGone(f"no answer from the coordinator for '{key}' within "
                                  f"{self.timeout.total_seconds():.0f} s: {e}") from e
        return self.store.get(key).decode()

    def phase_a_done(self, step: int, epoch: int) -> str:
        self.send("phase_a_done", step=step, epoch=epoch)
        return self._get(f"go/{step}/{epoch}")

    def round_done(self, step: int, epoch: int, ok: bool,
                   losses: list[tuple[int, float, float]]) -> str:
        self.send("round_done", step=step, epoch=epoch, ok=ok, losses=losses)
        return self._get(f"decide/{step}/{epoch}")

    def next_epochs(self, current: int, wait: bool) -> list[RoleMap]:
        """Role maps newer than `current`: waits for the first one if `wait`."""
        if wait:
            self._get(f"epoch/{current + 1}")
        out = []
        while self.store.check([f"epoch/{current + 1}"]):
            current += 1
            out.append(RoleMap.from_json(self.store.get(f"epoch/{current}").decode()))
        return out

    def heartbeat_forever(self, period_s: float, beats: Any, slot: int) -> None:
        """Background thread body: stamp this node's slot of the shared heartbeat array."""
        while True:
            beats[slot] = time.monotonic()
            time.sleep(period_s)
