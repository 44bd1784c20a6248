"""The general path against a preset on the same job: a preset by name (`model="gpt2-tiny"`)
and the very same layers given as a user's model through `bamboo.Job` (a build function
returning a list of layer factories, or an `nn.Sequential`, converted by
bamboo.model.forms), same seed, same job, runs alternated; the median step time of each
(summary.json's median_step_s), their ratio (and the median of each pair's ratio: a
pair runs back to back, so a slow spell of a shared machine weighs on both), and whether the two end with equal losses
and parameters.

    .venv/bin/python benchmarks/general_path.py --pairs 3 --steps 20

The layers of the user's model are the preset's (`bamboo.model.build_layer`, under the
job's seed), so both runs hold the same parameters and, when the general path computes
what the preset's does, end with the same losses and `param_sha256`.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
from pathlib import Path

from torch import nn

import bamboo
from bamboo.config.presets import preset
from bamboo.model import build_layer, build_layers

MODEL, SEED = "gpt2-tiny", 3


def factories(vocab_size: int = 256, context: int = 64) -> list:
    """The preset's layers as a list of zero-argument factories: each node builds only
    its own."""
    p = preset(MODEL)
    return [functools.partial(build_layer, p, i, SEED) for i in range(p.layers)]


def sequential(vocab_size: int = 256, context: int = 64) -> nn.Sequential:
    """The preset's layers as one nn.Sequential, sent to every layer by value."""
    p = preset(MODEL)
    return nn.Sequential(*build_layers(p, range(p.layers), SEED))


FORMS = {"factories": factories, "sequential": sequential}


def one_run(model: object, args: argparse.Namespace, out: Path) -> bamboo.RunResult:
    job = bamboo.Job(model=model, nodes=args.nodes, stages=args.stages, steps=args.steps,
                     micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size,
                     seed=SEED)
    return bamboo.train(job, out=out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--form", choices=sorted(FORMS), default="factories")
    parser.add_argument("--pairs", type=int, default=3, help="preset/general pairs, alternated")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"preset": [], "general": []}
    ends: dict[str, set] = {"preset": set(), "general": set()}
    with tempfile.TemporaryDirectory(prefix="general_path_") as tmp:
        for pair in range(args.pairs):
            order = ("preset", "general") if pair % 2 == 0 else ("general", "preset")
            for which in order:
                model = MODEL if which == "preset" else FORMS[args.form]
                result = one_run(model, args, Path(tmp) / f"{which}{pair}")
                times[which].append(float(result.median_step_s))
                ends[which].add((tuple(result.losses), result.param_sha256))
                print(f"pair {pair} {which:7s}: median step {1000 * times[which][-1]:.1f} ms",
                      flush=True)
    preset_ms = 1000 * statistics.median(times["preset"])
    general_ms = 1000 * statistics.median(times["general"])
    same = len(ends["preset"]) == 1 and ends["preset"] == ends["general"]
    print(f"{MODEL}, {args.nodes} nodes x {args.stages} stages, {args.micro_batches} micro-batches "
          f"of {args.micro_batch_size}, {args.steps} steps, {args.pairs} pairs; general form "
          f"'{args.form}'")
    ratios = [g / q for g, q in zip(times["general"], times["preset"])]
    print(f"median step: preset {preset_ms:.1f} ms, general {general_ms:.1f} ms, "
          f"ratio {general_ms / preset_ms:.3f}; median of the pairs' ratios "
          f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}..{max(ratios):.3f}); "
          f"fastest runs {1000 * min(times['preset']):.1f} / "
          f"{1000 * min(times['general']):.1f} ms")
    print(f"losses and parameters: {'equal' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
