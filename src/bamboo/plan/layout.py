"""Who does what: nodes to (pipeline, stage), micro-batches to pipelines.

Rank r of the first generation plays node `n{r}`; ranks 0..D*P-1 hold stage
r % P of pipeline r // P, the rest are standbys. The global batch is G global
micro-batches; pipeline d trains on the contiguous block of them that
`micro_batch_blocks` gives it (uneven when G is not a multiple of D), and each
micro-batch's loss is weighted by its share of the global batch so the gradient
is the same whatever the split.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Role", "Layout", "micro_batch_blocks"]


@dataclass(frozen=True, slots=True)
class Role:
    """A node's job: stage `stage` of pipeline `pipeline`, or a standby (stage None)."""

    pipeline: int | None
    stage: int | None

    @property
    def standby(self) -> bool:
        return self.stage is None


def micro_batch_blocks(global_micro_batches: int, pipelines: int) -> list[list[int]]:
    """Global micro-batch ids per pipeline, as even as possible, in order."""
    base, extra = divmod(global_micro_batches, pipelines)
    blocks, start = [], 0
    for d in range(pipelines):
        size = base + (1 if d < extra else 0)
        blocks.append(list(range(start, start + size)))
        start += size
    return blocks


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """D pipelines of P stages over `nodes` ranks, training G micro-batches a step."""

    nodes: int
    pipelines: int
    stages: int
    global_micro_batches: int

    def __post_init__(self) -> None:
        if self.pipelines * self.stages > self.nodes:
            raise ValueError(f"{self.pipelines} x {self.stages} layout needs more than "
                             f"{self.nodes} nodes")
        if self.global_micro_batches < self.pipelines:
            raise ValueError("every pipeline needs at least one micro-batch")

    def role(self, rank: int) -> Role:
        if rank >= self.pipelines * self.stages:
            return Role(None, None)
        return Role(rank // self.stages, rank % self.stages)

    def rank(self, pipeline: int, stage: int) -> int:
        return pipeline * self.stages + stage

    def micro_batches(self, pipeline: int) -> list[int]:
        return micro_batch_blocks(self.global_micro_batches, self.pipelines)[pipeline]
