"""Re-routing against shadowing and against no redundancy: step time and memory per node.

One job (gpt2-mini, 2 pipelines x 2 stages on 4 workers, 4 micro-batches per pipeline),
run failure-free in each of off, reroute, lazy and eager, and with one kill of stage 1 of
pipeline 0 in step 3 under reroute and under lazy. Reported, medians over the runs:

- failure-free: the median step (steps 2..), and the tensor-accounted memory per node
  (`memory_per_node_bytes`, the largest node);
- after the kill: the median step of steps 5.. (the layout re-routed, or shadowed), and
  the step of the loss itself.

With 4 workers on a 2-core machine there are no idle bubbles (another worker runs in
them), so these are figures of total work, not of bubble-filling.

    .venv/bin/python benchmarks/reroute_step.py --steps 12 --runs 2
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


def _run(flags: list[str], out: Path) -> tuple[dict, list[float]]:
    cmd = [sys.executable, "-m", "bamboo", "train", "--model", "gpt2-mini", "--nodes", "4",
           "--stages", "2", "--micro-batches", "4", *flags, "--out", str(out), "--quiet",
           "--no-report", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {proc.stderr.strip().splitlines()[-1]}")
    walls = {}
    for line in (out / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "step_done":
            walls[e["step"]] = e["wall_s"]
    return json.loads(proc.stdout), [walls[k] for k in sorted(walls)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    steps = ["--steps", str(args.steps)]
    cases = {f"{m}, failure-free": ["--redundancy", m] for m in ("off", "reroute", "lazy", "eager")}
    cases |= {f"{m}, stage 1 of pipeline 0 killed in step 3": ["--redundancy", m, "--kill", "0:1@3"]
              for m in ("reroute", "lazy")}
    tmp = Path(tempfile.mkdtemp(prefix="bamboo-reroute-"))
    got: dict[str, list[tuple[dict, list[float]]]] = {c: [] for c in cases}
    for run in range(args.runs):  # interleaved
        for i, (name, flags) in enumerate(cases.items()):
            got[name].append(_run(steps + flags, tmp / f"{i}-{run}"))
    off = statistics.median(statistics.median(w[2:]) for _, w in got["off, failure-free"])
    print(f"gpt2-mini, 2 x 2 on 4 workers, M=4, {args.steps} steps, {args.runs} runs "
          f"(medians)")
    print("| case | median step, ms | vs off | step of the loss, ms | memory, largest node, MiB "
          "| reroutes | failovers |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in got.items():
        killed = "killed" in name
        step = statistics.median(statistics.median(w[5:] if killed else w[2:]) for _, w in runs)
        loss = statistics.median(w[3] for _, w in runs) if killed else None
        mem = statistics.median(max(s["memory_per_node_bytes"]) for s, _ in runs) / 2**20
        s = runs[0][0]
        print(f"| {name} | {1000 * step:.0f} | {step / off:.3f}x | "
              f"{'' if loss is None else f'{1000 * loss:.0f}'} | {mem:.1f} | "
              f"{s.get('reroutes', 0)} | {s['failovers']} |")


if __name__ == "__main__":
    main()
