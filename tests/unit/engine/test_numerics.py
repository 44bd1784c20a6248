"""Numerics and memory without processes: an offloaded optimizer, the gradient sum's dtype,
and the tensor accounting behind summary.json's memory lists. (--precision bf16,
--activation-checkpointing and --frc-offload in real runs:
tests/integration/test_numerics_runs.py.)
"""
from __future__ import annotations

import pytest
import torch

from bamboo.config.presets import preset
from bamboo.engine.memory import SavedTensors, StepMemory
from bamboo.engine.stage import StageState


# -- units -------------------------------------------------------------------------------------


def _stage(**kw: object) -> StageState:
    return StageState(preset=preset("gpt2-tiny"), stage=1, layer_indices=range(2, 4), seed=3,
                      device=torch.device("cpu"), lr=1e-2, weight_decay=0.1, **kw)


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
            assert torch.equal(replica.layer_state(i), primary.layer_state(i))


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
