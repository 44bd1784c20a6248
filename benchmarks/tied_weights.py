"""What a tie between the embedding and the head costs a step: the same model with and
without `ties=`, runs alternated, each run's median step from summary.json.

    .venv/bin/python benchmarks/tied_weights.py --pairs 6 --d 64 --vocab 4096

The model: an embedding, two MLP blocks and a LayerNorm head whose weight is the embedding's
(tied) or its own (untied), cut into 2 stages, so the tie crosses stages and the commit
round adds one message of vocab x d gradient values each way per step.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

MODEL = '''
import torch
from torch import nn
from bamboo.model.api import PipelineModel, TensorSpec

CONTEXT, D = 32, {d}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class Head(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.weight = nn.Parameter(torch.randn(vocab, D) * 0.02)

    def forward(self, x):
        return self.ln(x) @ self.weight.T


def build(vocab_size: int = {vocab}) -> PipelineModel:
    return PipelineModel(
        layers=[lambda: nn.Embedding(vocab_size, D), Block, Block, lambda: Head(vocab_size)],
        boundary=TensorSpec((CONTEXT, D)), context=CONTEXT, vocab_size=vocab_size,
        ties={ties})
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.runs import config, run_in_process

    work = Path(tempfile.mkdtemp(prefix="bamboo-tied-"))
    models = {}
    for label, ties in (("tied", '{"embed": [(0, "weight"), (3, "weight")]}'), ("untied", "{}")):
        path = work / f"{label}_model.py"
        path.write_text(MODEL.format(d=args.d, vocab=args.vocab, ties=ties))
        models[label] = f"{path}:build"
    steps: dict[str, list[float]] = {"tied": [], "untied": []}
    sha: dict[str, set[str]] = {"tied": set(), "untied": set()}
    try:
        for i in range(args.pairs):
            order = ("tied", "untied") if i % 2 == 0 else ("untied", "tied")
            for label in order:
                cfg = config(model=models[label], nodes=2, stages=2, steps=args.steps,
                             micro_batches=4, micro_batch_size=8, seed=1)
                summary = run_in_process(cfg, work / f"{label}-{i}")
                assert summary["status"] == "completed", summary.get("error")
                steps[label].append(summary["median_step_s"])
                sha[label].add(summary["param_sha256"])
                print(f"pair {i} {label:6}: median step {1000 * steps[label][-1]:.2f} ms",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tied, untied = (statistics.median(steps[k]) for k in ("tied", "untied"))
    ratios = [t / u for t, u in zip(steps["tied"], steps["untied"])]
    print(f"d={args.d}, vocab {args.vocab} ({args.d * args.vocab} tied values), 2 nodes x 2 "
          f"stages, 4 micro-batches of 8, {args.steps} steps, {args.pairs} pairs")
    print(f"median step: tied {1000 * tied:.2f} ms, untied {1000 * untied:.2f} ms, ratio "
          f"{tied / untied:.3f}; median of the pairs' ratios {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}..{max(ratios):.3f})")
    print(f"every tied run ended with the same parameters: {len(sha['tied']) == 1}")


if __name__ == "__main__":
    main()
