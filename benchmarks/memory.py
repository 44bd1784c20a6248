"""Peak memory per node of the redundancy modes, by the engine's tensor accounting.

Runs `bamboo train` once for each of: --redundancy off, lazy, eager, eager
--frc-offload and eager --activation-checkpointing, and prints from each run's
summary.json the largest `memory_per_node_bytes` (peak device-resident bytes of a node:
parameters, gradient sums and AdamW state of every stage it holds, its replica's
parameters and, unless offloaded, optimizer state, one transient .grad, and the step's
peak of saved activations, kept stage outputs and eager FRC's saved tensors), its ratio
to off, and the largest `host_memory_per_node_bytes` (what --frc-offload put in host
memory). Tensor bytes, not process RSS.

gpt2-small (163M parameters, context 1024, a 50257-token head) takes many minutes a step
on a 2-core machine, so the default is gpt2-mini; `--model gpt2-small` runs the same
table where there is time and memory for it.

    .venv/bin/python benchmarks/memory.py
    .venv/bin/python benchmarks/memory.py --model gpt2-small --micro-batch-size 2
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
}


def run_train(args: argparse.Namespace, flags: list[str], out: Path) -> dict:
    """One `bamboo train` run; its summary.json."""
    cmd = [sys.executable, "-m", "bamboo", "train", "--model", args.model,
           "--nodes", str(args.nodes), "--stages", str(args.stages),
           "--micro-batches", str(args.micro_batches),
           "--micro-batch-size", str(args.micro_batch_size), "--steps", str(args.steps),
           *flags, "--json", "--quiet", "--no-report", "--out", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    return json.loads((out / "summary.json").read_text())


def mib(n: float) -> str:
    return f"{n / 2**20:9.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-mini")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bamboo-memory-"))
    print(f"== peak memory per node: {args.model}, nodes {args.nodes}, stages {args.stages}, "
          f"micro-batches {args.micro_batches} x {args.micro_batch_size}, {args.steps} steps ==")
    print("tensor accounting (summary.json memory_per_node_bytes / host_memory_per_node_bytes), MiB")
    print(f"{'mode':<20} {'max device':>10} {'x off':>6} {'max host':>9} {'wall s':>7}   "
          f"device per node")
    base = None
    for name, flags in MODES.items():
        start = time.perf_counter()
        summary = run_train(args, flags, root / name)
        wall = time.perf_counter() - start
        device, host = summary["memory_per_node_bytes"], summary["host_memory_per_node_bytes"]
        base = base or max(device)
        print(f"{name:<20} {mib(max(device)):>10} {max(device) / base:>5.2f}x {mib(max(host))} "
              f"{wall:>7.1f}   " + " ".join(mib(d).strip() for d in device), flush=True)
    print(f"\nrun directories: {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
