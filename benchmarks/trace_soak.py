"""Trace soak: 8 local nodes replay the whole AWS p3 trace, several times, and every run
must end equal to the failure-free run (the plain single-process loop), with no hang.

Each run replays the trace from its start at its own time scale (so preemptions land
at different points of different steps) for as many steps as the trace lasts. The
table lists, per run, how every lost node was handled; the runs together must see at
least `--min-preemptions`.

    .venv/bin/python benchmarks/trace_soak.py --scales 360,300,240 --min-preemptions 100

Dense replays (a fixed number of steps, a trace hour every few wall seconds or faster),
each scale repeated; a run that stops is counted (with its one-line reason), not fatal:

    .venv/bin/python benchmarks/trace_soak.py --scales 600,1800,3600 --repeat 10 --steps 40 \
        --checkpoint-every 5 --max-nodes 8 --min-preemptions 0
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

KINDS = ("failovers", "drains", "peer_restores", "checkpoint_restores", "standby_losses",
         "stopped", "reroutes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="traces/aws-p3-2xlarge.csv")
    ap.add_argument("--scales", default="360,300,240")
    ap.add_argument("--step-s", type=float, default=0.65,
                    help="expected wall seconds per step, to size each run to the trace")
    ap.add_argument("--min-preemptions", type=int, default=100)
    ap.add_argument("--notice-s", type=float, default=None)
    ap.add_argument("--steps", type=int, default=None,
                    help="steps of every run (default: as many as the trace lasts)")
    ap.add_argument("--checkpoint-every", type=int, default=20)
    ap.add_argument("--max-nodes", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=1, help="runs of every scale")
    args = ap.parse_args()
    from reference import train_reference

    from bamboo.config import JobConfig
    from bamboo.traces.trace import load_trace
    duration = load_trace(REPO / args.trace).duration
    tmp = Path(tempfile.mkdtemp(prefix="bamboo-soak-"))
    total, rows, references = 0, [], {}
    runs = [(float(x), i) for x in args.scales.split(",") for i in range(args.repeat)]
    stops: list[tuple[float, int, str]] = []
    for scale, i in runs:
        steps = args.steps or int(duration / scale / args.step_s) + 10
        out = tmp / f"x{scale:g}-{i}"
        cmd = [sys.executable, "-m", "bamboo", "train", "--nodes", "8", "--stages", "4",
               "--steps", str(steps), "--trace", args.trace, "--time-scale", str(scale),
               "--checkpoint-every", str(args.checkpoint_every), "--out", str(out), "--json",
               "--quiet", "--no-report"]
        if args.max_nodes:
            cmd += ["--max-nodes", str(args.max_nodes)]
        if args.notice_s:
            cmd += ["--notice-s", str(args.notice_s)]
        start = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                              timeout=steps * args.step_s * 4 + 300)
        wall = time.monotonic() - start
        try:
            s = json.loads(proc.stdout)
        except ValueError:
            raise SystemExit(f"x{scale:g}: no summary: {proc.stderr.strip()[-500:]}") from None
        if s["status"] != "completed":
            stops.append((scale, i, str(s.get("error"))))
            print(f"x{scale:g} run {i}: stopped at step {s['steps_completed']}: {s.get('error')}",
                  file=sys.stderr, flush=True)
            rows.append((scale, steps, wall, s, float("nan"), False))
            total += s["preemptions"]
            continue
        if steps not in references:
            cfg = JobConfig.of(nodes=1, stages=1, steps=steps, micro_batches=8).validate()
            losses, params = train_reference(cfg)
            # summed as summary.json sums it (math.fsum in layer order), so equal is 0.0
            l2 = math.sqrt(math.fsum(float(t.double().square().sum()) for t in params.values()))
            references[steps] = (losses, l2)
        losses, l2 = references[steps]
        worst = max(abs(a - b) / abs(b) for a, b in zip(s["losses"], losses))
        worst = max(worst, abs(s["param_l2"] - l2) / l2)
        counted = sum(s[k] for k in KINDS)
        ok = worst <= 1e-4 and counted == s["preemptions"] and len(s["losses"]) == steps
        total += s["preemptions"]
        rows.append((scale, steps, wall, s, worst, ok))
        print(f"x{scale:g} run {i}: {steps} steps, {s['preemptions']} preemptions, worst rel diff "
              f"{worst:.1e}, {'equal' if ok else 'NOT EQUAL'}", file=sys.stderr, flush=True)
    if args.repeat == 1:
        print("| time scale | steps | wall s | preemptions | failovers | drains | peer restores "
              "| checkpoint restores | standby losses | stopped | reconfigurations | redone steps "
              "| worst rel. diff vs failure-free |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for scale, steps, wall, s, worst, ok in rows:
            print(f"| {scale:g} | {steps} | {wall:.0f} | {s['preemptions']} | {s['failovers']} "
                  f"| {s['drains']} | {s['peer_restores']} | {s['checkpoint_restores']} "
                  f"| {s['standby_losses']} | {s['stopped']} | {s['reconfigurations']} "
                  f"| {s['redone_steps']} | {worst:.1e}{'' if ok else ' FAILED'} |")
    else:
        _per_scale(rows)
    for scale, i, why in stops:
        print(f"x{scale:g} run {i} stopped: {why}")
    print(f"\n{total} preemptions in {len(rows)} runs; all equal to failure-free: "
          f"{all(r[-1] for r in rows)}")
    if total < args.min_preemptions or not all(r[-1] for r in rows):
        sys.exit(1)


def _per_scale(rows: list) -> None:
    """One row per time scale: how many runs reached --steps, equal and fully accounted."""
    print("| time scale | runs | reached --steps | equal, every loss accounted | preemptions "
          "(min-median-max) | handled as | wall s (median) | worst rel. diff |")
    print("|---|---|---|---|---|---|---|---|")
    for scale in dict.fromkeys(r[0] for r in rows):
        mine = [r for r in rows if r[0] == scale]
        done = [r for r in mine if r[3]["status"] == "completed"]
        pre = sorted(r[3]["preemptions"] for r in mine)
        kinds = {k: sum(r[3][k] for r in mine) for k in KINDS}
        handled = ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in kinds.items() if n)
        walls = sorted(r[2] for r in mine)
        worst = max((r[4] for r in done), default=float("nan"))
        print(f"| {scale:g} | {len(mine)} | {len(done)} | {sum(r[5] for r in mine)} "
              f"| {pre[0]}-{pre[len(pre) // 2]}-{pre[-1]} | {handled or '-'} "
              f"| {walls[len(walls) // 2]:.0f} | {worst:.1e} |")


if __name__ == "__main__":
    main()
