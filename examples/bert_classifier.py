"""Fine-tune a small BERT-style classifier through `bamboo.train`, a node killed in flight.

    python examples/bert_classifier.py [--steps 40] [--out runs/bert] [--compare]

The model is what a torch user writes, an `nn.Sequential` of token and position embeddings,
`nn.TransformerEncoderLayer` blocks and a pooled `[CLS]` head, dropout 0.1 throughout
(bamboo cuts it between any two children). The data is a map-style Dataset of this file,
sample i `((input_ids, attention_mask), label)` as a tokenizer gives them: short "reviews"
of word ids padded to CONTEXT, the bool mask True on the real tokens, labelled 1 when they
hold more positive words than negative ones. Layer 0 takes the tuple `(input_ids,
attention_mask)` (the model declares it: `model.inputs = (TensorSpec((CONTEXT,),
torch.int64), TensorSpec((CONTEXT,), torch.bool))`) and hands on `(hidden states, attention
mask)`: the mask travels between the pipeline's stages with the hidden states, without a
gradient, and every block attends to the real tokens only. Cross-entropy is the loss and `accuracy` a metric, taken on the last stage for every
step and for the held-out Dataset, and read back from the RunResult.

Dropout is safe under failover: bamboo seeds torch's generator around every layer's forward
by (seed, step, micro-batch, layer), so the shadow that takes over the killed node's stage
draws the same masks. `--compare` runs the same job without the kill too and checks with
`bamboo.same` that both end with the same losses, metrics and parameters, bit for bit (a
failover keeps the layout, so the contract's rule asks for the bits; exit 1 if not).
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import bamboo
from bamboo.model.api import TensorSpec

CONTEXT, D, HEADS, BLOCKS, CLASSES, DROPOUT = 16, 32, 2, 2, 2, 0.1
PAD, CLS = 0, 1
POSITIVE, NEGATIVE, NEUTRAL = range(2, 10), range(10, 18), range(18, 40)
"""Word ids: eight positive words, eight negative ones, and neutral filler."""


class Reviews(Dataset):
    """`n` reviews of 4..CONTEXT-1 words after `[CLS]`, padded with PAD, with their
    attention mask; each one drawn from (seed, index), so every process builds the same
    samples."""

    def __init__(self, n: int = 512, seed: int = 0) -> None:
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        length = int(torch.randint(4, CONTEXT, (), generator=g))
        words = torch.randint(POSITIVE.start, NEUTRAL.stop, (length,), generator=g)
        positive = int(((words >= POSITIVE.start) & (words < POSITIVE.stop)).sum())
        negative = int(((words >= NEGATIVE.start) & (words < NEGATIVE.stop)).sum())
        ids = torch.full((CONTEXT,), PAD, dtype=torch.int64)
        ids[0], ids[1:length + 1] = CLS, words
        return (ids, ids != PAD), torch.tensor(int(positive > negative))


class Embeddings(nn.Module):
    """Token and position embeddings, LayerNorm and dropout; the mask handed on."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab_size, D), nn.Embedding(CONTEXT, D)
        self.norm, self.drop = nn.LayerNorm(D), nn.Dropout(DROPOUT)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = x
        positions = torch.arange(ids.shape[1], device=ids.device)
        hidden = self.drop(self.norm(self.tokens(ids) + self.positions(positions)))
        return hidden, mask


class Block(nn.Module):
    """One encoder block over the real tokens; the mask is handed on as it came."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=DROPOUT,
                                                batch_first=True)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, mask = x
        return self.layer(hidden, src_key_padding_mask=~mask), mask


class Classifier(nn.Module):
    """BERT's pooler (tanh of a linear map of the `[CLS]` state), dropout, and the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.drop, self.out = nn.Linear(D, D), nn.Dropout(DROPOUT), nn.Linear(D, CLASSES)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden, _ = x
        return self.out(self.drop(torch.tanh(self.pool(hidden[:, 0]))))


def build(vocab_size: int = 256, context: int = CONTEXT) -> nn.Sequential:
    """Embeddings, BLOCKS encoder blocks and the classifier, as a torch user writes them,
    its `inputs` the Dataset's `(input_ids, attention_mask)` per sample: bamboo cuts the
    Sequential one child per pipeline layer and finds what travels between them on the
    meta device (here `([B, CONTEXT, D] float32, [B, CONTEXT] bool)`), and the output
    (`[B, CLASSES]`). `bamboo.model.api.PipelineModel(layers=..., inputs=..., boundary=...)`
    declares the same by hand."""
    model = nn.Sequential(Embeddings(vocab_size), *[Block() for _ in range(BLOCKS)],
                          Classifier())
    model.inputs = (TensorSpec((context,), torch.int64), TensorSpec((context,), torch.bool))
    return model


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The fraction of reviews whose label is the arg-max."""
    return (logits.argmax(-1) == labels).float().mean()


def job(steps: int, kill: list[str]) -> bamboo.Job:
    """Two pipelines of two stages; a held-out set scored every other step."""
    return bamboo.Job(
        model=build, dataset=functools.partial(Reviews, n=512),
        eval_dataset=functools.partial(Reviews, n=64, seed=1), loss=F.cross_entropy,
        metrics={"accuracy": accuracy}, nodes=4, stages=2, micro_batches=2,
        micro_batch_size=16, steps=steps, seed=3, lr=3e-3, eval_every=2, eval_batches=2,
        kill=kill)


def report(name: str, result: bamboo.RunResult) -> None:
    """The run's losses, accuracy (last step and held out) and failovers."""
    train = [m["accuracy"] for m in result.summary["metrics"]]  # one dict a step
    held_out = [(step, m["accuracy"]) for step, m in result.summary["eval_metrics"]]
    print(f"{name}: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, accuracy "
          f"{train[0]:.3f} -> {train[-1]:.3f} over {len(train)} steps, held out "
          f"{held_out[-1][1]:.3f} after step {held_out[-1][0]}; {result.preemptions} "
          f"preemption(s), {result.failovers} failover(s); parameters "
          f"{result.param_sha256[:12]} in {result.run_dir}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None, help="run directory (default: runs/...)")
    parser.add_argument("--kill", default="0:1@3", help="PIPELINE:STAGE@STEP ('' for none)")
    parser.add_argument("--compare", action="store_true",
                        help="also run without the kill and check both end equal")
    args = parser.parse_args(argv)
    kill = [args.kill] if args.kill else []
    try:
        killed = bamboo.train(job(args.steps, kill),
                              out=args.out / "killed" if args.out else None)
        report("killed", killed)
        if not args.compare:
            return 0
        clean = bamboo.train(job(args.steps, []), out=args.out / "clean" if args.out else None)
    except (bamboo.JobError, bamboo.RunFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    report("without the kill", clean)
    verdict = bamboo.same(clean, killed)  # the contract's rule; metrics and held-out too
    print(f"{'the same losses and parameters' if verdict else 'DIFFERENT'}: {verdict.reason}")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
