"""Split a layer list into contiguous, cost-balanced pipeline stages.

Costs are per layer: parameter counts by default, measured times when profiled.
The split minimises the largest stage cost (the pipeline's bottleneck) exactly,
by dynamic programming over cut points.
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PartitionError", "partition", "stage_of_layer"]


class PartitionError(ValueError):
    """A layout that cannot be partitioned; the message says what to change."""


def partition(costs: Sequence[float], stages: int) -> list[range]:
    """Contiguous ranges of layer indices, one per stage, minimising the max stage cost.

    Among splits with the same bottleneck, the one with earlier cuts is chosen, so
    the result is deterministic.
    """
    n = len(costs)
    if stages < 1:
        raise PartitionError(f"stages must be at least 1 (got {stages})")
    if stages > n:
        raise PartitionError(f"cannot split {n} layers into {stages} stages: "
                             f"use --stages {n} or fewer")
    if any(c < 0 for c in costs):
        raise PartitionError("layer costs must be non-negative")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    inf = float("inf")
    # best[k][i]: minimal bottleneck covering layers [0, i) with k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        bounds.append(range(j, i))
        i = j
    return bounds[::-1]


def stage_of_layer(parts: Sequence[range], layer: int) -> int:
    """The stage whose range holds `layer`."""
    for stage, r in enumerate(parts):
        if layer in r:
            return stage
    raise IndexError(f"layer {layer} is in no stage")
