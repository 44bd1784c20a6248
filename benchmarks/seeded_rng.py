"""What seeding every layer's forward costs (`bamboo.model.run_layers`): one stage of
gpt2-mini (3 of its 12 layers, as on 4 stages), micro-batches of 8, forward and backward
with the layers' draws seeded by (seed, step, micro-batch, layer) against the plain
`nn.Sequential` call, interleaved; and the seeding alone (the fork of the generators and
one reseed per layer, on layers that do nothing), which is what a step pays per forward.

    .venv/bin/python benchmarks/seeded_rng.py --reps 200

One thread, as a worker runs. The stage's forward and backward is a micro-batch's compute
on a node; a step runs one per micro-batch (two with eager FRC, each paying the seeding
once), so seeding / (forward + backward) bounds its share of a step from above.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from bamboo.config.presets import preset
from bamboo.data.datasets import make_task
from bamboo.data.sizing import SIZING
from bamboo.model import build_layers, forward_seed, loss_fn, run_layers


def _timed(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-mini")
    parser.add_argument("--layers", type=int, default=3, help="layers of the stage timed")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    p = preset(args.model, SIZING)
    indices = range(p.layers - args.layers, p.layers)  # the last stage: loss included
    stage = nn.Sequential(*build_layers(p, indices, seed=0))
    front = nn.Sequential(*build_layers(p, range(p.layers - args.layers), seed=0))
    batch = make_task(p, seed=0, global_micro_batches=1,
                      micro_batch_size=args.micro_batch_size).batch(0, 0)
    with torch.no_grad():
        x0 = front(batch.inputs)
    loss = loss_fn(p)

    def plain() -> None:
        x = x0.detach().requires_grad_()
        loss(stage(x), batch.targets).backward()

    def seeded() -> None:
        x = x0.detach().requires_grad_()
        out = run_layers(stage, indices, x, device="cpu",
                         seed_of=lambda i: forward_seed(0, 5, 3, i))
        loss(out, batch.targets).backward()

    nothing = [nn.Identity() for _ in indices]

    def seeding_alone() -> None:
        run_layers(nothing, indices, x0, device="cpu", seed_of=lambda i: forward_seed(0, 5, 3, i))

    for fn in (plain, seeded, seeding_alone):
        fn()  # warm up
    a, b = [], []
    for _ in range(args.reps // 10):  # interleaved: the machine's drift hits both alike
        a += _timed(plain, 10)
        b += _timed(seeded, 10)
    alone = _timed(seeding_alone, args.reps * 10)
    fb, fb_seeded, cost = statistics.median(a), statistics.median(b), statistics.median(alone)
    print(f"{args.model}, a stage of {args.layers} layers, micro-batch {args.micro_batch_size}, "
          f"{args.reps} reps each")
    print(f"forward+backward plain   {fb * 1e3:8.3f} ms (median)")
    print(f"forward+backward seeded  {fb_seeded * 1e3:8.3f} ms (median, {fb_seeded / fb - 1:+.2%})")
    print(f"seeding alone per forward {cost * 1e6:7.1f} us = {cost / fb:.3%} of a micro-batch's "
          f"forward+backward")


if __name__ == "__main__":
    main()
