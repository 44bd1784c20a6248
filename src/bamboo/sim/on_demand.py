"""The simulator's ``on-demand`` policy: a fixed on-demand cluster, never preempted, so its
result is closed form; and the size of that cluster (``--on-demand ref|matched|N``)."""

from __future__ import annotations

from bamboo.traces.trace import Trace

from .core import Policy, RunResult, SimConfig
from .cost_presets import SimModel

__all__ = ["OnDemandPolicy", "on_demand_layout"]


def _mean_live(trace: Trace) -> float:
    """Time-averaged number of live instances in a trace."""
    live = 0
    area = 0.0
    prev = 0.0
    for t, k in zip(trace.times, trace.kinds):
        area += live * (t - prev)
        prev = t
        live += k
    area += live * (trace.duration - prev)
    return area / trace.duration if trace.duration > 0 else float(live)


def on_demand_layout(preset: SimModel, config: SimConfig, trace: Trace) -> tuple[int, float]:
    """(nodes, seconds per step) of the on-demand cluster the config asks for."""
    what = config.on_demand
    if what == "ref":
        return preset.on_demand_nodes, preset.on_demand_step_s
    if what == "matched":
        d = int(round(_mean_live(trace) / preset.stages))
    else:
        d = int(what) // preset.stages
    d = max(1, min(d, preset.max_pipelines))
    return d * preset.stages, preset.plain_step_time(d)


class OnDemandPolicy(Policy):
    """A fixed on-demand cluster: never preempted, so the result is closed form."""

    name = "on-demand"

    def run(self, trace: Trace, record: bool = False) -> RunResult:
        H = trace.duration
        nodes, tau = on_demand_layout(self.preset, self.cfg, trace)
        start = min(self.cfg.alloc_delay_s, H)
        steps = int((H - start) / tau + 1e-9)
        samples = steps * self.preset.samples_per_step
        cost = nodes * self.cfg.on_demand_price * H / 3600.0
        breakdown = {c: 0.0 for c in ("useful", "redundant", "checkpoint", "restart", "rebalance", "lost", "idle")}
        breakdown["useful"] = steps * tau
        breakdown["idle"] = start
        breakdown["lost"] = H - start - steps * tau
        timeline = None
        if record:
            timeline = [(0.0, nodes, 0, 0.0)]
            n = 200
            for i in range(1, n + 1):
                t = H * i / n
                k = max(0, int((t - start) / tau + 1e-9)) if t > start else 0
                timeline.append((t, nodes, k * self.preset.samples_per_step, nodes * self.cfg.on_demand_price * t / 3600))
        return RunResult(
            policy=self.name, duration_s=H, steps=steps, samples=samples, cost=cost,
            preemptions=0, fatal_failures=0, reconfigurations=0, breakdown=breakdown,
            extra={"nodes": nodes, "step_s": tau}, timeline=timeline,
        )
