"""A DeepSpeed pipeline script, trained by bamboo: the model, its loss_fn and its settings
stay; DeepSpeed's engine and its training loop are replaced by `bamboo.train`.

    python examples/deepspeed_pipeline.py --steps 5 --out runs/ds [--compare]

What changed in the script (DeepSpeed's lines removed, bamboo's added):

    -    deepspeed.init_distributed()
    -    engine, _, _, _ = deepspeed.initialize(model=build_model(), config=DS_CONFIG,
    -                                           model_parameters=...)
    -    for step in range(steps):
    -        loss = engine.train_batch(data_iter)
    +    result = bamboo.train(bamboo.Job(model=build, nodes=4, stages=2, steps=steps,
    +                                     micro_batches=2, micro_batch_size=4, grad_clip=1.0,
    +                                     optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
    +                                     kill=kill))

`build` is `build_model` inside `stand_in_world`: DeepSpeed's `PipelineModule` asks
torch.distributed for the pipeline's ranks while it is built, and bamboo starts no such
world (it places the layers itself, each node building only its own). The module is
built in a world of stand-in ranks (torch's fake process group, which communicates
nothing), and bamboo takes its `LayerSpec`s and its `loss_fn` (bamboo.model.forms).
DEEPSPEED_CONFIG's settings map to the job's options: train_micro_batch_size_per_gpu ->
micro_batch_size, gradient_accumulation_steps -> micro_batches, gradient_clipping ->
grad_clip, the optimizer -> optimizer=. `num_stages` and `partition_method` are DeepSpeed's:
bamboo plans the stages (`stages=`). The data is bamboo's synthetic language; each sample's
labels are its next tokens, as `loss_fn(outputs, labels)` takes them. The tied embedding and
head land on different stages; each keeps a copy, and bamboo adds the copies' gradients
before the optimizer steps, as DeepSpeed's ReduceTiedGrads does (docs/api.md).

Every process of the run calls `build`, so the script's run starts under
`if __name__ == "__main__":`. `--compare` runs the job without the kill too and checks with
`bamboo.same` that both end with the same losses and parameters (exit 1 if not). Needs
`pip install 'bamboo-train[deepspeed]'`.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import bamboo

CONTEXT, D, VOCAB = 16, 32, 256

DEEPSPEED_CONFIG = {  # what the DeepSpeed script gave deepspeed.initialize
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def embedding_head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """The output head: logits from the input embedding's weight (tied)."""
    return F.linear(x, embedding.weight)


def build_model(vocab_size: int = VOCAB) -> nn.Module:
    """The DeepSpeed script's model, unchanged: the embedding and the head are one weight
    (a TiedLayerSpec at each end, as DeepSpeed's GPT examples tie them)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    layers = [TiedLayerSpec("embed", nn.Embedding, vocab_size, D), LayerSpec(Block, D),
              LayerSpec(Block, D), LayerSpec(nn.LayerNorm, D),
              TiedLayerSpec("embed", nn.Embedding, vocab_size, D, forward_fn=embedding_head)]
    return PipelineModule(layers=layers, loss_fn=loss_fn, num_stages=2)


@contextlib.contextmanager
def stand_in_world(size: int) -> Iterator[None]:
    """torch.distributed as `size` stand-in ranks of this one process while a
    PipelineModule is built (torch's fake process group: no communication), torn down
    after. DeepSpeed's shared-memory all-reduce is marked unneeded: nothing is reduced
    here, and building it compiles C++ for minutes."""
    import deepspeed
    import deepspeed.ops
    from torch.testing._internal.distributed.fake_pg import FakeStore
    os.environ.setdefault("LOCAL_RANK", "0")
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        deepspeed.init_distributed(dist_backend="fake", auto_mpi_discovery=False,
                                   verbose=False)
        yield
    finally:
        dist.destroy_process_group()


def build(vocab_size: int = VOCAB, context: int = CONTEXT) -> nn.Module:
    """The PipelineModule, as every process of the run builds it (bamboo reads the
    vocabulary's size and the tokens per sample from the keywords)."""
    with stand_in_world(2), contextlib.redirect_stdout(sys.stderr):  # its layout print-out
        return build_model(vocab_size)


def job(steps: int, kill: list[str]) -> bamboo.Job:
    """DEEPSPEED_CONFIG as the job's options: two pipelines of two stages."""
    c = DEEPSPEED_CONFIG
    return bamboo.Job(
        model=build, nodes=4, stages=2, steps=steps, seed=3, kill=kill,
        micro_batches=c["gradient_accumulation_steps"],
        micro_batch_size=c["train_micro_batch_size_per_gpu"], grad_clip=c["gradient_clipping"],
        optimizer=functools.partial(torch.optim.AdamW, **c["optimizer"]["params"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
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
