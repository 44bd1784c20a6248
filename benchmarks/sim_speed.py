"""Speed of `bamboo simulate`: events per second, the whole p3 trace, 10,000 synthetic runs.

Run from the repository root (or anywhere):

    .venv/bin/python benchmarks/sim_speed.py [--trace FILE] [--runs 10000] [--jobs 2] [--p 0.10]

The default trace is traces/aws-p3-2xlarge.csv in the repository. It prints: the whole trace with
every policy (best of 5), events per second of each cluster policy, and the wall time
of ``--runs`` synthetic runs (trace generation included, ``--jobs`` processes) of each
policy alone and of all four together. Exit status 1 when a target of the issue is missed
(whole trace >= 1 s, all four policies for 10,000 runs >= 60 s).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from bamboo.sim.core import SimConfig  # noqa: E402 (after sys.path is set)
from bamboo.sim.cost_presets import get_preset  # noqa: E402 (after sys.path is set)
from bamboo.sim.policies import make_policy  # noqa: E402 (after sys.path is set)
from bamboo.sim.runner import resolve_trace, run_policies  # noqa: E402 (after sys.path is set)
from bamboo.traces.trace import TraceError, generate_synthetic, load_trace, parse_synthetic_spec  # noqa: E402 (after sys.path is set)

TRACES = REPO / "traces"
ALL = ["bamboo", "checkpoint", "on-demand", "adaptive"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(TRACES / "aws-p3-2xlarge.csv"), help="trace file for the whole-trace timing")
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--p", type=float, default=0.10, help="hourly preemption probability of the synthetic runs")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    preset, cfg = get_preset(args.model), SimConfig()
    ok = True

    try:
        trace = load_trace(args.trace)
    except TraceError as exc:
        print(f"sim_speed: {exc} (pass --trace FILE)", file=sys.stderr)
        return 2
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for name in ALL:
            make_policy(name, preset, cfg).run(trace)
        best = min(best, time.perf_counter() - t0)
    ok &= best < 1.0
    print(f"whole trace {Path(args.trace).name} ({trace.duration / 3600:.1f} h, {len(trace.times)} rows), "
          f"{args.model}, all {len(ALL)} policies: {best * 1000:.1f} ms")

    spec = parse_synthetic_spec(f"synthetic:p={args.p}")
    sample = [generate_synthetic(spec, s) for s in range(200)]
    for name in ("bamboo", "checkpoint", "adaptive"):
        events = 0
        t0 = time.perf_counter()
        for tr in sample:
            pol = make_policy(name, preset, cfg)
            pol.run(tr)
            events += pol.events
        dt = time.perf_counter() - t0
        print(f"{name}: {events / dt:,.0f} events/s, one process ({events / len(sample):.0f} events/run: "
              f"trace rows, instance-ready and timer events)")

    source = resolve_trace(f"synthetic:p={args.p}")
    label = f"synthetic:p={args.p:g} (48 nodes, 12 h, trace generation included), jobs={args.jobs}"
    for policies in [[p] for p in ALL] + [ALL]:
        t0 = time.perf_counter()
        run_policies(source, policies, preset, cfg, runs=args.runs, seed=args.seed, jobs=args.jobs)
        dt = time.perf_counter() - t0
        if policies == ALL and args.runs >= 10_000:
            ok &= dt < 60.0
        print(f"{args.runs} runs of {','.join(policies)} on {label}: {dt:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
