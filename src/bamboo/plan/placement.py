"""Placement across machines: a stage's replica never on the machine of its primary.

The node of stage s of a pipeline also holds the replica of stage s+1 (mod P). When an
agent runs several workers, losing its machine loses all of them at once, so a stage whose
primary and replica holder share a machine would lose both copies together and need a
checkpoint. `spread` reorders the slot assignment so that consecutive stages of every
pipeline sit on different machines wherever the machines allow, moving as little state as
possible: swaps that remove the most conflicts come first, and among equal ones those that
cost the least (by the caller's `cost` of a node in a slot).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["conflicts", "spread"]


def _pairs(slots: int, stages: int) -> list[tuple[int, int]]:
    """(holder slot, replica-of slot): slot k holds the replica of the next stage."""
    if stages < 2:
        return []
    return [(k, (k // stages) * stages + (k % stages + 1) % stages) for k in range(slots)]


def conflicts(active: Sequence[str], machine_of: Callable[[str], str | None], stages: int) -> int:
    """Stages whose replica holder is on the primary's machine."""
    return sum(1 for a, b in _pairs(len(active), stages)
               if machine_of(active[a]) is not None and machine_of(active[a]) == machine_of(active[b]))


def spread(active: Sequence[str], machine_of: Callable[[str], str | None], stages: int,
           cost: Callable[[str, int], float] = lambda node, slot: 0.0,
           max_swaps: int = 256) -> list[str]:
    """`active` (node per slot, slot = pipeline * stages + stage) with swaps that leave
    fewer primary/replica pairs on one machine; unchanged when nodes are all on different
    machines (machine None: a machine of its own)."""
    order = list(active)
    n = len(order)
    current = conflicts(order, machine_of, stages)
    for _ in range(max_swaps):
        if current == 0:
            break
        best: tuple[int, float, int, int] | None = None
        for i in range(n):
            for j in range(i + 1, n):
                if machine_of(order[i]) == machine_of(order[j]):
                    continue
                order[i], order[j] = order[j], order[i]
                after = conflicts(order, machine_of, stages)
                order[i], order[j] = order[j], order[i]
                if after >= current:
                    continue
                delta = (cost(order[j], i) + cost(order[i], j)) - (cost(order[i], i) + cost(order[j], j))
                key = (after, delta, i, j)
                if best is None or key < best:
                    best = key
        if best is None:
            break
        current, _, i, j = best
        order[i], order[j] = order[j], order[i]
    return order
