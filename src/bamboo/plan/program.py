"""A node's program for one step, as data: the instructions it runs and the points a hook sees.

`node_instructions` is the list a node runs in a step's micro-batch phase: the schedule's
instructions for the stages it holds (`schedule.node_schedule`, with eager FRC of its
replica), merged with the share of each re-routed slot it serves
(`schedule.merge_pipelines`); micro-batches are named by their global ids. The engine runs
exactly this list, and tests build every node's list with it.

Past that list the step has its commit round; its points (`COMMIT_POINTS`) follow the
list, so point k of a step whose list has n instructions is instruction n + k. A held-out
pass between steps runs `EvalMicroBatch` instructions. An `InstructionHook` (a fault plan,
`bamboo.plan.faults`) is told, once per executed instruction, its step, its index and the
instruction itself.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from bamboo.plan import schedule as S
from bamboo.plan.roles import RoleMap

__all__ = ["CommitPoint", "COMMIT_POINTS", "MICRO_BATCHES_DONE", "REDUCED", "ROUND_DONE",
           "APPLIED", "EvalMicroBatch", "InstructionHook", "NoHook", "node_instructions"]


@dataclass(frozen=True, slots=True)
class CommitPoint:
    """A point of the step past its micro-batch instructions (the commit round's)."""

    name: str


MICRO_BATCHES_DONE = CommitPoint("micro-batches done")
"""Every instruction of the list ran; the node is about to vote that."""
REDUCED = CommitPoint("reduced")
"""The commit round's data-parallel sums (and the tied weights' sums) are done."""
ROUND_DONE = CommitPoint("round done")
"""The commit round is done; the node is about to vote its result."""
APPLIED = CommitPoint("applied")
"""The coordinator said commit and the optimizer step is applied."""
COMMIT_POINTS = (MICRO_BATCHES_DONE, REDUCED, ROUND_DONE, APPLIED)
"""In the order a step passes them: point k of a step is instruction len(list) + k."""


@dataclass(frozen=True, slots=True)
class EvalMicroBatch:
    """The held-out pass's work of this node on val micro-batch `index` (every stage it
    holds for that micro-batch's pipeline)."""

    index: int


class InstructionHook(Protocol):
    """What the engine tells of its progress, for a fault to fire at a precise point."""

    def begin(self, step: int, holds: Callable[[int, int], bool]) -> None:
        """A step (or the held-out pass before it) begins; `holds(pipeline, stage)` says
        whether this node holds that stage now."""

    def on_instruction(self, step: int, index: int, instruction: object) -> None:
        """The node executed `instruction`, number `index` of its program for `step`
        (an `EvalMicroBatch`'s index is its val micro-batch's)."""


class NoHook:
    """The hook of a node that nothing watches."""

    def begin(self, step: int, holds: Callable[[int, int], bool]) -> None:
        pass

    def on_instruction(self, step: int, index: int, instruction: object) -> None:
        pass


def node_instructions(roles: RoleMap, rank: int, held: Sequence[int],
                      blocks: Sequence[Sequence[int]], schedule: str = "1f1b", *,
                      frc_stage: int | None = None, pipeline: int | None = None,
                      order_of: Callable[[int], dict[S.Instruction, int]] | None = None
                      ) -> list[S.Instruction]:
    """The micro-batch instructions `rank` runs in a step, micro-batches named by global id
    (`blocks[d]`: pipeline d's): its own pipeline's work on the stages `held` (with eager
    FRC of `frc_stage`), and the share of each re-routed slot it serves. `pipeline` is the
    node's own (default: the roles'); `order_of(m)` is the `schedule`'s global order for m
    micro-batches (the engine caches them)."""
    if order_of is None:
        orders: dict[int, dict[S.Instruction, int]] = {}

        def order_of(m: int) -> dict[S.Instruction, int]:
            return orders.setdefault(m, S.global_order(roles.stages, m, schedule))

    if pipeline is None:
        pipeline = roles.pipeline_of(rank)
    assert pipeline is not None, f"rank {rank} belongs to no pipeline"
    m = len(blocks[pipeline])
    own = S.node_schedule(sorted(held), roles.stages, m, order=order_of(m), frc_stage=frc_stage)
    served = S.served_work(roles.served_by(rank), rank, blocks, order_of)
    return S.merge_pipelines([(pipeline, own), *served], blocks, order_of)
