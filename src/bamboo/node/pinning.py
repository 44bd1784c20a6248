"""`--pin-cpus auto`: each local worker on cores of its own, as each node has its own GPU.

With more workers than cores there is no idle time in a pipeline: a worker's wait is
another worker running. Pinning gives each worker a processor, so its bubbles are real
idle time (the case every claim about bubbles is measured in). A worker's cores follow
its device slot, which no other live worker on the machine holds (`free_device_slot`).
"""
from __future__ import annotations

import os

__all__ = ["cores_for", "pin_this_process"]


def cores_for(slot: int | None, workers: int, available: list[int]) -> list[int] | None:
    """The cores of the worker in `slot` when `workers` share `available` ones: an equal,
    disjoint share each; None when there are fewer cores than workers (or the slot is past
    them: a worker that still ends while its replacement starts)."""
    if slot is None or workers < 1 or len(available) < workers or not 0 <= slot < workers:
        return None
    share = len(available) // workers
    return available[slot * share:(slot + 1) * share]


def pin_this_process(mode: str, slot: int | None, workers: int) -> list[int] | None:
    """Pin the calling worker under `--pin-cpus mode`; the cores it runs on, or None when it
    stays unpinned. Its torch threads are set to their number."""
    if mode != "auto":
        return None
    cores = cores_for(slot, workers, sorted(os.sched_getaffinity(0)))
    if cores is None:
        return None
    os.sched_setaffinity(0, cores)
    import torch
    torch.set_num_threads(len(cores))
    return cores
