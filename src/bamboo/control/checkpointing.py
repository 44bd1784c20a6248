"""Checkpoint publication: the holders write their layers themselves; the coordinator makes
a checkpoint whole once every layer is durable.

After a commit marked `ckpt`, each stage's first live holder writes its layers of that step
under the job's checkpoint location (`bamboo.run.checkpoint.write_layers`, on a background
thread) and reports a `CheckpointPart` naming them. When every layer of step k is
reported, the coordinator writes the manifest and LATEST (`bamboo.run.checkpoint.publish`,
atomically, the manifest last) and prunes to --keep-checkpoints. No tensor comes here.
A part that could not be written (a full disk) or a publication that failed stops the run
at once (`Stop`), naming the storage's error (the folder, and on a full disk the room left
there) and the newest whole checkpoint, where the run resumes once there is room: training
on would only stretch the steps a restart redoes. The failed checkpoint's folder is removed
(as each of its parts arrives), so a full disk keeps no partial save.
"""
from __future__ import annotations

from pathlib import Path

from bamboo.control.interval import CheckpointInterval
from bamboo.control.state import RunContext, Stop
from bamboo.data.user import data_position
from bamboo.protocol.messages import CheckpointPart
from bamboo.run.checkpoint import CheckpointError, checkpoint_location, discard_unpublished, publish
from bamboo.run.checkpoint_storage import size_text

__all__ = ["CheckpointAssembly"]


class CheckpointAssembly:
    def __init__(self, ctx: RunContext, interval: CheckpointInterval) -> None:
        self.ctx = ctx
        self.interval = interval
        self.parts: dict[int, set[int]] = {}
        """Step -> the layers reported durable so far."""
        self.write_s: dict[int, float] = {}
        """Step -> the slowest part's write so far (the parts are written in parallel)."""
        self.failed: set[int] = set()
        """Steps a part of which could not be written: never published."""
        self.last: Path | str | None = ctx.resume_path
        self.last_step = -1
        """The newest step published in this run: an older one coming whole later (a slow
        writer of a node that left) is not published over it."""

    def on_part(self, msg: CheckpointPart) -> None:
        ctx = self.ctx
        if msg.error is not None:
            first = msg.step not in self.failed
            if first:
                self.failed.add(msg.step)
                self.parts.pop(msg.step, None)
                self.write_s.pop(msg.step, None)
                ctx.events.write("checkpoint_failed", step=msg.step, node_rank=msg.rank,
                                 error=msg.error)
            self._discard(msg.step)
            if first:
                raise Stop(self._stopped(f"checkpoint of step {msg.step} not saved: {msg.error}"))
            return
        if msg.step in self.failed or msg.step < self.last_step:
            self._discard(msg.step)  # never to be whole: its layers go
            return
        if msg.step == self.last_step:
            return
        if msg.bytes:
            ctx.events.write("checkpoint_part", step=msg.step, node_rank=msg.rank,
                             layers=msg.layers, bytes=msg.bytes, seconds=msg.seconds,
                             mb_per_s=round(msg.bytes / 1e6 / max(msg.seconds, 1e-9), 2))
        parts = self.parts.setdefault(msg.step, set())
        parts.update(msg.layers)
        self.write_s[msg.step] = max(self.write_s.get(msg.step, 0.0), msg.seconds)
        if not parts >= set(range(len(ctx.param_counts))):
            return
        del self.parts[msg.step]
        write_s = self.write_s.pop(msg.step)
        cfg = ctx.cfg
        meta = {"unit": "layer", "model": cfg.model.name, "seed": cfg.training.seed,
                "global_micro_batches": cfg.global_micro_batches,
                "micro_batch_size": cfg.layout.micro_batch_size, "steps": cfg.training.steps,
                "optimizer": cfg.training.optimizer, "losses": ctx.losses[:msg.step],
                "eval_losses": [e for e in ctx.eval_losses if e[0] <= msg.step],
                "data": data_position(cfg, msg.step), "metrics": ctx.metrics[:msg.step],
                "eval_metrics": [e for e in ctx.eval_metrics if e[0] <= msg.step],
                "lr_scales": [e for e in ctx.lr_scales if e[0] <= msg.step],
                **({"skipped_steps": [k for k in ctx.skipped_steps if k < msg.step],
                    "loss_scale": ctx.loss_scale_at(msg.step).to_json()}
                   if cfg.model.precision == "fp16" else {})}
        start = ctx.clock()
        try:
            path = publish(checkpoint_location(cfg), msg.step, sorted(parts), meta,
                           keep=cfg.checkpoints.keep)
        except CheckpointError as e:
            ctx.events.write("checkpoint_failed", step=msg.step, error=str(e))
            self._discard(msg.step)
            raise Stop(self._stopped(str(e))) from None
        self.last, self.last_step = path, msg.step
        took = ctx.clock() - start
        ctx.events.write("checkpoint", step=msg.step, path=str(path), took_s=round(took, 4))
        self.interval.written(msg.step, write_s + took)

    def newest(self) -> tuple[int, Path | str] | None:
        """The newest whole checkpoint (step, folder): published in this run, else the one
        it resumed from; None when there is none."""
        if self.last_step >= 0 and self.last is not None:
            return self.last_step, self.last
        if self.ctx.resume_path is not None and self.ctx.resume_step is not None:
            return self.ctx.resume_step, self.ctx.resume_path
        return None

    def _stopped(self, error: str) -> str:
        """The one line a run stopped by a failed save (`error` says which and why) ends
        with."""
        size = 4 * sum(3 * n + 1 for n in self.ctx.param_counts)
        newest = self.newest()
        full = any(text in error for text in ("No space left", "quota", "Quota"))
        when = "once there is room" if full else "once its checkpoints can be written"
        resume = (f"the newest whole checkpoint is step {newest[0]} ({newest[1]}): the run "
                  f"resumes from it {when}" if newest is not None else
                  f"no whole checkpoint was written before: the run starts over {when}")
        return (f"{error}; stopped the run, as training on would go without a restore point "
                f"(a checkpoint of this job takes about {size_text(size)}); {resume}")

    def forget_after(self, step: int) -> None:
        """A restore went back to `step`: parts of later steps will never complete, and those
        steps are checkpointed afresh when they are redone."""
        self.parts = {k: v for k, v in self.parts.items() if k <= step}
        self.write_s = {k: v for k, v in self.write_s.items() if k <= step}
        self.failed = {k for k in self.failed if k <= step}
        self.last_step = min(self.last_step, step)

    def _discard(self, step: int) -> None:
        """The folder of a checkpoint that will never be whole (a part could not be written,
        or a newer one is published) is removed: a full disk leaves no step folders."""
        try:
            discard_unpublished(checkpoint_location(self.ctx.cfg), step)
        except OSError as e:  # the storage is failing: the warning already said so
            self.ctx.events.write("cleanup_failed", error=f"{type(e).__name__}: {e}"[:300])
