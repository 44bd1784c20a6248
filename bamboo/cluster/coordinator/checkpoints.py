"""Checkpoint assembly: the layers that the stages' holders send after a commit marked
`ckpt`, written as one durable checkpoint once every layer is in.

Each stage's first live holder sends its layers; when all layers of step k have arrived,
they are written with the atomic, checksummed writer of `bamboo.checkpoint` (per layer,
so that a later layout with another partition can load them). A write that fails (a full
disk) is a warning: the previous checkpoint stays the newest.
"""
from __future__ import annotations

from pathlib import Path

import torch

from bamboo.checkpoint import CheckpointError, checkpoint_root, save_checkpoint
from bamboo.cluster.coordinator.state import RunContext
from bamboo.cluster.protocol import CheckpointPart

__all__ = ["CheckpointAssembly"]


class CheckpointAssembly:
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.parts: dict[int, dict[int, torch.Tensor]] = {}
        self.last: Path | None = ctx.resume_path

    def on_part(self, msg: CheckpointPart) -> None:
        ctx = self.ctx
        parts = self.parts.setdefault(msg.step, {})
        parts.update(msg.layers)
        if len(parts) < len(ctx.param_counts):
            return
        del self.parts[msg.step]
        cfg = ctx.cfg
        meta = {"unit": "layer", "model": cfg.model, "seed": cfg.seed,
                "global_micro_batches": cfg.global_micro_batches,
                "micro_batch_size": cfg.micro_batch_size, "steps": cfg.steps,
                "losses": ctx.losses[:msg.step]}
        start = ctx.clock()
        try:
            path = save_checkpoint(checkpoint_root(ctx.run_path), msg.step,
                                   {i: {"state": v} for i, v in parts.items()}, {}, meta)
        except CheckpointError as e:
            ctx.events.write("checkpoint_failed", step=msg.step, error=str(e))
            ctx.say(f"warning: {e}")
            return
        self.last = path
        ctx.events.write("checkpoint", step=msg.step, path=str(path),
                         took_s=round(ctx.clock() - start, 4))

    def forget_after(self, step: int) -> None:
        """A restore went back to `step`: parts of later steps will never complete."""
        self.parts = {k: v for k, v in self.parts.items() if k <= step}
