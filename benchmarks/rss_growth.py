"""Real memory of every worker over a run, in every redundancy mode: does anything leak?

Runs `bamboo train` once per mode (off, lazy, eager, eager --frc-offload, eager
--activation-checkpointing, eager --precision bf16, eager with a kill of stage 2 at step
10, eager with --eval-every) and prints, per run, each node's resident memory at the end
of step 10 and of the last step (from the `step_done` events, which carry every worker's
own sample of `/proc/self/statm`), and `rss_growth_per_step_bytes` from summary.json (the
least-squares slope over the second half of each node's steps). Resident bytes as the
operating system counts them, not tensor accounting.

    .venv/bin/python benchmarks/rss_growth.py                       # 200 steps, gpt2-tiny
    .venv/bin/python benchmarks/rss_growth.py --steps 60 --modes eager,off
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODES: dict[str, list[str]] = {
    "off": ["--redundancy", "off"],
    "lazy": ["--redundancy", "lazy"],
    "eager": ["--redundancy", "eager"],
    "eager+frc-offload": ["--redundancy", "eager", "--frc-offload"],
    "eager+act-ckpt": ["--redundancy", "eager", "--activation-checkpointing"],
    "eager+bf16": ["--redundancy", "eager", "--precision", "bf16"],
    "eager+kill@10": ["--redundancy", "eager", "--kill", "0:2@10"],
    "eager+eval": ["--redundancy", "eager", "--eval-every", "5", "--eval-batches", "4"],
}


def run_train(args: argparse.Namespace, flags: list[str], out: Path) -> tuple[dict, list[dict]]:
    """One `bamboo train` run: its summary.json and its step_done events."""
    cmd = [sys.executable, "-m", "bamboo", "train", "--model", args.model,
           "--nodes", str(args.nodes), "--stages", str(args.stages),
           "--micro-batches", str(args.micro_batches), "--steps", str(args.steps),
           *flags, "--json", "--quiet", "--no-report", "--out", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): "
                         f"{proc.stderr.strip()[-800:]}")
    from bamboo.run.runlog import read_events
    steps = [e for e in read_events(out / "events.jsonl") if e["event"] == "step_done"]
    return json.loads((out / "summary.json").read_text()), steps


def rss_at(steps: list[dict], step: int) -> dict[str, int]:
    """Node -> resident bytes at the end of `step` (the last record of that step)."""
    for e in reversed(steps):
        if e["step"] == step:
            return {n["node"]: n["rss_bytes"] for n in e["nodes"]}
    return {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-tiny")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bamboo-rss-"))
    print(f"== resident memory per node: {args.model}, {args.nodes} nodes x {args.stages} "
          f"stages, M={args.micro_batches}, {args.steps} steps ==")
    print(f"{'mode':<18} {'node':<5} {'MiB @10':>8} {'MiB @last':>9} {'growth KiB/step':>16}"
          f" {'peak MiB':>9} {'wall s':>7}")
    for name in args.modes.split(","):
        start = time.perf_counter()
        summary, steps = run_train(args, MODES[name], root / name)
        wall = time.perf_counter() - start
        at10, last = rss_at(steps, 10), rss_at(steps, args.steps - 1)
        for node, peak, growth in zip(summary["memory_nodes"], summary["rss_per_node_bytes"],
                                      summary["rss_growth_per_step_bytes"]):
            a = f"{at10[node] / 2**20:8.1f}" if node in at10 else f"{'-':>8}"
            b = f"{last[node] / 2**20:9.1f}" if node in last else f"{'-':>9}"
            g = f"{growth / 1024:16.1f}" if growth is not None else f"{'-':>16}"
            print(f"{name:<18} {node:<5} {a} {b} {g} {peak / 2**20:9.1f} {wall:7.1f}",
                  flush=True)
    print(f"\nrun directories: {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
