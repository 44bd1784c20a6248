"""Throughput over a window of a real spot trace: redundant computation (failover,
drains, reconfiguration) against checkpoint-restart (every preemption restarts all
workers from the last checkpoint, as torchrun does).

All runs replay the same trace at the same time scale with the same job; only the
recovery differs:

  bamboo:             --redundancy eager (and lazy, off, reroute, and auto: chosen per
                      generation)
  checkpoint-restart: --redundancy off --recovery checkpoint-restart --checkpoint-every K

Throughput = samples of the run's steps / wall seconds (redone steps count once, so the
work a restart throws away costs time, as it does on a real cluster). Both runs also
pay for the trace's allocations in the same way: an added node is a new process that
joins at a step boundary. Left out, for both: the ~45 s an EC2 instance takes to boot
(a local process starts in about a second), which favours checkpoint-restart, whose
every restart waits for fresh processes.

    .venv/bin/python benchmarks/trace_throughput.py --steps 150 --time-scale 100 --reps 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(flags: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "bamboo", "train", *flags, "--out", str(out), "--quiet",
           "--no-report", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads(proc.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="traces/aws-p3-2xlarge.csv")
    ap.add_argument("--time-scale", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-nodes", type=int, default=None)
    ap.add_argument("--only", default=None, help="comma-separated policy names to run")
    args = ap.parse_args()
    common = ["--nodes", str(args.nodes), "--stages", "4", "--steps", str(args.steps),
              "--trace", args.trace, "--time-scale", str(args.time_scale)]
    if args.max_nodes:
        common += ["--max-nodes", str(args.max_nodes)]
    policies = {
        "bamboo (eager RC)": ["--redundancy", "eager", "--checkpoint-every",
                              str(args.checkpoint_every)],
        "bamboo (lazy RC)": ["--redundancy", "lazy", "--checkpoint-every",
                             str(args.checkpoint_every)],
        "bamboo (no RC)": ["--redundancy", "off", "--checkpoint-every",
                           str(args.checkpoint_every)],
        "bamboo (reroute)": ["--redundancy", "reroute", "--checkpoint-every",
                             str(args.checkpoint_every)],
        "bamboo (auto)": ["--redundancy", "auto", "--checkpoint-every",
                          str(args.checkpoint_every)],
        "checkpoint-restart": ["--redundancy", "off", "--recovery", "checkpoint-restart",
                               "--checkpoint-every", str(args.checkpoint_every)],
    }
    if args.only:
        policies = {k: v for k, v in policies.items() if k in args.only.split(",")
                    or k == "checkpoint-restart"}
    tmp = Path(tempfile.mkdtemp(prefix="bamboo-tput-"))
    results: dict[str, list[dict]] = {name: [] for name in policies}
    for rep in range(args.reps):  # interleaved, so both see the same machine state
        for i, (name, flags) in enumerate(policies.items()):
            results[name].append(_run(common + flags, tmp / f"{i}-{rep}"))
    print(f"trace {args.trace}, x{args.time_scale:g}, {args.nodes} nodes, {args.steps} steps, "
          f"{args.reps} runs each (median)")
    print("| recovery | samples/s | wall s | preemptions | failovers | reroutes | drains "
          "| peer restores | checkpoint restores | redone steps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    tput = {}
    for name, runs in results.items():
        tput[name] = statistics.median(r["throughput"] for r in runs)
        r = runs[0]
        print(f"| {name} | {tput[name]:.1f} | {statistics.median(x['wall_s'] for x in runs):.1f} "
              f"| {r['preemptions']} | {r['failovers']} | {r.get('reroutes', 0)} | {r['drains']} "
              f"| {r['peer_restores']} "
              f"| {r['checkpoint_restores']} | {r['redone_steps']} |")
        first = runs[0]["losses"]
        assert all(x["losses"] == first or max(abs(a - b) / abs(b) for a, b in
                   zip(x["losses"], first)) < 1e-4 for x in runs), "runs disagree"
    base = "checkpoint-restart"
    for name in tput:
        if name != base:
            print(f"throughput ratio {name} / {base}: {tput[name] / tput[base]:.2f}x")


if __name__ == "__main__":
    main()
