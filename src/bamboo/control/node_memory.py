"""The workers' real memory over the run: peaks, growth per step, and a warning on a leak.

Every step report carries its process's resident memory at the end of the step (and, on
CUDA, the allocator's peak and reserved bytes: `bamboo.node.procmem`). Per node this
keeps the series of (step, rss) and gives the summary's fields:

- `rss_per_node_bytes`: the node's peak resident memory (its high-water mark);
- `rss_growth_per_step_bytes`: the least-squares slope of its end-of-step resident memory
  over the second half of the steps it reported (null with fewer than
  `MIN_SLOPE_POINTS` there), the figure a leak shows in;
- `cuda_peak_per_node_bytes`, `cuda_reserved_per_node_bytes`: the allocator's maxima.

A node whose memory grew in each of its last `GROWTH_STEPS` steps, by at least
`GROWTH_BYTES` in all, is reported once (`memory_growth` event and one line of output):
allocator noise moves resident memory both ways between steps, a leak only up.

What it keeps per node is bounded however long the run: the last `GROWTH_STEPS + 1`
samples for the warning, and for the slope at most `2 * MAX_POINTS` samples, thinned to
every other one (and the stride doubled) each time that fills up.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from bamboo.protocol.messages import StepReport

__all__ = ["MemoryWatch", "GROWTH_STEPS", "GROWTH_BYTES", "MIN_SLOPE_POINTS", "growth_slope"]

GROWTH_STEPS = 10
"""Consecutive steps of growth that make a node's memory a suspected leak."""
GROWTH_BYTES = 32 << 20
"""...and the least those steps must add in all (32 MiB: a page cache or an allocator arena
settling adds a few MiB early in a run; a leak of FRC graphs adds tens of MiB a step)."""
MIN_SLOPE_POINTS = 4
"""Fewest end-of-step samples in the second half that a growth slope is computed from."""
WARM_UP_STEPS = 2
"""A node's first reported steps are left out of the warning (caches filling up)."""
MAX_POINTS = 1024
"""Samples kept per node for the slope: between MAX_POINTS and 2 * MAX_POINTS."""


def growth_slope(series: list[tuple[int, int]]) -> float | None:
    """Bytes per step: the least-squares slope of (step, bytes) over the second half of
    `series`; None when that half has fewer than MIN_SLOPE_POINTS distinct steps."""
    half = series[len(series) // 2:]
    if len({s for s, _ in half}) < MIN_SLOPE_POINTS:
        return None
    slope, _ = statistics.linear_regression([float(s) for s, _ in half],
                                            [float(b) for _, b in half])
    return slope


@dataclass(slots=True)
class _Node:
    series: list[tuple[int, int]] = field(default_factory=list)
    """(step, resident bytes at the end of that step), every `stride`-th report, in order."""
    stride: int = 1
    reports: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=GROWTH_STEPS + 1))
    """The last reports' resident bytes (the warning's window)."""
    peak: int = 0
    cuda_peak: int = 0
    cuda_reserved: int = 0
    warned: bool = False


class MemoryWatch:
    """Per-node memory from the step reports; `warn(node, text, fields)` is called once per
    node whose memory keeps growing."""

    def __init__(self, warn: Callable[[str, str, dict], None]) -> None:
        self._warn = warn
        self.nodes: dict[str, _Node] = {}

    def note(self, name: str, r: StepReport) -> None:
        if r.rss_bytes <= 0:  # a report from a worker that measured nothing
            return
        n = self.nodes.setdefault(name, _Node())
        if n.reports % n.stride == 0:
            n.series.append((r.step, r.rss_bytes))
            if len(n.series) >= 2 * MAX_POINTS:
                n.series, n.stride = n.series[::2], 2 * n.stride
        n.reports += 1
        if n.reports > WARM_UP_STEPS:
            n.recent.append(r.rss_bytes)
        n.peak = max(n.peak, r.rss_peak_bytes, r.rss_bytes)
        n.cuda_peak = max(n.cuda_peak, r.cuda_peak_bytes)
        n.cuda_reserved = max(n.cuda_reserved, r.cuda_reserved_bytes)
        if not n.warned and self._keeps_growing(list(n.recent)):
            n.warned = True
            per_step = (n.recent[-1] - n.recent[0]) / GROWTH_STEPS
            self._warn(name, f"{name}'s resident memory grew in each of its last "
                             f"{GROWTH_STEPS} steps ({per_step / 2**20:.1f} MiB a step, "
                             f"now {r.rss_bytes / 2**20:.0f} MiB): a memory leak?",
                       {"node": name, "steps": GROWTH_STEPS, "bytes_per_step": int(per_step),
                        "rss_bytes": r.rss_bytes, "step": r.step})

    @staticmethod
    def _keeps_growing(recent: list[int]) -> bool:
        if len(recent) < GROWTH_STEPS + 1:
            return False
        rising = all(b > a for a, b in zip(recent, recent[1:]))
        return rising and recent[-1] - recent[0] >= GROWTH_BYTES

    def fields(self, names: list[str]) -> dict[str, list]:
        """The summary's lists, in the order of `names` (0 / null for a node without samples)."""
        empty = _Node()
        nodes = [self.nodes.get(name, empty) for name in names]
        return {"rss_per_node_bytes": [n.peak for n in nodes],
                "rss_growth_per_step_bytes": [None if (g := growth_slope(n.series)) is None
                                              else round(g) for n in nodes],
                "cuda_peak_per_node_bytes": [n.cuda_peak for n in nodes],
                "cuda_reserved_per_node_bytes": [n.cuda_reserved for n in nodes]}
