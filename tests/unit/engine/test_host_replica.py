"""The replica in host memory, stepped off the critical path (`StageState.keep_on_host`,
`apply_later`, `settle`, `promote`): the same bits as a primary stepped in place, every read
waiting for the step under way, its bytes counted as host memory, and what its step raised
raised at the next read. (Kill runs that exercise it end to end: tests/integration/
test_failover.py; the summary's fields: tests/integration/test_numerics_runs.py.)"""
from __future__ import annotations

import threading

import pytest
import torch

from bamboo.config.presets import preset
from bamboo.engine.stage import StageOptimizer, StageState, build_replica


def _stage() -> StageState:
    return StageState(preset=preset("gpt2-tiny"), stage=1, layer_indices=range(2, 4), seed=3,
                      device=torch.device("cpu"), optim=StageOptimizer(1e-2, 0.1))


@pytest.mark.timeout(60)
def test_a_replica_stepped_later_equals_its_primary_at_every_read() -> None:
    primary = _stage()
    replica = build_replica(lambda stage: _stage(), 1, runs_forward=False)
    assert replica is not None and replica.on_host
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        grad = torch.randn(primary.numel, generator=gen)
        coef, lr = (0.5 if step % 2 else 1.0), 1e-2 * (step + 1)
        primary.apply(grad, coef, lr)
        replica.apply_later(grad, coef, lr)
        if step % 2:  # two steps queued before a read: they run in order
            continue
        assert replica.digest() == primary.digest()
        for i in primary.layer_indices:
            assert torch.equal(replica.packed_layer(i), primary.packed_layer(i))
    assert replica.promote() >= 0.0 and not replica.on_host
    assert replica.digest() == primary.digest()


@pytest.mark.timeout(60)
def test_the_step_runs_on_its_own_thread_and_a_read_waits_for_it() -> None:
    replica = _stage()
    replica.keep_on_host()
    ran_on: list[str] = []
    release = threading.Event()
    real_apply = replica.apply

    def slow_apply(*args: object) -> None:
        ran_on.append(threading.current_thread().name)
        release.wait(10)
        real_apply(*args)  # type: ignore[arg-type]

    replica.apply = slow_apply  # type: ignore[method-assign]
    before = replica.digest()
    replica.apply_later(torch.ones(replica.numel), 1.0, 1e-2)
    reader = threading.Thread(target=lambda: ran_on.append(replica.digest()))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive(), "a read did not wait for the step under way"
    release.set()
    reader.join(10)
    assert ran_on[0].startswith("replica-step") and ran_on[1] != before


@pytest.mark.timeout(60)
def test_what_the_step_raised_is_raised_at_the_next_read() -> None:
    replica = _stage()
    replica.keep_on_host()
    with pytest.raises(RuntimeError):  # a gradient of the wrong size
        replica.apply_later(torch.ones(3), 1.0, 1e-2)
        replica.settle()
    replica.settle()  # reported once


def test_a_replica_in_host_memory_counts_as_host_bytes_only() -> None:
    on_device, on_host = _stage(), _stage()
    grad = torch.randn(on_device.numel)
    for st in (on_device, on_host):
        st.apply(grad, 1.0, 1e-2)  # optimizer state exists
    on_host.keep_on_host()
    device_bytes, host_bytes = on_device.memory()
    assert host_bytes == 0 and device_bytes > 0
    assert on_host.memory() == (0, device_bytes)  # no gradient sum: a replica sums none
    assert on_host.digest() == on_device.digest()


def test_a_replica_that_runs_forwards_stays_on_the_device() -> None:
    replica = build_replica(lambda stage: _stage(), 1, runs_forward=True)
    assert replica is not None and not replica.on_host
    assert build_replica(lambda stage: _stage(), None, runs_forward=False) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("yielding", [True, False])
def test_the_replica_step_thread_yields_only_where_told(monkeypatch, yielding: bool) -> None:
    """With a processor of its own the node's replica steps run at the lowest priority (in
    its idle time); else at the node's own priority (shared cores have no idle time)."""
    import os

    from bamboo.engine import replica_steps
    monkeypatch.setattr(replica_steps, "_executor", None)
    monkeypatch.setattr(replica_steps, "_yielding", False)
    replica_steps.yield_to_the_step(yielding)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pending = replica_steps.submit(
        lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    nice = pending.result(timeout=10)
    assert nice == (replica_steps.YIELDING_NICE if yielding else own)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # not the caller's
    replica_steps._executor.shutdown()


@pytest.mark.timeout(60)
def test_a_yielding_thread_that_falls_behind_gives_way_to_a_normal_one(monkeypatch) -> None:
    """A replica step still running when the next is due (other processes took the idle
    time): that step is waited for, and the next runs at the node's own priority."""
    import os

    from bamboo.engine import replica_steps
    monkeypatch.setattr(replica_steps, "_executor", None)
    monkeypatch.setattr(replica_steps, "_yielding", False)
    replica_steps.yield_to_the_step(True)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    replica = _stage()
    replica.keep_on_host()
    release, niceness = threading.Event(), []
    apply = replica.apply

    def slow_apply(*args) -> None:
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        if len(niceness) == 1:
            assert release.wait(10)
        apply(*args)

    monkeypatch.setattr(replica, "apply", slow_apply)
    grad = torch.zeros(replica.numel)
    replica.apply_later(grad, 1.0, 1e-3)
    threading.Timer(0.3, release.set).start()
    replica.apply_later(grad, 1.0, 1e-3)  # the first still runs: behind
    replica.settle()
    assert niceness == [replica_steps.YIELDING_NICE, own]
    assert not replica_steps.yielding()
    replica_steps._executor.shutdown()
