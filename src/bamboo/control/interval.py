"""When a checkpoint is written: the step boundaries that carry the `ckpt` flag.

`--checkpoint-every K` fixes the interval (0: none). Without it the run chooses: the first
checkpoint comes after step `FIRST_AFTER` (so a durable restore point exists early, and its
write cost is measured), then every K steps with K from Young/Daly,

    T = sqrt(2 x C x M)        C: seconds a checkpoint costs (the slowest holder's write
                                  plus the publication, as measured in this run)
                               M: mean seconds between losses that no redundancy covers

M is estimated conservatively: the observed rate of restores from a checkpoint (or from
the initial state) over the run's wall time, never taken below the prior
`PRIOR_UNCOVERED_PER_HOUR` (a high rate for a spot fleet: a shorter interval than the
true optimum, never a longer one). K = T / step time, clamped so that writing costs at
most `MAX_WRITE_SHARE` of the training time (K >= C / (share x step time)) and never more
than `MAX_UNPROTECTED_S` of training is unprotected (the upper bound wins when the two
conflict: the writes run on the holders' background threads, and losing a long stretch of
training costs more than a slower checkpoint). Every choice is a `checkpoint_interval`
event; the last one is summary.json's `config.checkpoint_every`. Every checkpointing run
also checkpoints after its last step: the finished run is a resume point.
"""
from __future__ import annotations

import math
import statistics

from bamboo.control.state import RunContext

__all__ = ["CheckpointInterval", "choose_interval", "FIRST_AFTER", "PRIOR_UNCOVERED_PER_HOUR",
           "MAX_WRITE_SHARE", "MAX_UNPROTECTED_S"]

FIRST_AFTER = 2
"""The run's first checkpoint: after this many steps (the first step also warms up)."""
PRIOR_UNCOVERED_PER_HOUR = 1.0
"""Losses no redundancy covers, per hour, assumed before the run has seen any."""
MAX_WRITE_SHARE = 0.01
"""At most this share of the training time goes to writing checkpoints..."""
MAX_UNPROTECTED_S = 180.0
"""...and never more than this many seconds of training are without a restore point."""
_STEP_WINDOW = 20


def choose_interval(write_s: float, step_s: float, uncovered_per_hour: float) -> tuple[int, dict]:
    """K steps between checkpoints, and why (the figures of the `checkpoint_interval` event)."""
    step_s = max(step_s, 1e-6)
    mtbf_s = 3600.0 / max(uncovered_per_hour, PRIOR_UNCOVERED_PER_HOUR)
    young_daly = math.sqrt(2.0 * max(write_s, 0.0) * mtbf_s) / step_s
    low = math.ceil(write_s / (MAX_WRITE_SHARE * step_s)) if write_s > 0 else 1
    high = max(1, math.floor(MAX_UNPROTECTED_S / step_s))
    every = min(max(round(young_daly), low, 1), high)
    bound = "unprotected" if every == high and every < max(round(young_daly), low) else (
        "write_share" if every == low and low > round(young_daly) else "young_daly")
    return every, {"write_s": round(write_s, 4), "step_s": round(step_s, 4),
                   "mtbf_s": round(mtbf_s, 1), "young_daly_steps": round(young_daly, 1),
                   "bound": bound}


class CheckpointInterval:
    """Which boundaries checkpoint (`due`), fed with what the run measures."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        every = ctx.cfg.checkpoints.every
        self.auto = every is None
        self.every: int | None = every
        """The interval in force: fixed, or the run's latest choice (None: not chosen yet)."""
        self.next_at: int | None = (ctx.resume_step or 0) + FIRST_AFTER if self.auto else None
        self.step_s: list[float] = []
        self.last_t: float | None = None
        self.uncovered = 0
        self.write_s: float | None = None
        """The latest checkpoint's measured cost."""

    @property
    def enabled(self) -> bool:
        return self.every != 0

    def due(self, done: int) -> bool:
        """Whether the boundary after `done` committed steps writes a checkpoint (the last
        one always does, when checkpoints are on)."""
        now = self.ctx.clock()
        if self.last_t is not None:
            self.step_s = (self.step_s + [now - self.last_t])[-_STEP_WINDOW:]
        self.last_t = now
        if not self.enabled:
            return False
        if done >= self.ctx.cfg.training.steps:
            return True
        if not self.auto:
            return done % self.every == 0
        if self.next_at is None or done < self.next_at:
            return False
        # Until this one is whole (`written` chooses the next), the next is due after the
        # interval in force, or the most training left unprotected: a writer lost on the
        # way never leaves the run without checkpoints.
        self.next_at = done + (self.every or self._most_steps())
        return True

    def _most_steps(self) -> int:
        step_s = statistics.median(self.step_s) if self.step_s else 1.0
        return max(1, math.floor(MAX_UNPROTECTED_S / max(step_s, 1e-6)))

    def written(self, step: int, write_s: float) -> None:
        """Step `step`'s checkpoint is whole and cost `write_s`: choose the next one."""
        if not self.auto or step >= self.ctx.cfg.training.steps:
            return
        self.write_s = write_s
        self._choose(step, write_s)

    def restored(self, step: int, from_checkpoint: bool) -> None:
        """A loss no redundancy covered sent the run back to `step`."""
        self.uncovered += 1
        self.last_t = None
        if not self.auto:
            return
        if from_checkpoint and self.write_s is not None:  # the loss changes the rate
            self._choose(step, self.write_s)
        else:
            self.next_at = step + FIRST_AFTER

    def _choose(self, step: int, write_s: float) -> None:
        ctx = self.ctx
        step_s = statistics.median(self.step_s) if self.step_s else 1.0
        hours = max(ctx.clock() - ctx.t0, 1.0) / 3600.0
        every, why = choose_interval(write_s, step_s, self.uncovered / hours)
        if every != self.every:
            ctx.events.write("checkpoint_interval", every=every, after_step=step,
                             uncovered_losses=self.uncovered, **why)
        self.every = every
        self.next_at = step + every
