"""Restore points: where the run goes back to when no live node holds some layer.

In order: the newest whole checkpoint of this run (a corrupt or truncated one is skipped
with a warning), else the run's initial state: the checkpoint it resumed from, or the
seeded initialisation at step 0. The initial state always exists, so a run never stops
for want of state while it has nodes to train on. Either way the steps after the restore
point are redone and counted (`redone_steps`): the plan starts at the restore point, and
whoever enters it rewinds the step protocol (`StepProtocol.rewind`, the one writer of the
committed step) to its `start_step`.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from bamboo.control.interval import CheckpointInterval
from bamboo.control.state import RunContext
from bamboo.plan.planner import GenerationPlan, plan_generation
from bamboo.run.checkpoint import CheckpointError, checkpoint_location, load_latest

__all__ = ["RestorePoints"]


class RestorePoints:
    def __init__(self, ctx: RunContext, interval: CheckpointInterval) -> None:
        self.ctx = ctx
        self.interval = interval
        self.redone_steps = 0
        self.last_checkpoint: Path | str | None = ctx.resume_path

    def plan(self, kwargs: dict[str, Any], why: str) -> GenerationPlan:
        """The next generation's plan from the newest restore point (`kwargs` as for
        `plan_generation`); `why`: which layers have no live copy."""
        ctx = self.ctx
        try:  # manifests and file sizes only: the nodes read the layers they need
            ckpt = load_latest(checkpoint_location(ctx.cfg), quiet=True)
        except CheckpointError as e:  # none yet: this run's own initial state
            return self._initial_state(kwargs, f"{why}, and {e}")
        if ckpt.step < (ctx.resume_step or 0):
            return self._initial_state(kwargs, f"{why}, and the newest checkpoint is older "
                                               f"than the one this run resumed from")
        if ckpt.step > ctx.committed:  # a shared --checkpoint-dir: never this run's
            return self._initial_state(kwargs, f"{why}, and the newest checkpoint ({ckpt.step}) "
                                               f"is ahead of this run (step {ctx.committed})")
        if ckpt.warning:
            ctx.say(ckpt.warning)
            ctx.events.write("checkpoint_fallback", warning=ckpt.warning)
        self._go_back(ckpt.step, str(ckpt.path))
        return plan_generation(start_step=ckpt.step, checkpoint=str(ckpt.path), **kwargs)

    def _initial_state(self, kwargs: dict[str, Any], why: str) -> GenerationPlan:
        ctx = self.ctx
        if ctx.resume_path is not None:
            ctx.say(f"{why}: restarting from the checkpoint this run resumed from "
                    f"(step {ctx.resume_step})")
            self._go_back(ctx.resume_step or 0, str(ctx.resume_path))
            return plan_generation(start_step=ctx.resume_step or 0,
                                   checkpoint=str(ctx.resume_path), **kwargs)
        if ctx.committed:
            ctx.say(f"{why}: restarting from the initial state (step 0)")
        self._go_back(0, None)
        plan = plan_generation(start_step=0, checkpoint="", **kwargs)  # "": no transfers
        # every layer is built from the seed, as at the start
        return replace(plan, checkpoint=None, fresh_start=True)

    def _go_back(self, step: int, path: str | None) -> None:
        ctx = self.ctx
        redone = ctx.committed - step
        self.redone_steps += redone
        ctx.events.write("checkpoint_restore", checkpoint=path, step=step, redone_steps=redone)
        self.interval.restored(step, from_checkpoint=path is not None)
