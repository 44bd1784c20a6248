"""Real memory: what the saved-tensor hooks keep alive (weak references, in one process),
resident memory as the operating system sees it, and the coordinator's slope and warning.

Tensor accounting (`memory_per_node_bytes`) did not see eager FRC's leak: every redundant
forward's graph stayed alive through a reference cycle the saved-tensor hooks made. Every
redundancy mode run for real, its resident memory flat:
tests/integration/test_memory_growth_runs.py.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from bamboo.control.node_memory import GROWTH_STEPS, MemoryWatch, growth_slope
from bamboo.engine.memory import SavedTensors
from bamboo.node import procmem
from bamboo.protocol.messages import StepReport

# -- in one process: what the saved-tensor hooks keep alive ---------------------------------


def _forward_under_hooks(offload: bool) -> weakref.ref:
    """A forward whose ops save their own outputs (softmax, exp), never backwarded; a weak
    reference to its output."""
    w = torch.randn(64, 64, requires_grad=True)
    hooks = SavedTensors(offload=offload)
    with hooks.hooks():
        y = torch.softmax(torch.randn(16, 64) @ w, -1).exp()
    assert hooks.device_bytes + hooks.host_bytes > 0  # it did count what was saved
    return weakref.ref(y)


@pytest.mark.parametrize("offload", [False, True])
def test_a_forward_that_is_never_backwarded_is_freed(offload: bool) -> None:
    ref = _forward_under_hooks(offload)
    gc.collect()
    assert ref() is None, "the saved-tensor hooks keep a redundant forward's graph alive"


@pytest.mark.parametrize("offload", [False, True])
def test_hooks_give_the_same_gradients_as_no_hooks(offload: bool) -> None:
    torch.manual_seed(0)
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(8, 32)

    def loss() -> torch.Tensor:
        return torch.tanh(torch.softmax(x @ w, -1).exp()).sum()

    loss().backward()
    plain, w.grad = w.grad.clone(), None
    with SavedTensors(offload=offload).hooks():
        out = loss()
    out.backward()
    assert torch.equal(plain, w.grad)


def test_in_place_change_of_a_saved_tensor_is_still_caught() -> None:
    x = torch.randn(8, requires_grad=True)
    with SavedTensors().hooks():
        y = x.exp()
        z = y.exp()  # saves y
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_resident_memory_is_read_and_moves_with_allocations() -> None:
    before = procmem.sample()
    assert 0 < before.rss <= before.rss_peak
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    after = procmem.rss_bytes()
    assert after - before.rss >= 48 << 20
    del block


# -- the coordinator's view: slope and the warning ------------------------------------------


def _report(step: int, rss: int) -> StepReport:
    return StepReport(step=step, rank=0, stages=[0], rss_bytes=rss, rss_peak_bytes=rss)


def test_growth_slope_is_the_second_half_and_needs_points() -> None:
    assert growth_slope([(s, 100) for s in range(6)]) is None  # 3 points in the second half
    assert growth_slope([(s, 100) for s in range(8)]) == 0
    series = [(s, 10_000 if s < 10 else 10_000 + 500 * s) for s in range(20)]
    assert growth_slope(series) == pytest.approx(500)
    assert growth_slope([(0, 1), (1, 2)]) is None


def test_a_node_that_keeps_growing_is_reported_once() -> None:
    warnings: list[tuple[str, dict]] = []
    watch = MemoryWatch(lambda node, text, fields: warnings.append((text, fields)))
    for step in range(40):
        watch.note("n1", _report(step, (300 << 20) + step * (5 << 20)))
        watch.note("n0", _report(step, (300 << 20) + (step % 3) * (2 << 20)))  # noise
    assert len(warnings) == 1
    text, fields = warnings[0]
    assert "n1" in text and f"last {GROWTH_STEPS} steps" in text
    assert fields["node"] == "n1" and fields["bytes_per_step"] == 5 << 20
    summary = watch.fields(["n0", "n1", "n2"])
    assert summary["rss_per_node_bytes"][1] == (300 << 20) + 39 * (5 << 20)
    assert summary["rss_growth_per_step_bytes"][1] == 5 << 20
    assert abs(summary["rss_growth_per_step_bytes"][0]) < 1 << 20
    assert summary["rss_growth_per_step_bytes"][2] is None  # no samples


def test_what_a_node_keeps_is_bounded_and_its_slope_survives_thinning() -> None:
    from bamboo.control.node_memory import MAX_POINTS
    watch = MemoryWatch(lambda *a: None)
    steps = 10 * MAX_POINTS
    for step in range(steps):  # 1 KiB a step, with +-64 KiB of alternating noise
        watch.note("n0", _report(step, (300 << 20) + step * 1024 + (step % 2) * (64 << 10)))
    node = watch.nodes["n0"]
    assert MAX_POINTS <= len(node.series) < 2 * MAX_POINTS and len(node.recent) == GROWTH_STEPS + 1
    assert node.series[-1][0] >= steps - node.stride
    assert watch.fields(["n0"])["rss_growth_per_step_bytes"][0] == pytest.approx(1024, rel=0.05)


def test_small_steady_growth_is_not_a_warning() -> None:
    warnings: list = []
    watch = MemoryWatch(lambda *a: warnings.append(a))
    for step in range(40):  # 64 KiB every step: below GROWTH_BYTES over GROWTH_STEPS
        watch.note("n0", _report(step, (300 << 20) + step * (64 << 10)))
    assert warnings == []
