"""The fault injector that tests, the demo and soaks all use.

A fault fires inside a worker at a precise point of the schedule: after the
worker has executed instruction `after` of step `step` (by default after its first
forward of that step). `kill` sends the process SIGKILL, a real signal with no
cleanup, as a preempted instance would see; `raise` raises an ordinary Python
exception, a software error.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Fault", "InjectedError", "FaultPlan"]


class InjectedError(RuntimeError):
    """The software error that a `raise` fault throws."""


@dataclass(frozen=True, slots=True)
class Fault:
    """What to do, where: `kind` is `kill` or `raise`."""

    kind: str
    step: int
    after: int | None = None
    """Instruction index within the step; None: after the first forward."""
    pipeline: int | None = None
    stage: int | None = None
    """When set, the fault fires only on the node holding this stage of this pipeline
    when the step begins (a `--kill D:S@K`, whoever holds the stage by then)."""


class FaultPlan:
    """The faults aimed at one worker, checked after every instruction."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = list(faults)
        self.steps = {f.step for f in self.faults}
        self.holds: Callable[[int, int], bool] = lambda pipeline, stage: False
        self._aimed: dict[tuple[int, Fault], bool] = {}

    def forget(self, fired: list[str]) -> None:
        """A new generation: drop the kills already carried out (`D:S@K` strings, a redone
        step must not preempt the stage's new holder again) and decide the rest anew."""
        self.faults = [f for f in self.faults if f.pipeline is None
                       or f"{f.pipeline}:{f.stage}@{f.step}" not in fired]
        self.steps = {f.step for f in self.faults}
        self._aimed.clear()

    def aim(self, step: int) -> None:
        """Decide, as `step` begins, which of its stage-aimed faults are this node's (a role
        change later in the step, a re-route say, does not re-aim them)."""
        for f in self.faults:
            if f.step == step:
                self._aimed_here(step, f)

    def _aimed_here(self, step: int, f: Fault) -> bool:
        if f.pipeline is None or f.stage is None:
            return True
        key = (step, f)
        if key not in self._aimed:  # decided once, at the step's first check
            self._aimed[key] = self.holds(f.pipeline, f.stage)
        return self._aimed[key]

    def check(self, step: int, index: int, is_forward: bool, seen_forward: bool) -> None:
        if step not in self.steps:
            return
        for f in self.faults:
            if f.step != step or not self._aimed_here(step, f):
                continue
            due = (index == f.after) if f.after is not None else (is_forward and not seen_forward)
            if due:
                self._fire(f)

    @staticmethod
    def _fire(f: Fault) -> None:
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedError(f"injected software error at step {f.step}")
