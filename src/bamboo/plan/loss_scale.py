"""Dynamic loss scaling for `--precision fp16`, as `torch.amp.GradScaler` does it, made a pure
function of the run's history so that every node, replica and shadow agrees on it.

The last stage's loss is multiplied by the scale before the backward, so small fp16
gradients do not flush to zero; the optimizer step divides it out again. A step whose
gradients overflowed (its global gradient norm, which every node agrees on in the commit
round, is inf or NaN) is *skipped*: it commits (its samples are consumed, its loss is
recorded) but no node and no replica applies it, and the scale is halved. After
`GROWTH_INTERVAL` steps in a row without an overflow the scale doubles. The scale of step
k therefore follows from the steps skipped before it (`scale_at`): a node that joins, a
step redone after a restore and a resumed run all get the same one.

A scale that falls below `MIN_SCALE` means the gradients overflow however small the scale
(a model that does not train in fp16): the run stops with that said, before any weight
turns NaN (`collapsed`).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["LossScale", "INIT_SCALE", "GROWTH_FACTOR", "BACKOFF_FACTOR", "GROWTH_INTERVAL",
           "MIN_SCALE", "scale_at"]

INIT_SCALE = 2.0 ** 16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000
"""torch.amp.GradScaler's defaults."""

MIN_SCALE = 2.0 ** -8
"""Below this (24 overflows in a row from the start) the run stops: the model overflows in
fp16 even with its gradients scaled down 256 times."""


@dataclass(frozen=True, slots=True)
class LossScale:
    """The scaler's state at a step boundary: the scale of the next step, and how many steps
    in a row have not overflowed (GradScaler's growth tracker)."""

    scale: float = INIT_SCALE
    growth_tracker: int = 0

    def after(self, overflowed: bool) -> LossScale:
        """The state after a step that `overflowed` (skipped) or not."""
        if overflowed:
            return LossScale(self.scale * BACKOFF_FACTOR, 0)
        if self.growth_tracker + 1 >= GROWTH_INTERVAL:
            return LossScale(self.scale * GROWTH_FACTOR, 0)
        return LossScale(self.scale, self.growth_tracker + 1)

    def clean(self, steps: int) -> LossScale:
        """The state after `steps` steps in a row without an overflow (as many `after(False)`,
        in one go)."""
        growths, tracker = divmod(self.growth_tracker + steps, GROWTH_INTERVAL)
        return LossScale(self.scale * GROWTH_FACTOR ** growths, tracker)

    @property
    def collapsed(self) -> bool:
        return self.scale < MIN_SCALE

    def to_json(self) -> list[float]:
        return [self.scale, self.growth_tracker]

    @classmethod
    def from_json(cls, value: Iterable[float] | None) -> LossScale:
        if value is None:
            return cls()
        scale, tracker = value
        return cls(float(scale), int(tracker))


def scale_at(step: int, skipped: Iterable[int], start: LossScale | None = None,
             start_step: int = 0) -> LossScale:
    """The state at the boundary before `step`, from `start` (the state at `start_step`:
    a resumed run's checkpoint) and the steps `skipped` since."""
    state, at = start or LossScale(), start_step
    for k in sorted({k for k in skipped if start_step <= k < step}):
        state = state.clean(k - at).after(True)
        at = k + 1
    return state.clean(max(0, step - at))
