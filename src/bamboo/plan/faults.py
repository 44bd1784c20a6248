"""The fault injector that tests, the demo and soaks all use.

A fault fires inside a worker at a precise point of its program
(`bamboo.plan.program`): after the worker has executed instruction `after` of step
`step` (by default after its first forward of that step; `EVAL_FAULT_INDEX`: after each
of its val micro-batches in the held-out pass after `step` steps). A `FaultPlan` is the
engine's instruction hook. `kill` sends the process SIGKILL, a real signal with no
cleanup, as a preempted instance would see; `raise` raises an ordinary Python
exception, a software error.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from bamboo.plan.program import EvalMicroBatch
from bamboo.plan.schedule import Forward

__all__ = ["Fault", "InjectedError", "FaultPlan", "EVAL_FAULT_INDEX"]

EVAL_FAULT_INDEX = -1
"""A fault's instruction index that means: in the held-out pass after `step` steps, after
each of this node's val micro-batches."""


class InjectedError(RuntimeError):
    """The software error that a `raise` fault throws."""


@dataclass(frozen=True, slots=True)
class Fault:
    """What to do, where: `kind` is `kill` or `raise`."""

    kind: str
    step: int
    after: int | None = None
    """Instruction index within the step's program; None: after the first forward;
    `EVAL_FAULT_INDEX`: after each val micro-batch of the held-out pass."""
    pipeline: int | None = None
    stage: int | None = None
    """When set, the fault fires only on the node holding this stage of this pipeline
    when the step begins (a `--kill D:S@K`, whoever holds the stage by then)."""


def _holds_nothing(pipeline: int, stage: int) -> bool:
    return False


class FaultPlan:
    """The faults aimed at one worker: the engine's instruction hook
    (`bamboo.plan.program.InstructionHook`), checked after every instruction."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = list(faults)
        self.steps = {f.step for f in self.faults}
        self.holds: Callable[[int, int], bool] = _holds_nothing
        self._aimed: dict[tuple[int, Fault], bool] = {}
        self._seen_forward = False
        """Whether the step under way ran a forward yet (the default point is the first)."""

    def detach(self) -> None:
        """The generation's engine is done: its `holds` is let go (the next engine gives
        its own at its first step), so nothing here keeps that engine alive."""
        self.holds = _holds_nothing

    def forget(self, fired: list[str]) -> None:
        """A new generation: drop the kills already carried out (`D:S@K` strings, a redone
        step must not preempt the stage's new holder again) and decide the rest anew."""
        self.faults = [f for f in self.faults if f.pipeline is None
                       or f"{f.pipeline}:{f.stage}@{f.step}" not in fired]
        self.steps = {f.step for f in self.faults}
        self._aimed.clear()

    def begin(self, step: int, holds: Callable[[int, int], bool]) -> None:
        """`step` begins (or the held-out pass before it), `holds(pipeline, stage)` saying
        what this node holds: decide which of the step's stage-aimed faults are this node's
        (once: a role change later in the step, a re-route say, does not re-aim them)."""
        self.holds = holds
        self._seen_forward = False
        for f in self.faults:
            if f.step == step:
                self._aimed_here(step, f)

    def _aimed_here(self, step: int, f: Fault) -> bool:
        if f.pipeline is None or f.stage is None:
            return True
        key = (step, f)
        if key not in self._aimed:  # decided once, as the step begins
            self._aimed[key] = self.holds(f.pipeline, f.stage)
        return self._aimed[key]

    def on_instruction(self, step: int, index: int, instruction: object) -> None:
        """Fire every fault due after `instruction`, number `index` of `step`'s program."""
        is_forward = isinstance(instruction, Forward)
        first_forward = is_forward and not self._seen_forward
        self._seen_forward |= is_forward
        if step not in self.steps:
            return
        for f in self.faults:
            if f.step != step or not self._aimed_here(step, f):
                continue
            if isinstance(instruction, EvalMicroBatch):
                due = f.after == EVAL_FAULT_INDEX
            else:
                due = index == f.after if f.after is not None else first_forward
            if due:
                self._fire(f)

    @staticmethod
    def _fire(f: Fault) -> None:
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedError(f"injected software error at step {f.step}")
