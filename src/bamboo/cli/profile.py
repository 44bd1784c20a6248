"""`bamboo profile`: measure a model's step costs here for `bamboo simulate --costs`
(`bamboo.sim.profile` measures; this module reads the flags and writes the file).

    bamboo profile --model gpt2-tiny --stages 4 --out costs.json
    bamboo profile --model gpt2-tiny --layers-only --out layers.json   # for train --layer-costs
    bamboo profile --model cnn.py:build --dataset cnn.py:Images(n=64) --stages 2 --out costs.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bamboo.cli.parsing import EXIT_USAGE, UsageParser

__all__ = ["main", "profile_parser"]


def profile_parser() -> argparse.ArgumentParser:
    """The flags of `bamboo profile`."""
    parser = UsageParser(prog="bamboo profile", description="Measure a model's step costs on "
                         "this machine for `bamboo simulate --costs`.")
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (G)")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="steps of each engine run")
    parser.add_argument("--out", default="costs.json")
    parser.add_argument("--data", help="with --layers-only: a prepared token directory whose "
                        "vocabulary the model takes (as bamboo train --data)")
    parser.add_argument("--dataset", metavar="MODULE:CALL", help="a map-style Dataset of "
                        "(inputs, labels) samples, as bamboo train --dataset: what a model "
                        "that takes other inputs than token ids is timed on")
    parser.add_argument("--loss", metavar="MODULE:CALL", help="the loss of the model's "
                        "output and the labels, as bamboo train --loss")
    parser.add_argument("--layers-only", action="store_true",
                        help="only time each layer alone and write a layer-costs file for "
                        "`bamboo train --layer-costs` (no engine runs)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`bamboo profile`: 0 when the costs file is written, 2 (one line on stderr) for bad flags."""
    args = profile_parser().parse_args(argv)
    from bamboo.config import ConfigError, JobConfig
    from bamboo.data.sizing import SIZING
    try:
        stages = 1 if args.layers_only else args.stages  # each layer alone: no stages
        job = JobConfig.of(model=args.model, nodes=stages, stages=stages,
                           micro_batches=args.micro_batches,
                           micro_batch_size=args.micro_batch_size,
                           steps=args.steps, data=args.data, dataset=args.dataset,
                           loss=args.loss).validate(SIZING)
        if args.data is not None and not args.layers_only:
            raise ConfigError("--data goes with --layers-only (the step costs use synthetic data)")
        if args.repeats < 1 or args.steps < 4:
            raise ConfigError("--repeats must be >= 1 and --steps >= 4")
        if Path(args.out).exists():
            raise ConfigError(f"--out {args.out} exists: choose another file or remove it")
    except ConfigError as e:
        print(f"bamboo profile: error: {e}", file=sys.stderr)
        return EXIT_USAGE

    from bamboo.sim.profile import profile_costs, profile_layers
    if args.layers_only:
        profile_layers(args.model, job.model_preset(SIZING).vocab, args.micro_batch_size,
                       args.repeats, args.data, args.out, args.dataset, args.loss)
        return 0
    from bamboo.sim.costs import save_costs
    costs = profile_costs(args.model, args.stages, args.micro_batches, args.micro_batch_size,
                          args.repeats, args.steps, args.dataset, args.loss)
    save_costs(costs, args.out)
    print(f"forward ms per stage {[round(1000 * f, 2) for f in costs.forward_s]}, backward ms "
          f"{[round(1000 * b, 2) for b in costs.backward_s]}; eager RC overhead "
          f"{100 * costs.rc_overhead:.1f}% (timeline model, one processor per node); failover "
          f"pause {costs.failover_pause_s:.3f} s; peer restore {costs.reconfiguration_s:.3f} s; "
          f"wrote {args.out}", file=sys.stderr)
    return 0
