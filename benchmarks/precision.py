"""--precision bf16 against fp32: median step time on this machine's CPUs, side by side.

In one invocation, runs `bamboo train` with --precision fp32 and bf16, interleaved over
`--reps` repetitions (the order alternates) so machine noise hits both alike, and takes
the median step wall time after `--warmup` steps from each run's events.jsonl; also
prints the final losses (bf16 trains the same model to nearly the same loss) and the
peak device bytes by tensor accounting (bf16 saves half-size activations).

bf16 autocast on a CPU pays off only with bf16 matrix units (AVX512-BF16 / AMX); the
CPU flags are printed with the figures.

    .venv/bin/python benchmarks/precision.py
    .venv/bin/python benchmarks/precision.py --model gpt2-tiny --nodes 1 --stages 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "bf16")


def run_train(args: argparse.Namespace, precision: str, out: Path) -> tuple[dict, list[dict]]:
    """One `bamboo train` run: its summary.json and events."""
    cmd = [sys.executable, "-m", "bamboo", "train", "--model", args.model,
           "--nodes", str(args.nodes), "--stages", str(args.stages),
           "--micro-batches", str(args.micro_batches),
           "--micro-batch-size", str(args.micro_batch_size), "--steps", str(args.steps),
           "--precision", precision, "--json", "--quiet", "--no-report", "--out", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), events


def step_walls(events: list[dict], warmup: int) -> list[float]:
    return [e["wall_s"] for e in events if e["event"] == "step_done" and e["step"] >= warmup]


def cpu_flags() -> str:
    """The bf16-relevant CPU flags (Linux), or '?'."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "?"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    found = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return " ".join(found) or "none of avx2/avx512f/avx512_bf16/amx"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-mini")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bamboo-precision-"))
    walls: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    last: dict[str, dict] = {}
    for rep in range(args.reps):
        order = PRECISIONS if rep % 2 == 0 else PRECISIONS[::-1]
        for precision in order:
            summary, events = run_train(args, precision, root / f"{precision}-{rep}")
            walls[precision] += step_walls(events, args.warmup)
            last[precision] = summary
    print(f"== --precision fp32 vs bf16: {args.model}, nodes {args.nodes}, stages {args.stages}, "
          f"micro-batches {args.micro_batches} x {args.micro_batch_size}, {args.steps} steps "
          f"(median after {args.warmup}), {args.reps} reps interleaved ==")
    print(f"cpu: {os.cpu_count()} cores, flags {cpu_flags()}")
    print(f"{'precision':<10} {'median step s':>14} {'steps':>6} {'final loss':>11} "
          f"{'max device MiB':>15}")
    for p in PRECISIONS:
        s = last[p]
        print(f"{p:<10} {statistics.median(walls[p]):>14.4f} {len(walls[p]):>6} "
              f"{s['losses'][-1]:>11.5f} {max(s['memory_per_node_bytes']) / 2**20:>15.1f}")
    ratio = statistics.median(walls["bf16"]) / statistics.median(walls["fp32"])
    print(f"bf16 / fp32 median step time: {ratio:.2f}x")
    print(f"\nrun directories: {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
