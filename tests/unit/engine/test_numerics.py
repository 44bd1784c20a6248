"""Numerics and memory without processes: an offloaded optimizer, the gradient sum's dtype,
and the tensor accounting behind summary.json's memory lists. (--precision bf16,
--activation-checkpointing and --frc-offload in real runs:
tests/integration/test_numerics_runs.py.)
"""
from __future__ import annotations

import pytest
import torch

from bamboo.config.presets import preset
from bamboo.engine.memory import SavedCounts, SavedTensors, StepMemory, signature
from bamboo.engine.stage import StageOptimizer, StageState

# -- units -------------------------------------------------------------------------------------


def _stage(**kw: object) -> StageState:
    return StageState(preset=preset("gpt2-tiny"), stage=1, layer_indices=range(2, 4), seed=3,
                      device=torch.device("cpu"), optim=StageOptimizer(1e-2, 0.1), **kw)


@pytest.mark.timeout(60)
def test_offloaded_optimizer_steps_bit_identically_and_moves_to_the_device() -> None:
    primary, replica = _stage(), _stage()
    replica.offload_optimizer()
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        if step == 3:
            replica.to_device_optimizer()  # adopted: a primary from now on
            assert not replica.optimizer_on_host
        grad = torch.randn(primary.numel, generator=gen)
        primary.apply(grad, 0.5 if step % 2 else 1.0, 1e-2 * (step + 1))
        replica.apply(grad, 0.5 if step % 2 else 1.0, 1e-2 * (step + 1))
        assert replica.digest() == primary.digest()
        for i in primary.layer_indices:
            assert torch.equal(replica.packed_layer(i), primary.packed_layer(i))


@pytest.mark.timeout(60)
def test_stage_memory_and_gradient_sum_dtype() -> None:
    st = _stage()
    params = 4 * st.numel
    assert st.memory() == (params, 0)  # no gradient sum or moments yet (allocated lazily)
    assert st.grad_sum.dtype == torch.float32
    assert _stage(accumulate_dtype=torch.float64).grad_sum.dtype == torch.float64
    st.apply(torch.ones(st.numel), 1.0, 1e-2)
    assert st.memory() == (params + 4 * st.numel + 8 * st.numel, 0)
    st.offload_optimizer()
    assert st.memory() == (params + 4 * st.numel, 8 * st.numel)  # the moments count as host


@pytest.mark.timeout(60)
def test_saved_tensor_hooks_count_each_storage_once_and_offload() -> None:
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)
    counted = SavedTensors()
    with counted.hooks():
        h = x @ w
        q, k = h[:, :8], h[:, 8:]  # two views of one buffer, both saved
        y = (q * k).sum()
    assert counted.device_bytes == x.numel() * 4 + h.numel() * 4  # w is a leaf: not counted
    offloaded = SavedTensors(offload=True)
    with offloaded.hooks():
        z = ((x @ w).tanh()).sum()
    assert offloaded.device_bytes == 0 and offloaded.host_bytes > 0
    y.backward()
    z.backward()
    meter = StepMemory()
    meter.hold("a", 10)
    meter.hold("b", 5, 7)
    assert meter.release("a") and not meter.release("a")
    meter.hold("c", 3)
    assert (meter.device, meter.host, meter.peak_device, meter.peak_host) == (8, 7, 15, 7)


def test_saved_counts_reuse_a_count_recount_and_give_up_on_a_signature_that_varies() -> None:
    counts = SavedCounts(recount_every=3)
    key = (0, signature(torch.ones(2, 4)))
    assert counts.known(key) is None  # never counted
    counts.counted(key, 100)
    assert [counts.known(key) for _ in range(5)] == [100, 100, None, 100, 100]
    counts.counted(key, 100)  # the recount agreed: still reused
    assert counts.known(key) is None  # the 6th use: a recount again
    counts.counted(key, 120)  # it differed: counted on every forward from now on
    assert [counts.known(key) for _ in range(4)] == [None] * 4
    other = (0, signature(torch.ones(3, 4)))  # another shape: a signature of its own
    assert other != key and counts.known(other) is None
    structured = signature((torch.ones(2), torch.zeros(2, dtype=torch.long)))
    assert structured == (((2,), torch.float32, False), ((2,), torch.int64, False))


@pytest.mark.timeout(60)
def test_a_stage_forward_reports_the_same_saved_bytes_counted_or_reused() -> None:
    from bamboo.engine.forward import StageForward
    from bamboo.engine.options import EngineOptions

    st = _stage()  # stage 1 of 4 (gpt2-tiny's layers 2 and 3: d_model 64)
    options = EngineOptions(lr=1e-2, warmup_steps=0, total_steps=4, weight_decay=0.0,
                            grad_clip=0.0, seed=3)
    fwd = StageForward(options=options, device=torch.device("cpu"), P=4,
                       parts=[range(0, 2), range(2, 4), range(4, 6), range(6, 8)],
                       specs=[_Spec()] * 8, loss=lambda a, b: a.sum(), weight=1.0)
    x = torch.randn(2, 16, 64, requires_grad=True)
    reports = []
    for step in range(4):
        f = fwd.run(st, 0, x, step, targets=lambda: None)
        f.out.sum().backward()
        reports.append(f.device_bytes)
    assert reports[0] > 0 and reports == [reports[0]] * 4
    assert fwd.saved_counts.known((1, signature(x))) == reports[0]  # reused, not recounted


class _Spec:
    def cast(self, out):
        return out
