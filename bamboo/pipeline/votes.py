"""What the engine asks of whoever decides a step's fate: the votes of the commit protocol.

A step ends in two votes. After its micro-batches a node votes that it is ready and waits
for `Go.GO` (or `Go.ABORT`: the roles changed, redo the step's remaining work); after the
commit round it votes whether the round succeeded and waits for a `Verdict`: `COMMIT`
(apply the update, possibly with boundary flags: write a checkpoint, end the generation)
or `REDO`. Role maps arrive as epochs. The engine depends only on this interface; the
cluster's `CoordinatorLink` implements it over the coordinator's store.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from bamboo.redundancy.roles import RoleMap

__all__ = ["Go", "Decision", "BoundaryFlag", "Verdict", "Votes"]


class Go(enum.Enum):
    """The answer to "my micro-batches are done"."""

    GO = "go"
    ABORT = "abort"


class Decision(enum.Enum):
    """The answer to "my commit round is done"."""

    COMMIT = "commit"
    REDO = "redo"


class BoundaryFlag(enum.Enum):
    """What happens at the boundary after a committed step."""

    CHECKPOINT = "ckpt"
    """Every stage's first live holder sends its layers for a durable checkpoint."""
    RECONFIGURE = "reconf"
    """The generation ends here; the next plan follows."""


@dataclass(frozen=True, slots=True)
class Verdict:
    decision: Decision
    flags: frozenset[BoundaryFlag] = frozenset()

    def encode(self) -> str:
        """The store's text form: `commit`, `commit+ckpt+reconf`, `redo`."""
        names = sorted(f.value for f in self.flags)
        return "+".join([self.decision.value] + names)

    @classmethod
    def decode(cls, text: str) -> Verdict:
        decision, *flags = text.split("+")
        return cls(Decision(decision), frozenset(BoundaryFlag(f) for f in flags))


class Votes(Protocol):
    """The engine's side of the step protocol."""

    latest_epoch: int
    """The newest role-map epoch known (kept current by a background watcher)."""
    on_epoch: Callable[[], None]
    """Called (from the watcher's thread) whenever a newer epoch appears."""

    def phase_a_done(self, step: int, epoch: int) -> Go: ...

    def round_done(self, step: int, epoch: int, ok: bool,
                   losses: list[tuple[int, float, float]]) -> Verdict: ...

    def next_epochs(self, current: int, wait: bool) -> list[RoleMap]: ...
