"""Runs policies over one trace or a Monte Carlo sweep and builds the contract's JSON.

Run ``r`` of a sweep with seed ``S`` uses the seed ``S * 1_000_003 + r`` for both the
synthetic trace and the placement shuffle, so results do not depend on how runs
are split over worker processes.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from bamboo.traces.trace import Trace, generate_synthetic, load_trace, parse_synthetic_spec

from .core import CATEGORIES, RunResult, SimConfig
from .cost_presets import SimModel
from .policies import make_policy

__all__ = ["TraceSource", "resolve_trace", "run_policies", "summarize", "run_seed"]


@dataclass(slots=True)
class TraceSource:
    """Where traces come from: one file (the same every run) or a synthetic generator."""

    label: str
    synthetic: bool
    make: Callable[[int], Trace]


def run_seed(seed: int, run: int) -> int:
    return seed * 1_000_003 + run


def resolve_trace(spec: str, *, nodes: int = 48, hours: float = 12.0) -> TraceSource:
    """A file path or ``synthetic:...`` spec; file traces are parsed once."""
    if spec.startswith("synthetic:"):
        syn = parse_synthetic_spec(spec, nodes=nodes, hours=hours)
        return TraceSource(spec, True, lambda s: generate_synthetic(syn, s))
    trace = load_trace(spec)
    return TraceSource(spec, False, lambda s: trace)


_CTX: tuple | None = None  # what forked workers run (inherited, never pickled)


def _one_run(run: int) -> list[RunResult]:
    source, policies, preset, config, seed, record = _CTX
    record = record and run == 0
    s = run_seed(seed, run)
    trace = source.make(s)
    out = []
    for name in policies:
        res = make_policy(name, preset, config, s).run(trace, record=record)
        out.append(res)
    return out


def run_policies(
    source: TraceSource,
    policies: list[str],
    preset: SimModel,
    config: SimConfig,
    *,
    runs: int = 1,
    seed: int = 0,
    jobs: int = 1,
    record_first: bool = False,
) -> dict[str, list[RunResult]]:
    """Every policy on every run; returns results per policy in run order."""
    if not source.synthetic and runs > 1 and config.placement == "ordered":
        config = replace(config, placement="random")  # otherwise every run is identical
    global _CTX
    _CTX = (source, policies, preset, config, seed, record_first)
    try:
        if jobs > 1 and runs >= 64 and hasattr(os, "fork"):
            import multiprocessing as mp

            with mp.get_context("fork").Pool(jobs) as pool:
                rows = pool.map(_one_run, range(runs), chunksize=max(1, runs // (jobs * 8)))
        else:
            rows = [_one_run(r) for r in range(runs)]
    finally:
        _CTX = None
    return {name: [row[i] for row in rows] for i, name in enumerate(policies)}


def _r(x: float) -> float:
    return round(float(x), 6)


def _spread(xs: list[float]) -> dict[str, float]:
    xs_sorted = sorted(xs)
    n = len(xs_sorted)

    def q(p: float) -> float:
        return xs_sorted[min(n - 1, max(0, int(math.floor(p * (n - 1) + 0.5))))]

    return {
        "mean": _r(statistics.fmean(xs)),
        "std": _r(statistics.pstdev(xs)) if n > 1 else 0.0,
        "min": _r(xs_sorted[0]),
        "p5": _r(q(0.05)),
        "p50": _r(q(0.5)),
        "p95": _r(q(0.95)),
        "max": _r(xs_sorted[-1]),
    }


def summarize(
    source: TraceSource, preset: SimModel, results: dict[str, list[RunResult]], *, runs: int, seed: int
) -> dict:
    """The contract's JSON (plus extra keys): means over runs, spread when runs > 1."""
    hours = statistics.fmean(r.duration_s for r in next(iter(results.values()))) / 3600.0
    out: dict = {"trace": source.label, "model": preset.name, "hours": _r(hours), "runs": runs, "seed": seed}
    pol: dict = {}
    for name, rs in results.items():
        thr = statistics.fmean(r.throughput for r in rs)
        cph = statistics.fmean(r.cost_per_hour for r in rs)
        total = sum(sum(r.breakdown.values()) for r in rs) or 1.0
        entry = {
            "throughput": _r(thr),
            "cost_per_hour": _r(cph),
            "value": _r(3600.0 * thr / cph) if cph > 0 else 0.0,
            "preemptions": int(round(statistics.fmean(r.preemptions for r in rs))),
            "fatal_failures": int(round(statistics.fmean(r.fatal_failures for r in rs))),
            "reconfigurations": int(round(statistics.fmean(r.reconfigurations for r in rs))),
            "steps": int(round(statistics.fmean(r.steps for r in rs))),
            "breakdown": {c: _r(sum(r.breakdown[c] for r in rs) / total) for c in CATEGORIES},
            "breakdown_s": {c: _r(statistics.fmean(r.breakdown[c] for r in rs)) for c in CATEGORIES},
            "counters": {
                k: _r(statistics.fmean(r.extra.get(k, 0.0) for r in rs))
                for k in sorted({k for r in rs for k in r.extra})
            },
        }
        if runs > 1:
            entry["spread"] = {
                "throughput": _spread([r.throughput for r in rs]),
                "cost_per_hour": _spread([r.cost_per_hour for r in rs]),
                "value": _spread([r.value for r in rs]),
                "fatal_failures": _spread([float(r.fatal_failures) for r in rs]),
                "preemptions": _spread([float(r.preemptions) for r in rs]),
            }
        pol[name] = entry
    out["policies"] = pol
    return out
