"""The failover pause under `--comm strict` (NCCL's rules: no tags, the group dropped and
formed again among the survivors, the step's transfers settled on it) against
`--comm tagged` (the gloo group outlives the lost peer), side by side in one run.

For each repetition and each mode, in alternation (so both see the same machine state):
`bamboo train --kill 0:S@K` on gpt2-tiny, one pipeline of 4 stages. Figures per mode:

- pause: wall time of step K (from events.jsonl `step_done`) minus the median of steps
  1 .. K-1 of the same run;
- the engine's `pause_s` (summary.json), the coordinator's own estimate;
- the median failure-free step (steps 1 .. K-1), to show what strict costs when nothing fails;
- strict: the seconds the slowest node spent forming the survivors' groups and settling the
  step's transfers (`rebuild_s` of step K's `step_done`).

    .venv/bin/python benchmarks/comm_pause.py --reps 3 --steps 10 --kill-step 6
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(args: argparse.Namespace, comm: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "bamboo", "train", "--model", args.model, "--nodes", "4",
           "--stages", "4", "--micro-batches", str(args.micro_batches), "--steps",
           str(args.steps), "--kill", f"0:{args.stage}@{args.kill_step}", "--comm", comm,
           "--json", "--quiet", "--no-report", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    summary = json.loads(proc.stdout)
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if x.strip()]
    walls = {e["step"]: e["wall_s"] for e in events if e["event"] == "step_done"}
    clean = statistics.median(walls[k] for k in range(1, args.kill_step))
    rebuild = max(n.get("rebuild_s", 0.0) for e in events if e["event"] == "step_done"
                  and e["step"] == args.kill_step for n in e["nodes"])
    return {"pause": walls[args.kill_step] - clean, "pause_s": sum(summary["pause_s"]),
            "clean": clean, "rebuild": rebuild, "failovers": summary["failovers"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--kill-step", type=int, default=6)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    results: dict[str, list[dict]] = {"tagged": [], "strict": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for comm in results:
                r = run(args, comm, Path(tmp) / f"{comm}-{rep}")
                assert r["failovers"] == 1, r
                results[comm].append(r)
                print(f"rep {rep} {comm:6s}: step {args.kill_step} pause {r['pause']:+.3f} s, "
                      f"engine pause_s {r['pause_s']:.3f} s, clean step {r['clean']:.3f} s, "
                      f"rebuild {r['rebuild']:.3f} s",
                      flush=True)
    print(f"\n{args.model}, 1 pipeline x 4 stages, {args.micro_batches} micro-batches, "
          f"SIGKILL of stage {args.stage} in step {args.kill_step}; medians of {args.reps}")
    print("| comm | pause (step K - median clean step) | engine pause_s | clean step | "
          "groups formed and transfers settled (slowest node) |")
    print("| --- | --- | --- | --- | --- |")
    for comm, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("pause", "pause_s", "clean", "rebuild")}
        print(f"| {comm} | {med['pause']:+.3f} s | {med['pause_s']:.3f} s | {med['clean']:.3f} s "
              f"| {med['rebuild']:.3f} s |")


if __name__ == "__main__":
    main()
