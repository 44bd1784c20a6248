"""What the engine's parts are given instead of the engine: the node's fixed facts for a
generation (`NodeContext`) and what it holds under a role map (`Held`).

The transport, failover and the held-out pass read these and the arguments they are
called with; they never read or assign the engine's attributes. A failover returns a new
`Held`, which the engine installs.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bamboo.engine.comm import GroupFormer
from bamboo.engine.stage import StageState
from bamboo.plan.roles import RoleMap
from bamboo.protocol.votes import Votes

__all__ = ["NodeContext", "Held"]


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeContext:
    """One node's facts for a generation: the same whatever the role maps that follow."""

    rank: int
    pipeline: int
    """The node's own pipeline."""
    P: int
    """Stages per pipeline."""
    parts: Sequence[range]
    """Each stage's layers."""
    specs: Sequence[Any]
    """The boundary tensors' shapes and dtypes by layer (`model.boundary_shapes`)."""
    device: torch.device
    global_mbs: Sequence[int]
    """The global ids of the node's own pipeline's micro-batches."""
    link: Votes
    former: GroupFormer | None
    """Forms a new process group among given ranks (after a loss)."""

    @property
    def M(self) -> int:
        """Micro-batches of the node's own pipeline."""
        return len(self.global_mbs)

    def interrupted(self, roles: RoleMap) -> Callable[[], bool]:
        """True, when called, once the coordinator published roles newer than `roles`."""
        return lambda: self.link.latest_epoch > roles.epoch

    def abandoned(self, roles: RoleMap) -> bool:
        """The coordinator published roles after `roles` that abandon the generation: the
        step under way is dropped whatever this node does, so its remaining work is not
        worth computing (read from the store only once newer roles are known)."""
        return self.link.latest_epoch > roles.epoch and any(
            m.abandon for m in self.link.next_epochs(roles.epoch, wait=False))

    def boundary_spec(self, stage: int, input_side: bool) -> Any:
        """The spec of the tensor entering (`input_side`) or leaving `stage`."""
        part = self.parts[stage]
        return self.specs[part.start - 1 if input_side else part.stop - 1]


@dataclass(frozen=True, slots=True)
class Held:
    """What a node holds under `roles`: its primary stages, and its replica if it keeps one."""

    roles: RoleMap
    stages: dict[int, StageState]
    replica: StageState | None
