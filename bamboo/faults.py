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


class FaultPlan:
    """The faults aimed at one worker, checked after every instruction."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = list(faults)
        self.steps = {f.step for f in self.faults}

    def check(self, step: int, index: int, is_forward: bool, seen_forward: bool) -> None:
        if step not in self.steps:
            return
        for f in self.faults:
            due = (index == f.after) if f.after is not None else (is_forward and not seen_forward)
            if f.step == step and due:
                self._fire(f)

    @staticmethod
    def _fire(f: Fault) -> None:
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedError(f"injected software error at step {f.step}")
