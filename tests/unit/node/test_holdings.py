"""What a worker holds between generations (`bamboo.node.holdings.Holdings`): a kept stage
taken into the next engine is the stage a new engine would build and load from the packed
state (the same bits before and after a further step), a step dropped midway leaves nothing
behind in it, and only the stage of the same layers from no peer is taken. (End to end, a
loss and a join at one stage whose survivors take their stages: tests/integration/
test_reconfig.py and the kill tests.)"""
from __future__ import annotations

import pytest
import torch

from bamboo.config.presets import preset
from bamboo.engine.stage import StageOptimizer, StageState, build_replica
from bamboo.node.holdings import Holdings


def _stage(stage: int = 1, layers: range = range(2, 4)) -> StageState:
    return StageState(preset=preset("gpt2-tiny"), stage=stage, layer_indices=layers, seed=3,
                      device=torch.device("cpu"), optim=StageOptimizer(1e-2, 0.1))


def _trained(steps: int) -> StageState:
    st = _stage()
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        st.apply(torch.randn(st.numel, generator=gen), 1.0, 1e-2 * (step + 1))
    return st


def _half_a_step(st: StageState) -> None:
    """What a step dropped midway leaves: gradients on the parameters, a partial sum."""
    for p in st.params:
        p.grad = torch.ones_like(p)
    st.grad_sum.add_(3.0)


@pytest.mark.timeout(60)
def test_a_kept_stage_equals_one_built_and_loaded_from_its_packed_state() -> None:
    kept = _trained(3)
    _half_a_step(kept)
    holdings = Holdings()
    holdings.take([kept], {1: kept}, step=3)
    assert holdings.kept == {1: kept} and holdings.packed == {}
    loaded = _stage()
    for i in loaded.layer_indices:
        packed = holdings.layer(i)
        assert packed is not None
        loaded.load_layer_state(i, packed)
    reused = holdings.reusable({1: range(2, 4)}, incoming=set())
    assert reused == {1: kept}
    assert all(p.grad is None for p in kept.params)
    assert not kept.grad_sum.any() and kept.module.training
    grad = torch.randn(kept.numel, generator=torch.Generator().manual_seed(2))
    for st in (kept, loaded):
        assert st.digest() == _trained(3).digest()
        st.apply(grad, 0.5, 3e-2)  # the optimizer's state is the same too
    assert kept.digest() == loaded.digest()
    for i in kept.layer_indices:
        assert torch.equal(kept.packed_layer(i), loaded.packed_layer(i))


@pytest.mark.timeout(60)
def test_only_the_same_layers_from_no_peer_are_taken() -> None:
    kept = _trained(1)
    holdings = Holdings()
    holdings.take([kept], {1: kept}, step=1)
    assert holdings.reusable({1: range(2, 5)}, incoming=set()) == {}  # a new partition
    assert holdings.reusable({1: range(2, 4)}, incoming={3}) == {}  # a peer sends a layer
    assert holdings.reusable({0: range(2, 4)}, incoming=set()) == {}  # another stage's index
    assert holdings.reusable({1: range(2, 4)}, incoming={7}) == {1: kept}
    holdings.clear()
    assert holdings.reusable({1: range(2, 4)}, incoming=set()) == {} and holdings.sizes() == {}


@pytest.mark.timeout(60)
def test_what_is_not_kept_is_packed_and_every_layer_is_sized_as_it_is_sent() -> None:
    primary = _trained(2)
    replica = build_replica(lambda stage: _stage(0, range(0, 2)), 0, runs_forward=False)
    assert replica is not None and replica.on_host
    holdings = Holdings()
    holdings.take([primary, replica], {1: primary}, step=2)
    assert set(holdings.kept) == {1} and set(holdings.packed) == {0, 1}
    sizes = holdings.sizes()
    assert list(sizes) == [0, 1, 2, 3]
    for i, size in sizes.items():
        packed = holdings.layer(i)
        assert packed is not None and packed.nbytes == size
    assert holdings.layer(9) is None
    # A primary in host memory (an adopted replica not yet promoted) is packed, not kept.
    holdings.take([replica], {0: replica}, step=2)
    assert holdings.kept == {} and set(holdings.packed) == {0, 1}


@pytest.mark.timeout(60)
def test_a_stage_built_ahead_is_taken_once_for_its_own_layers_and_outlives_a_clear() -> None:
    """A standby's spare holds no state: a clear (stale state dropped) keeps it; it is taken
    only as the same stage of the same layers, once, and loads to the bits of a stage built
    at the join."""
    holdings = Holdings()
    spare = _stage(0, range(0, 8))
    holdings.spare = spare
    holdings.clear()
    assert holdings.built(0, range(0, 4)) is None and holdings.built(1, range(0, 8)) is None
    assert holdings.spare is not None
    taken = holdings.built(0, range(0, 8))
    assert taken is spare and holdings.spare is None and holdings.built(0, range(0, 8)) is None
    source = _trained(2)  # layers 2-3 of a trained stage, into the spare and a fresh build
    fresh = _stage(0, range(0, 8))
    for st in (taken, fresh):
        for i in source.layer_indices:
            st.load_layer_state(i, source.packed_layer(i))
    for a, b in zip(taken.params, fresh.params):
        assert torch.equal(a, b)
    assert torch.equal(taken.packed_layer(2), fresh.packed_layer(2))
