"""What the user's own loop costs: the same job through `bamboo.train` (the nodes run on from
step to step) and through a `bamboo.Trainer` loop of `train_step()` calls (every step waits
at its boundary for the call's order), runs alternated: each run's samples a second over
the run (summary.json's throughput) and the whole call's seconds, their ratios (and the
median of each pair's: a pair runs back to back, so a slow spell of a shared machine weighs
on both), and whether the two end with equal losses and parameters. (summary.json's
median_step_s is not comparable between the two: the loop's step clock starts at the call,
bamboo.train's at the previous commit.)

    .venv/bin/python benchmarks/trainer_overhead.py --pairs 3 --steps 40
    .venv/bin/python benchmarks/trainer_overhead.py --pairs 3 --steps 40 --nodes 2 --pin

Say which case a figure is: with more workers than cores there are no idle bubbles, and the
boundary's wait is another worker's running time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import bamboo


def job(args: argparse.Namespace) -> bamboo.Job:
    return bamboo.Job(model=args.model, nodes=args.nodes, stages=args.stages, steps=args.steps,
                      micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size,
                      seed=3, checkpoint_every=0, pin_cpus="auto" if args.pin else "off")


def by_train(args: argparse.Namespace, out: Path) -> tuple[bamboo.RunResult, float]:
    start = time.perf_counter()
    result = bamboo.train(job(args), out=out)
    return result, time.perf_counter() - start


def by_loop(args: argparse.Namespace, out: Path) -> tuple[bamboo.RunResult, float]:
    start = time.perf_counter()
    with bamboo.Trainer(job(args), out=out) as trainer:
        while trainer.steps_done < args.steps:
            trainer.train_step()
    assert trainer.result is not None
    return trainer.result, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--pin", action="store_true",
                        help="a core per worker (--nodes at most this machine's cores)")
    args = parser.parse_args()
    rows: list[dict[str, float]] = []
    equal = True
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            trained, train_s = by_train(args, Path(tmp) / f"train{i}")
            looped, loop_s = by_loop(args, Path(tmp) / f"loop{i}")
            equal &= trained.losses == looped.losses and \
                trained.param_sha256 == looped.param_sha256
            rows.append({"train_step_s": trained.median_step_s, "loop_step_s": looped.median_step_s,
                         "train_sps": trained.throughput, "loop_sps": looped.throughput,
                         "train_s": train_s, "loop_s": loop_s})
            print(f"pair {i}: {trained.throughput:.1f} / {looped.throughput:.1f} samples/s; "
                  f"whole call {train_s:.2f} / {loop_s:.2f} s", file=sys.stderr)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    pair_ratio = statistics.median(r["loop_sps"] / r["train_sps"] for r in rows)
    added = statistics.median((r["loop_s"] - r["train_s"]) / args.steps for r in rows)
    print(f"samples/s over the run: bamboo.train {med['train_sps']:.1f}, Trainer loop "
          f"{med['loop_sps']:.1f}: {med['loop_sps'] / med['train_sps']:.3f}x (pairs' median "
          f"{pair_ratio:.3f}x)")
    print(f"whole call: bamboo.train {med['train_s']:.2f} s, Trainer loop {med['loop_s']:.2f} s "
          f"(pairs' median {1e3 * added:+.2f} ms a step)")
    print(f"equal losses and parameters: {'yes' if equal else 'NO'}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
