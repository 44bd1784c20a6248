"""SGD with momentum and torch's OneCycleLR, through `bamboo.train`, a node killed in flight.

    python examples/sgd_onecycle.py --steps 6 --out runs/onecycle [--compare]

The optimizer and the schedule are the ones a torch loop would make,

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=steps)

given to the job as `functools.partial`s: every process builds them again, and the rate
and momentum of every step (OneCycleLR cycles SGD's momentum between 0.95 and 0.85) are
taken from the scheduler once, so a shadow that takes over a stage steps exactly as the
node it replaces would have. `--compare` runs the same job without the kill too and checks
with `bamboo.same` that both end with the same losses and parameters, bit for bit (exit 1
if not).
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
from torch import nn

import bamboo
from bamboo.model.api import PipelineModel, TensorSpec

CONTEXT, D = 16, 32


class Embed(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, D), nn.Embedding(CONTEXT, D)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


def build(vocab_size: int = 256) -> PipelineModel:
    """Four layers: embedding, two blocks, and the head."""
    return PipelineModel(
        layers=[lambda: Embed(vocab_size), Block, Block,
                lambda: nn.Sequential(nn.LayerNorm(D), nn.Linear(D, vocab_size))],
        boundary=TensorSpec((CONTEXT, D)), context=CONTEXT, vocab_size=vocab_size)


def job(steps: int, kill: list[str]) -> bamboo.Job:
    """Two pipelines of two stages; SGD with momentum under a one-cycle schedule."""
    return bamboo.Job(
        model=build, nodes=4, stages=2, micro_batches=2, micro_batch_size=4, steps=steps,
        seed=3, kill=kill,
        optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
        schedule=functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=0.1,
                                   total_steps=steps))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None, help="run directory (default: runs/...)")
    parser.add_argument("--kill", default="0:1@2", help="PIPELINE:STAGE@STEP ('' for none)")
    parser.add_argument("--compare", action="store_true",
                        help="also run without the kill and check both end equal")
    args = parser.parse_args(argv)
    kill = [args.kill] if args.kill else []
    try:
        killed = bamboo.train(job(args.steps, kill),
                              out=args.out / "killed" if args.out else None)
        print(f"losses {[round(x, 4) for x in killed.losses]}; {killed.preemptions} "
              f"preemption(s), {killed.failovers} failover(s); parameters "
              f"{killed.param_sha256[:12]} in {killed.run_dir}")
        if not args.compare:
            return 0
        clean = bamboo.train(job(args.steps, []), out=args.out / "clean" if args.out else None)
    except (bamboo.JobError, bamboo.RunFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    verdict = bamboo.same(clean, killed)  # the contract's rule: here, the same bits
    print(f"without the kill: parameters {clean.param_sha256[:12]}: "
          f"{'the same losses and parameters' if verdict else 'DIFFERENT'}: {verdict.reason}")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
