"""The cost part of a run's report (`bamboo.run.report`): live nodes over time, and the run's
cost on spot against the same steps on on-demand instances, cumulative per step.

Spot pays every live node (standbys and replacements included) from its `node_up` to its
`node_lost` or the run's end. On-demand runs the same steps on the failure-free node count
for as long as the run took from its first node's start, less the pauses its failures cost,
each taken off at the step it was measured on (`node_lost` and `loss_cost` events follow
that step's `step_done`), so on-demand never pays for spot's losses or reconfigurations.
"""
from __future__ import annotations

from dataclasses import dataclass

from bamboo.run.report_data import Failure, Prices, Run, end_time, is_num, pauses_of

__all__ = ["Cost", "cost", "cost_lines", "live_nodes"]


def live_nodes(run: Run) -> list[tuple[float, int]]:
    """(t, live nodes from t on), from node_up / node_lost; all gone at the run's end."""
    live: set[str] = set()
    series: list[tuple[float, int]] = [(0.0, 0)]
    for e in run.events:
        if e["event"] == "node_up":
            live.add(e["node"])
        elif e["event"] == "node_lost":
            live.discard(e["node"])
        else:
            continue
        series.append((float(e["t"]), len(live)))
    series.append((max(end_time(run), series[-1][0]), 0))
    return series


def _node_seconds(series: list[tuple[float, int]], until: float) -> float:
    total = 0.0
    for (t0, n), (t1, _) in zip(series, series[1:]):
        total += n * max(0.0, min(t1, until) - t0) if t0 < until else 0.0
    return total


def _start_time(run: Run) -> float:
    ups = run.of("node_up")
    return float(ups[0]["t"]) if ups else 0.0


def _failure_free_nodes(run: Run) -> int:
    cfg = run.config
    try:
        return int((cfg.get("pipelines") or cfg["nodes"] // cfg["stages"]) * cfg["stages"])
    except (KeyError, TypeError, ZeroDivisionError):
        return max((n for _, n in live_nodes(run)), default=0)


@dataclass(kw_only=True, slots=True)
class Cost:
    steps: list[int]
    spot: list[float]
    on_demand: list[float]
    node_seconds: float
    on_demand_nodes: int
    on_demand_s: float


def _charged_by_step(run: Run) -> list[tuple[float, float]]:
    """(t, seconds of pauses charged so far) at each step_done, in order. A loss's pause is
    charged to the step it was measured on: its `node_lost` event (written with the record of
    the step it happened in, or of the step redone) and each `loss_cost` event (written with
    the record of the first step after the reconfiguration it caused) follow that step's
    `step_done`."""
    points: list[list[float]] = []
    charged = 0.0
    for e in run.events:
        kind = e["event"]
        if kind == "step_done":
            points.append([float(e["t"]), charged])
            continue
        value = e.get("pause_s") if kind == "node_lost" else \
            e.get("added_s") if kind == "loss_cost" else None
        if is_num(value):
            charged += float(value)
            if points:
                points[-1][1] = charged
    return [(t, c) for t, c in points]


def cost(run: Run, failures: list[Failure], prices: Prices) -> Cost:
    """Cumulative $ after each step: the run's node-seconds on spot, and the same steps on
    the failure-free node count at on-demand prices, taking as long as this run did since
    its first node started, less the pauses its failures cost (each taken off at the step
    it was measured on: on-demand never pays for spot's losses or reconfigurations)."""
    series, start, n = live_nodes(run), _start_time(run), _failure_free_nodes(run)
    pauses = pauses_of(run, failures)
    steps, spot, od = [0], [0.0], [0.0]
    for i, (t, charged) in enumerate(_charged_by_step(run), start=1):
        steps.append(i)
        spot.append(_node_seconds(series, t) * prices.spot / 3600)
        on_demand_s = max(0.0, t - start - charged)
        od.append(max(od[-1], n * on_demand_s * prices.on_demand / 3600))  # never falls
    end = end_time(run)
    total_od_s = max(0.0, end - start - sum(pauses))
    return Cost(steps=steps, spot=spot, on_demand=od, node_seconds=_node_seconds(series, end),
                 on_demand_nodes=n, on_demand_s=total_od_s)


def _money(x: float) -> str:
    return f"${x:.2f}" if x >= 1 else f"${x:.4f}"


def cost_lines(c: Cost, prices: Prices) -> list[str]:
    spot = c.node_seconds * prices.spot / 3600
    od = c.on_demand_nodes * c.on_demand_s * prices.on_demand / 3600
    saving = ""
    if od > 0:
        ratio = 1 - spot / od
        saving = (f" (spot saves {100 * ratio:.1f}%)" if ratio >= 0
                  else f" (spot costs {-100 * ratio:.1f}% more)")
    return [
        f"cost on spot: {_money(spot)} for {c.node_seconds:.1f} node-seconds at "
        f"${prices.spot:.2f}/node-hour",
        f"cost on on-demand: {_money(od)} for {c.on_demand_nodes} nodes x {c.on_demand_s:.1f} s "
        f"at ${prices.on_demand:.2f}/node-hour{saving}",
        "  assumption: on-demand runs the same steps on the failure-free node count "
        "(pipelines x stages) for as long as this run took from its first node's start, "
        "less the pauses its failures cost (each loss's pause includes the reconfiguration "
        "it caused); spot pays every live node (standbys and "
        "replacements included) from node_up to node_lost or the run's end.",
    ]
