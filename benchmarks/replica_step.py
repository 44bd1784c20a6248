"""Lazy redundancy's failure-free cost against `--redundancy off`, with the replica's optimizer
step on a thread of its own (the default: at the lowest priority where a worker has a
processor of its own), on that thread at the normal priority (`BAMBOO_REPLICA_STEP=thread`)
and inside the step (`BAMBOO_REPLICA_STEP=inline`), side by side in one invocation.

Runs `bamboo train` for each mode, interleaved over `--reps` repetitions (the order rotates,
so machine noise hits every mode alike); per run the median step wall time after `--warmup`
steps, and per node the median optimizer and commit-round seconds (`optim_s`, `reduce_s`:
where the replica's step and its gradient's traffic show); the votes' own cost, a step's least
`vote_s` over its nodes (the node that reached both votes last waited for no peer, only for
the coordinator's answers); the replica's bytes a node sends a step. Every run of one
invocation must
end with the same `param_sha256` (the replica's step changes nothing the run computes).

    .venv/bin/python benchmarks/replica_step.py --nodes 2 --stages 2 --micro-batches 2 \\
        --pin-cpus auto --steps 40 --reps 3          # a processor per worker
    .venv/bin/python benchmarks/replica_step.py --nodes 4 --stages 2 --micro-batches 4 \\
        --steps 40 --reps 3                          # 4 workers on this machine's cores
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

MODES = {"off": ({}, ["--redundancy", "off"]),
         "lazy": ({}, ["--redundancy", "lazy"]),
         "lazy-thread": ({"BAMBOO_REPLICA_STEP": "thread"}, ["--redundancy", "lazy"]),
         "lazy-inline": ({"BAMBOO_REPLICA_STEP": "inline"}, ["--redundancy", "lazy"])}


def run(args: argparse.Namespace, mode: str, out: Path) -> tuple[dict, list[dict]]:
    env_extra, flags = MODES[mode]
    cmd = [sys.executable, "-m", "bamboo", "train", "--model", args.model,
           "--nodes", str(args.nodes), "--stages", str(args.stages),
           "--micro-batches", str(args.micro_batches),
           "--micro-batch-size", str(args.micro_batch_size), "--steps", str(args.steps),
           "--checkpoint-every", "0", "--pin-cpus", args.pin_cpus, *flags,
           "--json", "--quiet", "--no-report", "--out", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **env_extra}, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: {' '.join(cmd)} failed ({proc.returncode}): "
                         f"{proc.stderr.strip()[-800:]}")
    summary = json.loads((out / "summary.json").read_text())
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return summary, [e for e in events if e["event"] == "step_done" and e["step"] >= args.warmup]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-mini")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pin-cpus", default="off", choices=("off", "auto"))
    ap.add_argument("--out", help="keep the run directories here (default: a temporary one)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"which of {', '.join(MODES)} to run (comma-separated; off first)")
    args = ap.parse_args()
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="replica-step-"))
    root.mkdir(parents=True, exist_ok=True)
    names = [m for m in args.modes.split(",") if m]
    if names[:1] != ["off"] or any(m not in MODES for m in names):
        raise SystemExit(f"--modes {args.modes}: give 'off' first, then some of "
                         f"{', '.join(MODES)}")
    medians: dict[str, list[float]] = {m: [] for m in names}
    parts: dict[str, list[tuple[float, float, float, float]]] = {m: [] for m in names}
    digests: dict[str, set[str]] = {}
    host: dict[str, int] = {}
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; "
          f"{args.model}, {args.nodes} workers, P={args.stages}, M={args.micro_batches} of "
          f"{args.micro_batch_size}, pin {args.pin_cpus}, {args.steps} steps x {args.reps} reps, "
          f"first {args.warmup} steps left out", flush=True)
    for rep in range(args.reps):
        for mode in names[rep % len(names):] + names[:rep % len(names)]:
            summary, steps = run(args, mode, root / f"{mode}-{rep}")
            walls = [e["wall_s"] for e in steps]
            medians[mode].append(statistics.median(walls))
            nodes = [n for e in steps for n in e["nodes"]]
            parts[mode].append((statistics.median(n["optim_s"] for n in nodes),
                                statistics.median(n["reduce_s"] for n in nodes),
                                statistics.median(min(n["vote_s"] for n in e["nodes"])
                                                  for e in steps),
                                statistics.median(n["bytes_replica"] for n in nodes)))
            digests.setdefault(summary["param_sha256"], set()).add(mode)
            host[mode] = summary.get("replica_host_bytes", 0)
            print(f"  rep {rep} {mode:<12} median step {1e3 * medians[mode][-1]:7.1f} ms  "
                  f"optim {1e3 * parts[mode][-1][0]:6.1f} ms  commit round "
                  f"{1e3 * parts[mode][-1][1]:6.1f} ms  votes' own {1e3 * parts[mode][-1][2]:5.1f} "
                  f"ms  replica sent {parts[mode][-1][3] / 1e6:5.2f} MB", flush=True)
    print("\nmode          median step ms (per rep)          vs off (paired by rep, median)  "
          "replica in host memory")
    for mode in names:
        ratios = [off / m for m, off in zip(medians[mode], medians["off"])]
        print(f"{mode:<12}  {' '.join(f'{1e3 * x:7.1f}' for x in medians[mode]):<32}  "
              f"{' '.join(f'{r:.3f}' for r in ratios)} ({statistics.median(ratios):.3f}x)  "
              f"{host[mode] / 2**20:.1f} MiB")
    same = len(digests) == 1
    print(f"every run ended with the same param_sha256: {'yes' if same else 'NO: ' + str(digests)}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
