"""Reconfiguration time against the step time: 4 -> 8 nodes (joins) and 8 -> 6 (drains).

Each scenario is a real `bamboo train` run whose trace changes the membership once:

- 4 -> 8: 4 nodes train one 4-stage pipeline; the trace adds 4 nodes, which start,
  wait as standbys, and join at the next step boundary as a second pipeline;
- 8 -> 6: 8 nodes train two 4-stage pipelines; the trace removes 2 nodes with a 30 s
  notice, so they drain: their state moves at the next step boundary and they leave.
  Six nodes hold one 4-stage pipeline plus two standbys (the planner keeps 4 stages).

Phases, from events.jsonl:
  decision  the step boundary that ends the generation -> the next plan is published
            (every member's `gen_end`, then planning);
  setup     plan published -> every member trains again (a new process group, the
            layer state moved from live holders, stages rebuilt);
  total     decision + setup, against the median step time of the run.

    .venv/bin/python benchmarks/reconfig_time.py --reps 3
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


def _trace(path: Path, rows: list[tuple[int, str, str]]) -> Path:
    path.write_text("".join(f"{ms},{kind},{node}\n" for ms, kind, node in rows))
    return path


def _run(args: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "bamboo", "train", *args, "--out", str(out), "--quiet",
           "--no-report"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {proc.stderr.strip().splitlines()[-1]}")
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    start = next(e for e in events if e["event"] == "reconfiguration_start")
    plan = next(e for e in events if e["event"] == "reconfigured")
    ready = next(e for e in events if e["event"] == "generation_ready" and e["gen"] == plan["gen"])
    return {"decision_s": plan["t"] - start["t"], "setup_s": ready["t"] - plan["t"],
            "total_s": ready["t"] - start["t"], "step_s": summary["median_step_s"],
            "bytes": plan["bytes"], "layout": f"{plan['pipelines']}x{plan['stages']}",
            "drains": summary["drains"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bamboo-reconf-"))
    names = [f"i{k}" for k in range(8)]
    grow = _trace(tmp / "grow.csv", [(0, "add", n) for n in names[:4]] +
                  [(1000, "add", n) for n in names[4:]])
    shrink = _trace(tmp / "shrink.csv", [(0, "add", n) for n in names] +
                    [(3000, "remove", names[5]), (3000, "remove", names[6])])
    scenarios = {
        "4 -> 8 (4 joins)": ["--nodes", "4", "--stages", "4", "--max-nodes", "8",
                              "--trace", str(grow), "--time-scale", "1"],
        "8 -> 6 (2 drains)": ["--nodes", "8", "--stages", "4", "--micro-batches", "2",
                               "--trace", str(shrink), "--time-scale", "1", "--notice-s", "30"],
    }
    print("| change | new layout | decision s | setup s | total s | step s | total / step "
          "| state moved |")
    print("|---|---|---|---|---|---|---|---|")
    for name, flags in scenarios.items():
        runs = [_run([*flags, "--steps", str(args.steps)], tmp / f"{name[:1]}-{r}")
                for r in range(args.reps)]
        med = {k: statistics.median(r[k] for r in runs)
               for k in ("decision_s", "setup_s", "total_s", "step_s")}
        print(f"| {name} | {runs[0]['layout']} | {med['decision_s']:.3f} | {med['setup_s']:.3f} "
              f"| {med['total_s']:.3f} | {med['step_s']:.3f} | {med['total_s'] / med['step_s']:.2f} "
              f"| {runs[0]['bytes'] / 1e6:.2f} MB |")


if __name__ == "__main__":
    main()
