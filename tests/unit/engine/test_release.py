"""What a node gives up is released soon and off the caller's thread (`bamboo.engine.comm.
bury`): an abandoned group's sockets close within seconds, not at its timeout, and
abandoning a group never waits for a collective still blocked on it.

Real gloo groups of two or three ranks in one process (threads), a rank never joining the
collective, as a node that gave the group up or was lost does not."""
from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from bamboo.engine.comm import P2P, bury
from bamboo.plan.faults import FaultPlan
from support.gloo import gloo_options


def _sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return count


def _form(size: int, timeout_s: float) -> list[dist.ProcessGroup]:
    store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False)
    groups: list[dist.ProcessGroup | None] = [None] * size

    def join(rank: int) -> None:
        own = dist.TCPStore("127.0.0.1", store.port, size, False)
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("g", own), rank, size,
                                             gloo_options(timeout_s))
    threads = [threading.Thread(target=join, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(g is not None for g in groups), "the ranks did not form their group"
    return groups  # type: ignore[return-value]


def _until(condition: Callable[[], bool], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@pytest.mark.timeout(60)
def test_an_abandoned_group_is_released_within_seconds_not_at_its_timeout() -> None:
    # Rank 1 launches a collective rank 0 never joins (rank 0 gave the group up after a
    # loss): its bytes reach rank 0 and would stay unread for as long as the group lives.
    groups = _form(2, timeout_s=60.0)
    sent = groups[1].allreduce([torch.ones(1 << 18)])
    time.sleep(0.5)
    p2p = P2P(groups.pop(0))
    before = _sockets()
    p2p.abandon()
    del p2p
    assert _until(lambda: _sockets() < before, 5.0), \
        "rank 0's group was not released within seconds (its timeout is 60 s)"
    with pytest.raises(RuntimeError):  # rank 1 sees the group closed, not its timeout
        sent.wait()


@pytest.mark.timeout(60)
def test_abandoning_a_group_never_waits_for_its_blocked_collective() -> None:
    # Ranks 0 and 1 launch a collective that rank 2 (lost) never joins: blocked until the
    # group's timeout. Dropping rank 0's group waits for it, on the release thread only.
    groups = _form(3, timeout_s=4.0)
    works = [groups[r].allreduce([torch.ones(1 << 10)]) for r in (0, 1)]
    p2p = P2P(groups.pop(0))
    works.pop(0)
    start = time.monotonic()
    p2p.abandon()
    del p2p
    time.sleep(1.5)  # past the grace: the release has begun, and waits
    assert time.monotonic() - start < 2.0, "abandoning waited for the blocked collective"
    with pytest.raises(RuntimeError):
        works[0].wait()


@pytest.mark.timeout(30)
def test_an_emptied_engines_parts_are_freed_off_the_callers_thread_without_a_collection() -> None:
    freed_on: list[str] = []

    class Part:
        def __del__(self) -> None:
            freed_on.append(threading.current_thread().name)

    class Engine:  # an engine and its parts refer to each other
        def __init__(self) -> None:
            self.me, self.part = self, Part()

    engine = Engine()
    parts = dict(vars(engine))
    vars(engine).clear()  # what the worker does to a finished generation's engine
    del engine
    gc.disable()
    try:
        bury(parts)
        del parts
        assert _until(lambda: bool(freed_on), 5.0), "the part was not freed"
    finally:
        gc.enable()
    assert freed_on == ["release"]


def test_a_detached_fault_plan_keeps_no_engine_alive() -> None:
    class Engine:
        def holds(self, pipeline: int, stage: int) -> bool:
            return True

    plan, engine = FaultPlan([]), Engine()
    plan.begin(3, engine.holds)
    assert plan.holds(0, 0)
    plan.detach()
    assert not plan.holds(0, 0) and getattr(plan.holds, "__self__", None) is not engine
