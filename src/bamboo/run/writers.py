"""Which node writes which layers to storage: a checkpoint's parts and the final model.

Every stage has exactly one writer: its first live holder (the lowest pipeline whose holder
of it is not dead in the role map). A worker writes the stages it is the writer of
(`bamboo.node.worker`); the coordinator's decision tests play the workers with the same
rule (`tests/coordinator_sim.py`), so both follow one definition.
"""
from __future__ import annotations

from collections.abc import Iterable

from bamboo.plan.roles import RoleMap

__all__ = ["first_live_holder", "stages_written_by"]


def first_live_holder(roles: RoleMap, stage: int) -> int:
    """The rank that writes stage `stage`'s layers: its first holder not dead."""
    dead = set(roles.dead)
    return next(r for r in roles.stage_members(stage) if r not in dead)


def stages_written_by(roles: RoleMap, rank: int, stages: Iterable[int]) -> list[int]:
    """Of `stages` (those `rank` holds), the ones `rank` writes, in stage order."""
    return [s for s in sorted(stages) if first_live_holder(roles, s) == rank]
