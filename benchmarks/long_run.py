"""What grows over a long run, seen from outside: the coordinator's and the workers' resident
memory and open descriptors, the store's keys and the event log.

Runs `bamboo train` for `--steps` steps (1,000 by default, gpt2-tiny, small micro-batches so
a step is quick), optionally replaying a trace so that losses are dense (abandoned gloo
groups, rebuilds, replacements), and samples every `--every` seconds from /proc: the
coordinator's (the `bamboo train` process's) VmRSS and open descriptors, and each live
worker's (pids from the `node_up` events). Prints the samples at the first step, the middle
and the end, and the summary's `coordinator` block (store keys, event log bytes per step).

    .venv/bin/python benchmarks/long_run.py                                 # quiet, 1,000 steps
    .venv/bin/python benchmarks/long_run.py --trace traces/aws-p3-2xlarge.csv --time-scale 3600
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def proc_figures(pid: int) -> tuple[int, int] | None:
    """(resident bytes, open descriptors) of `pid`, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, IndexError, ValueError):
        return None


def main() -> int:
    from bamboo.run.runlog import read_events

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--redundancy", default="eager")
    ap.add_argument("--trace", default=None)
    ap.add_argument("--time-scale", type=float, default=3600)
    ap.add_argument("--max-nodes", type=int, default=None)
    ap.add_argument("--every", type=float, default=1.0)
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bamboo-long-")) / "run"
    cmd = [sys.executable, "-m", "bamboo", "train", "--model", "gpt2-tiny",
           "--nodes", str(args.nodes), "--stages", str(args.stages),
           "--micro-batches", str(args.micro_batches),
           "--micro-batch-size", str(args.micro_batch_size), "--steps", str(args.steps),
           "--redundancy", args.redundancy, "--quiet", "--no-report", "--out", str(out)]
    if args.trace:
        cmd += ["--trace", args.trace, "--time-scale", str(args.time_scale),
                "--checkpoint-every", "20", "--max-nodes", str(args.max_nodes or 2 * args.nodes)]
    print(" ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    samples: list[dict] = []
    while proc.poll() is None:
        time.sleep(args.every)
        events = out / "events.jsonl"
        if not events.exists():
            continue
        records = read_events(events)
        steps = [e["step"] for e in records if e["event"] == "step_done"]
        workers = {e["node"]: e["pid"] for e in records if e["event"] in ("node_up", "role")}
        lost = {e["node"] for e in records if e["event"] == "node_lost"}
        coord = proc_figures(proc.pid)
        if coord is None:
            break
        live = {n: f for n, p in workers.items() if n not in lost
                and (f := proc_figures(p)) is not None}
        samples.append({"t": time.monotonic(), "step": max(steps, default=-1),
                        "coord_rss": coord[0], "coord_fds": coord[1],
                        "worker_rss": max((f[0] for f in live.values()), default=0),
                        "worker_fds": max((f[1] for f in live.values()), default=0),
                        "events_bytes": events.stat().st_size, "losses": len(lost)})
    stderr = proc.communicate()[1]
    if proc.returncode != 0:
        print(stderr[-2000:], file=sys.stderr)
        return proc.returncode
    summary = json.loads((out / "summary.json").read_text())
    running = [s for s in samples if s["step"] >= 0 and s["worker_rss"] > 0]
    print(f"{'step':>6} {'coord MiB':>10} {'coord fds':>9} {'worker MiB max':>14} "
          f"{'worker fds max':>14} {'events KiB':>10} {'losses':>6}")
    for s in (running[0], running[len(running) // 2], running[-1]) if running else ():
        print(f"{s['step']:>6} {s['coord_rss'] / 2**20:10.1f} {s['coord_fds']:9d} "
              f"{s['worker_rss'] / 2**20:14.1f} {s['worker_fds']:14d} "
              f"{s['events_bytes'] / 1024:10.1f} {s['losses']:6d}")
    print("summary coordinator:", json.dumps(summary["coordinator"]))
    print(f"steps {summary['steps_completed']}, preemptions {summary['preemptions']}, "
          f"wall {summary['wall_s']:.0f} s; worker rss growth (bytes/step): "
          f"{summary['rss_growth_per_step_bytes']}")
    print(f"run directory: {out.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
