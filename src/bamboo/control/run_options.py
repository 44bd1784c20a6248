"""How a run is driven, beside its job: what its caller adds to the `JobConfig`.

One frozen object for `run_job`, `Coordinator` and `CoordinatorCore`, so each takes the job,
its run directory, its display, its launcher and these, and a new option is one field here.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from bamboo.plan.faults import Fault
from bamboo.run.checkpoint import Checkpoint
from bamboo.run.interface import Interface

__all__ = ["RunOptions"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    """What the caller of a run decides that the job does not say."""

    extra_faults: Mapping[int, list[Fault]] = field(default_factory=dict)
    """Faults injected into nodes by id (`--crash`), beside the job's own kills."""
    resume: Checkpoint | None = None
    """The checkpoint the run continues from."""
    debug: bool = False
    """Tracebacks of the workers' errors shown (`--debug`)."""
    stepwise: bool = False
    """The user's loop drives the run step by step (`bamboo.Trainer`)."""
    interface: Interface = Interface.CLI
    """Where the run was started from: its messages say what to do in those words."""
    http: tuple[str, int] | None = None
    """`--http`: where to serve /healthz and /metrics."""
