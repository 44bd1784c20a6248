"""The user's stop: SIGINT or SIGTERM to the coordinator (Ctrl-C, `timeout`, `kill`).

It is not a preemption of the nodes: they are in a process group of their own (the fork
server's), so a terminal's or `timeout`'s signal reaches the coordinator alone, which says
so once, asks for a resume point at the next step boundary, and stops when it is published
(then `--resume auto` continues from it, redoing nothing), when checkpoints are off, when no
step is running yet, after `GRACE_S`, or at a second signal, whichever comes first. The stop
exits with 128 + the signal's number, as a shell reports a process ended by it. How to
continue is said in the words of the interface the run was started from (`--resume auto` on
the command line, `resume="auto"` in the Job from Python: `bamboo.run.interface`).
"""
from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from bamboo.control.state import Stop
from bamboo.run.interface import Interface

if TYPE_CHECKING:
    from bamboo.control.core import CoordinatorCore

__all__ = ["UserStop", "GRACE_S"]

GRACE_S = 20.0
"""The longest the coordinator waits for the resume point after the first signal: within a
container platform's usual grace (Kubernetes gives 30 s before its SIGKILL)."""


class UserStop:
    """Drives one run's stop after the user's signals; `check` raises Stop when it is time."""

    def __init__(self, interface: Interface = Interface.CLI) -> None:
        self.interface = interface
        """Whose words say how to continue the stopped run."""
        self.signals: list[int] = []
        self.started_at: float | None = None
        self.published_before = -1
        """The newest published checkpoint's step when the stop began."""

    def signal(self, signum: int) -> None:
        """From the signal handler: only recorded."""
        self.signals.append(signum)

    def check(self, core: CoordinatorCore, now: float) -> None:
        """Stop when it is time (see the module docstring); the first call after the first
        signal says what happens next, once."""
        if not self.signals:
            return
        name = signal.Signals(self.signals[0]).name
        code = 128 + self.signals[0]
        started = core.ctx.committed > 0 or core.gens.running()
        can_save = started and core.gens.interval.enabled
        if self.started_at is None:
            self.started_at = now
            self.published_before = core.checkpoints.last_step if started else -1
            if can_save:
                core.gens.ask_checkpoint()
                core.ctx.say(f"stopping on {name}: writing a resume point at the end of the step "
                             f"in progress, then stopping (a second {name} stops at once)")
        last = core.checkpoints.last_step if started else -1
        if can_save and last > self.published_before:
            raise Stop(f"stopped by {name} with {last} steps done; their resume point is "
                       f"{core.checkpoints.last}: {self.interface.rerun(core.ctx.run_path)} "
                       f"to continue", exit_code=code)
        if not can_save or len(self.signals) > 1 or now - self.started_at > GRACE_S:
            off = self.interface.option("checkpoint-every", 0)
            why = (f"checkpoints are off ({off})" if started and not can_save
                   else "before the first step" if not started
                   else f"a second {name}" if len(self.signals) > 1
                   else f"no resume point within {GRACE_S:g} s")
            newest = core.checkpoints.last if started else None
            how = ("add --resume auto" if self.interface is Interface.CLI
                   else self.interface.rerun(core.ctx.run_path))
            raise Stop(f"stopped by {name} ({why}); all workers stopped"
                       + (f"; the newest resume point is {newest}: {how} to continue"
                          if newest else ""), exit_code=code)
