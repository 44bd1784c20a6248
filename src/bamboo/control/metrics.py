"""The job's metrics (`--metric`) of a step or an evaluation, reduced over its global batch.

Each node reports (micro-batch, name, value) for the micro-batches whose last stage it ran;
a micro-batch can be reported twice (an eager FRC's copy, a redo after a failover), always
with the same value, since every forward of it is the same computation. A metric's value for
the step is the mean over its distinct micro-batches, summed in micro-batch order, so it is
the same whichever nodes ran them: what the single-process loop computes.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["reduce_metrics", "MetricRow"]

MetricRow = tuple[int, str, float]
"""(micro-batch, metric name, value)."""


def reduce_metrics(rows: Iterable[MetricRow | list]) -> dict[str, float]:
    """{name: mean over distinct micro-batches} of `rows` (from any number of nodes), names
    in sorted order; {} without rows."""
    values: dict[str, dict[int, float]] = {}
    for mb, name, value in rows:
        values.setdefault(str(name), {}).setdefault(int(mb), float(value))
    return {name: math.fsum(v for _, v in sorted(by_mb.items())) / len(by_mb)
            for name, by_mb in sorted(values.items())}
