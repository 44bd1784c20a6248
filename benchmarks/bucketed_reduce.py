"""The data-parallel sum in buckets begun during the backward (`--bucket-mb`) against one
sum per stage at the commit round (`--bucket-mb 0`), on the same job, runs alternated: the
median step time of each (summary.json's median_step_s), the median seconds a node spent
in the commit round (its events' reduce_s, steps after the first), the buckets launched
before the round, and whether the runs end with equal losses and parameters.

    .venv/bin/python benchmarks/bucketed_reduce.py --reps 3 --steps 20

The default job is data parallel only (`--stages 1`, two nodes, `--redundancy off`), each
worker pinned to a core of its own (`--pin-cpus auto`): on a 2-core machine that is the
one layout where a worker's overlap is not another worker's lost time. gloo runs its
collectives on threads of its own, which share the worker's core.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import bamboo


def one_run(bucket_mb: float, args: argparse.Namespace, out: Path) -> tuple[float, float, int, tuple]:
    """(median step s, median commit-round s, buckets launched early, the run's end)."""
    job = bamboo.Job(model=args.model, nodes=args.nodes, stages=args.stages, steps=args.steps,
                     micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size,
                     redundancy=args.redundancy, pin_cpus="auto", bucket_mb=bucket_mb, seed=1)
    result = bamboo.train(job, out=out)
    rounds, early = [], 0
    for line in (out / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "step_done" and event["step"] > 0:
            rounds += [n["reduce_s"] for n in event["nodes"]]
            early += sum(n["buckets_early"] for n in event["nodes"])
    return (float(result.median_step_s), statistics.median(rounds), early,
            (tuple(result.losses), result.param_sha256))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="runs of each, alternated")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="gpt2-mini")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--redundancy", default="off")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="the bucketed runs' size")
    args = parser.parse_args()
    sizes = {"round": 0.0, "buckets": args.bucket_mb}
    steps: dict[str, list[float]] = {k: [] for k in sizes}
    rounds: dict[str, list[float]] = {k: [] for k in sizes}
    early: dict[str, list[int]] = {k: [] for k in sizes}
    ends: set = set()
    with tempfile.TemporaryDirectory(prefix="bucketed_reduce_") as tmp:
        for rep in range(args.reps):
            for which in (("round", "buckets") if rep % 2 == 0 else ("buckets", "round")):
                step_s, round_s, n, end = one_run(sizes[which], args, Path(tmp) / f"{which}{rep}")
                steps[which].append(step_s)
                rounds[which].append(round_s)
                early[which].append(n)
                ends.add(end)
                print(f"rep {rep} {which:7s}: median step {1000 * step_s:.1f} ms, commit round "
                      f"{1000 * round_s:.1f} ms, {n} buckets early", flush=True)
    print(f"{args.model}, {args.nodes} nodes x {args.stages} stages, {args.micro_batches} "
          f"micro-batches of {args.micro_batch_size}, {args.steps} steps, --redundancy "
          f"{args.redundancy}, pinned, {args.reps} runs each; buckets of {args.bucket_mb:g} MB")
    a, b = (1000 * statistics.median(steps[k]) for k in ("round", "buckets"))
    ra, rb = (1000 * statistics.median(rounds[k]) for k in ("round", "buckets"))
    print(f"median step: at the round {a:.1f} ms, buckets {b:.1f} ms, ratio {b / a:.3f}")
    print(f"median commit round per node: at the round {ra:.1f} ms, buckets {rb:.1f} ms")
    print(f"buckets launched before the round per run: {early['round']} / {early['buckets']}")
    print(f"losses and parameters: {'equal' if len(ends) == 1 else 'DIFFERENT'}")
    return 0 if len(ends) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
