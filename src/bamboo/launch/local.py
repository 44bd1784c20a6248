"""Nodes as worker processes of this machine (`bamboo train`, `bamboo.train`, `bamboo.Trainer`).

Workers fork from the fork server (`bamboo.node.forkserver`), warm, on demand: the first
`--nodes`, a trace's adds, a checkpoint-restart's fresh workers. Each gets a device slot no
live local worker holds, on the least used GPU (`free_device_slot`), and under `--pin-cpus
auto` its share of the cores. A worker dies with the fork server, so the server's death is
the end of every local node at once (`broken`).
"""
from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Iterable
from multiprocessing.process import BaseProcess
from pathlib import Path

from bamboo.node.output import LOG_DIR
from bamboo.protocol.launch import (
    Offer,
    Started,
    StoreAddress,
    WorkerSpec,
)
from bamboo.protocol.messages import Progress

__all__ = ["LocalWorkers", "LocalProcess", "free_device_slot"]


def free_device_slot(taken: Iterable[int], devices: int | None = None) -> int:
    """A device slot for a new local worker, given the slots live workers hold (`taken`).
    A worker's GPU is its slot modulo the `devices` visible GPUs
    (`devices.choose_device_index`); slots are never shared. The new slot lands on the
    GPU with the fewest live workers (the lowest index on a tie), so while a GPU is free no
    two live workers share one, and a replacement takes the GPU of a worker that ended.
    `devices` unknown (None or 0: no GPU here): the lowest free slot."""
    used = set(taken)
    step = devices if devices and devices > 0 else 1
    load = [0] * step
    for t in used:
        load[t % step] += 1
    slot = min(range(step), key=lambda g: (load[g], g))
    while slot in used:
        slot += step
    return slot


class LocalProcess:
    """A local worker process, as the coordinator handles every node's process."""

    def __init__(self, process: BaseProcess, device_slot: int) -> None:
        self.process, self.device_slot = process, device_slot
        self.killed = False
        """SIGKILL was sent: its GPU may go to the worker that replaces it."""
        self._closed_exitcode: int | None = None
        self.closed = False

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    @property
    def exitcode(self) -> int | None:
        # the coordinator closes a reaped process; its exit code stays readable
        return self._closed_exitcode if self.closed else self.process.exitcode

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        self.killed = True
        self.process.kill()

    def terminate_notice(self) -> None:
        if self.process.pid is not None:
            try:
                os.kill(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def join(self, timeout: float | None = None) -> None:
        self.process.join(timeout)

    def close(self) -> None:
        if not self.closed:
            self._closed_exitcode = self.process.exitcode
            self.process.close()
            self.closed = True


class LocalWorkers:
    """Worker processes from this machine's fork server, started on demand."""

    on_demand = True

    def __init__(self) -> None:
        self.started: list[LocalProcess] = []
        self._gpus: int | None = None

    def store_address(self) -> StoreAddress:
        return StoreAddress("127.0.0.1", 0, "127.0.0.1")

    def start(self, spec: WorkerSpec, heartbeats: Progress, offer: Offer | None = None
              ) -> Started:
        from bamboo.node import forkserver
        from bamboo.node.worker import worker_main
        cfg = spec.config
        slot = free_device_slot(self._held_slots(), self._visible_gpus(cfg.runtime.device))
        spec = dataclasses.replace(spec, device_index=slot, local_workers=cfg.node_cap)
        # the run directory (the coordinator gives the job its absolute path)
        log = Path(cfg.logging.out or ".") / LOG_DIR / f"{spec.name}.log"
        ctx = forkserver.context()
        reader, writer = ctx.Pipe(duplex=False)
        process = ctx.Process(target=worker_main,
                              args=(spec, writer, heartbeats.beats, heartbeats.cells,
                                    str(log)),
                              name=f"bamboo-{spec.name}")
        process.start()
        writer.close()
        handle = LocalProcess(process, slot)
        self.started = [p for p in self.started if not p.closed and p.exitcode is None] + [handle]
        return Started(handle, reader, device_slot=slot)

    def _held_slots(self) -> set[int]:
        """Device slots of local workers still running, unless already sent SIGKILL (a
        checkpoint-restart's fresh worker takes the GPU of the one it replaces). One with a
        notice keeps its slot until it is gone: it still trains and drains meanwhile."""
        return {p.device_slot for p in self.started
                if not p.closed and p.exitcode is None and not p.killed}

    def _visible_gpus(self, device: str) -> int | None:
        """The GPUs local workers will see (CUDA_VISIBLE_DEVICES applied; None: they run on
        the CPU). Asked once; torch counts through NVML where it can, and the fork server
        is a fresh process, so the workers inherit no CUDA state from this one."""
        if self._gpus is None:
            count = 0
            if device != "cpu":
                import torch
                count = torch.cuda.device_count()
            self._gpus = count
        return self._gpus or None

    def offers(self, timeout_s: float = 0.0) -> list[Offer]:
        return []  # only the trace and checkpoint-restart add local workers, on demand

    def decline(self, offer: Offer, why: str) -> str | None:
        return None

    def expired(self) -> list[tuple[str, str]]:
        return []

    def broken(self, exit_code: int | None = None) -> str | None:
        from bamboo.node import forkserver
        how = forkserver.server_death(
            wait_s=2.0 if exit_code == forkserver.LOST_SERVER_EXIT else 0.0)
        if how is None:
            return None
        return (f"the fork server (pid {forkserver.server_pid()}) that starts the local "
                f"workers {how}, and every local worker died with it")

    def waiting(self, count: int) -> str | None:
        return None

    def progress(self, started: int, count: int) -> str:
        return f"  {started}/{count} local workers started"

    def gave_up(self, started: int, count: int) -> str:
        return f"{started}/{count} local workers started"

    def patience_s(self) -> float:
        return 0.0

    def awaited(self) -> str:
        return "the trace to add a node"

    def close(self, final_status: str | None) -> None:
        pass
