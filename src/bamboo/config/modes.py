"""The redundancy mode as a type: what `--redundancy` (`redundancy=`) names, decoded once
where a job's options are made, with the questions the code asks of it. It crosses process
boundaries inside a generation's plan; `bamboo.protocol` exports it with the other types
that do."""
from __future__ import annotations

import enum

__all__ = ["RedundancyMode"]


class RedundancyMode(enum.StrEnum):
    """How a lost node's work goes on (docs/redundancy.md). A `str`: it compares, formats
    and serializes as the flag's word."""

    EAGER = "eager"
    """A replica of the successor's stage, and its forward run in every step (FRC)."""
    LAZY = "lazy"
    """A replica of the successor's stage, its forward run only after a loss."""
    REROUTE = "reroute"
    """No replica: a lost stage's micro-batches go to its data-parallel peers."""
    OFF = "off"
    """No replica: a loss that no standby covers restores the newest checkpoint."""
    AUTO = "auto"
    """Chosen at every generation from the measured step times and loss rate."""

    @property
    def keeps_replica(self) -> bool:
        """Whether each node holds its successor's stage (shadows a loss)."""
        return self in (RedundancyMode.EAGER, RedundancyMode.LAZY)

    @property
    def may_keep_replica(self) -> bool:
        """Whether memory must be planned for the successor's replica: where the mode keeps
        one, and under `auto`, which may choose eager or lazy at any generation."""
        return self.keeps_replica or self.chosen_per_generation

    @property
    def keeps_replica_on_host(self) -> bool:
        """Whether the replica lives in host memory (it runs no forward: lazy), not on the
        device (eager runs its forwards there; `auto` may choose eager)."""
        return self is RedundancyMode.LAZY

    @property
    def runs_frc(self) -> bool:
        """Whether the replica's forward runs in every step, before any loss."""
        return self is RedundancyMode.EAGER

    @property
    def reroutes(self) -> bool:
        """Whether a loss is served by the lost stage's data-parallel peers."""
        return self is RedundancyMode.REROUTE

    @property
    def chosen_per_generation(self) -> bool:
        """Whether the coordinator picks the mode itself (`auto`)."""
        return self is RedundancyMode.AUTO
