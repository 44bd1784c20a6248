"""Speed of the simulator: events per second, the whole p3 trace with every policy, 10,000 synthetic runs.

Run: .venv/bin/python benchmarks/sim_speed.py [--runs 10000] [--jobs 2] [--p 0.10]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bamboo.sim.core import SimConfig
from bamboo.sim.policies import make_policy
from bamboo.sim.presets import get_preset
from bamboo.sim.runner import resolve_trace, run_policies
from bamboo.sim.traces import generate_synthetic, load_trace, parse_synthetic_spec

P3 = Path(__file__).resolve().parents[2] / "shared" / "traces" / "aws-p3-2xlarge.csv"
ALL = ["bamboo", "checkpoint", "on-demand", "adaptive"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--p", type=float, default=0.10)
    ap.add_argument("--trace", default=str(P3) if P3.exists() else "/work/shared/traces/aws-p3-2xlarge.csv")
    args = ap.parse_args()
    preset, cfg = get_preset("gpt2"), SimConfig()

    trace = load_trace(args.trace)
    t0 = time.perf_counter()
    for name in ALL:
        make_policy(name, preset, cfg).run(trace)
    t_p3 = time.perf_counter() - t0
    print(f"p3 trace ({trace.duration / 3600:.1f} h, {len(trace.times)} rows), all {len(ALL)} policies: {t_p3 * 1000:.1f} ms")

    spec = parse_synthetic_spec(f"synthetic:p={args.p}")
    sample = [generate_synthetic(spec, s) for s in range(200)]
    t0 = time.perf_counter()
    events = 0
    for tr in sample:
        pol = make_policy("bamboo", preset, cfg)
        pol.run(tr)
        events += len(tr.times) + pol.seq + len(tr.times) // 2  # trace rows + timers + ready events (approx.)
    dt = time.perf_counter() - t0
    print(f"bamboo policy, one process: {events / dt:,.0f} events/s ({len(sample) / dt:,.0f} runs/s)")

    for policies in (["bamboo"], ALL):
        source = resolve_trace(f"synthetic:p={args.p}")
        t0 = time.perf_counter()
        run_policies(source, policies, preset, cfg, runs=args.runs, seed=1, jobs=args.jobs)
        dt = time.perf_counter() - t0
        print(f"{args.runs} synthetic runs (p={args.p}, 48 nodes, 12 h, trace generation included), "
              f"policies={','.join(policies)}, jobs={args.jobs}: {dt:.1f} s")


if __name__ == "__main__":
    main()
