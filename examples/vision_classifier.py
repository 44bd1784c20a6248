"""A small vision transformer on an image Dataset of your own, with dropout, a
label-smoothing loss and accuracy as a metric, through `bamboo.train`, a node killed in
flight.

    python examples/vision_classifier.py --steps 6 --out runs/vit [--compare]

The pieces are those of a torch script: a map-style `Dataset` whose sample i is
`(image, label)`, the image a `[1, 16, 16]` float32 tensor of pixels in `[0, 1]` (the model
declares it, `inputs=TensorSpec((1, 16, 16))`: layer 0 receives `[B, 1, 16, 16]`),
`F.cross_entropy(..., label_smoothing=0.1)` as the loss, an accuracy function of
`(outputs, labels)`, and a model of four pipeline layers (patch embedding, two
transformer blocks, the classifier head), each with `nn.Dropout`. It has no vocabulary
(no `vocab_size`): it trains on its Dataset only. Every process builds
them again by name; bamboo picks each step's sample indices (by seed and step, shuffled
epochs) and seeds every dropout mask by (seed, step, micro-batch, layer), so the shadow
that takes over the killed node's stage draws the masks and reads the samples the lost
node would have. `--compare` runs the job without the kill too and checks with `bamboo.same`
that both end with the same losses, metrics and parameters (exit 1 if not).
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
from bamboo.model.api import PipelineModel, TensorSpec

SIZE, PATCH, D, HEADS, CLASSES = 16, 4, 32, 4, 4
PATCHES = (SIZE // PATCH) ** 2


class Quadrants(Dataset):
    """`n` noisy 16x16 grey images, each with a bright square in one quadrant: the
    label. Sample i is drawn from (seed, i), so every process reads the same one; its
    pixels are in [0, 1], one channel."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = int(torch.randint(0, CLASSES, (1,), generator=g))
        image = 0.3 + 0.15 * torch.randn(SIZE, SIZE, generator=g)
        row, col = divmod(label, 2)
        half = SIZE // 2
        image[row * half:(row + 1) * half, col * half:(col + 1) * half] += 0.4
        return image.clamp(0, 1).unsqueeze(0), torch.tensor(label)


def accuracy(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The fraction of images whose class is the arg-max."""
    return (outputs.argmax(-1) == labels).float().mean()


class PatchEmbed(nn.Module):
    """[B, 1, 16, 16] images -> [B, 16, D] patch embeddings with learned positions."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(1, D, kernel_size=PATCH, stride=PATCH)
        self.positions = nn.Parameter(torch.zeros(PATCHES, D))
        self.drop = nn.Dropout(0.1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(images).flatten(2).transpose(1, 2) + self.positions)


class Block(nn.Module):
    """Pre-LN transformer block; dropout on both residual branches."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attention = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.drop(self.attention(h, h, h, need_weights=False)[0])
        return x + self.drop(self.mlp(self.ln2(x)))


class Head(nn.Module):
    """Mean over the patches, then the class logits: [B, 16, D] -> [B, CLASSES]."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(D), nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x).mean(dim=1))


def build() -> PipelineModel:
    """Four pipeline layers: float images in, [16 patches, D] float32 activations between
    them, class logits out; `context` is the sequence the blocks see (the patches)."""
    return PipelineModel(layers=[PatchEmbed, Block, Block, Head],
                         inputs=TensorSpec((1, SIZE, SIZE)), boundary=TensorSpec((PATCHES, D)),
                         output=TensorSpec((CLASSES,)), context=PATCHES,
                         description=f"ViT: {SIZE}x{SIZE} images, {PATCHES} patches, d={D}")


def job(steps: int, kill: list[str]) -> bamboo.Job:
    """Two pipelines of two stages, AdamW; the held-out set's loss and accuracy at the end."""
    return bamboo.Job(
        model=build, dataset=functools.partial(Quadrants, n=96),
        eval_dataset=functools.partial(Quadrants, n=32, seed=1),
        loss=functools.partial(F.cross_entropy, label_smoothing=0.1),
        metrics={"accuracy": accuracy}, nodes=4, stages=2, micro_batches=2,
        micro_batch_size=8, steps=steps, seed=3, lr=3e-3, eval_every=steps, eval_batches=2,
        kill=kill)


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
        print(f"losses {[round(x, 4) for x in killed.losses]}; accuracy "
              f"{[round(m['accuracy'], 3) for m in killed.summary['metrics']]}; "
              f"{killed.preemptions} preemption(s), {killed.failovers} failover(s); "
              f"parameters {killed.param_sha256[:12]} in {killed.run_dir}")
        if not args.compare:
            return 0
        clean = bamboo.train(job(args.steps, []), out=args.out / "clean" if args.out else None)
    except (bamboo.JobError, bamboo.RunFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    verdict = bamboo.same(clean, killed)  # the contract's rule, the metrics judged as losses
    print(f"without the kill: parameters {clean.param_sha256[:12]}: "
          f"{'the same losses, metrics and parameters' if verdict else 'DIFFERENT'}: "
          f"{verdict.reason}")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
