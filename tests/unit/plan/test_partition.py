"""The partitioner: contiguous, complete, optimal, and clear about impossible layouts."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bamboo.plan.partition import PartitionError, partition, stage_of_layer


def brute_force_bottleneck(costs: list[float], stages: int) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@given(st.lists(st.integers(0, 100), min_size=1, max_size=9), st.integers(1, 9))
@settings(max_examples=200, deadline=None)
def test_partition_is_contiguous_complete_and_optimal(costs: list[int], stages: int) -> None:
    if stages > len(costs):
        with pytest.raises(PartitionError):
            partition(costs, stages)
        return
    parts = partition(costs, stages)
    assert len(parts) == stages
    assert [i for r in parts for i in r] == list(range(len(costs)))
    assert all(len(r) > 0 for r in parts)
    bottleneck = max(sum(costs[i] for i in r) for r in parts)
    assert bottleneck == brute_force_bottleneck(costs, stages)


def test_balanced_split_of_equal_layers() -> None:
    assert partition([1] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


def test_heavy_layer_gets_its_own_stage() -> None:
    parts = partition([1, 1, 10, 1, 1], 3)
    assert range(2, 3) in parts
    assert stage_of_layer(parts, 2) == parts.index(range(2, 3))


def test_too_many_stages_says_what_to_change() -> None:
    with pytest.raises(PartitionError, match="use --stages 8 or fewer"):
        partition([1] * 8, 9)
