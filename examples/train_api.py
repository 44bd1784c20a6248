"""Train your own model from Python: `python examples/train_api.py [RUN_DIR]`.

The model is built by a function of this file; every worker process imports the file to
call it (by its path, derived by `bamboo.Job`), so the run starts under
`if __name__ == "__main__":`. One node is killed in step 2: its shadow takes over its
stage in flight, and the run ends with the same losses and parameters as without the kill.
"""
from __future__ import annotations

import sys

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


def main(out: str | None) -> int:
    job = bamboo.Job(model=build, nodes=4, stages=2, micro_batches=2, micro_batch_size=4,
                     steps=5, seed=3, kill=["0:1@2"])

    def on_event(event: dict) -> None:
        if event["event"] == "node_lost":
            print(f"lost {event['node']} in step {event['step']}: {event['handled_as']}")

    try:
        result = bamboo.train(job, out=out, on_event=on_event)
    except (bamboo.JobError, bamboo.RunFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"losses {[round(x, 4) for x in result.losses]}, {result.preemptions} preemption(s), "
          f"{result.failovers} failover(s); parameters {result.param_sha256[:12]} in "
          f"{result.run_dir}")
    params = result.state_dict()
    print(f"{len(params)} tensors, {sum(t.numel() for t in params.values())} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
