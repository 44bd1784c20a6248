"""What a node's engine is given: the job's options (what the job's configuration says
about how a node trains, in one frozen section built in one place,
`EngineOptions.from_config`), what it runs in a generation (`Assignment`), where it runs
(`Placement`) and who hears of its progress (`Observers`)."""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from bamboo.config import JobConfig
from bamboo.config.modes import RedundancyMode
from bamboo.data.datasets import Task
from bamboo.engine.comm import GroupFormer
from bamboo.plan.layout import Layout
from bamboo.plan.program import InstructionHook
from bamboo.plan.roles import RoleMap
from bamboo.protocol.votes import Votes

__all__ = ["EngineOptions", "Assignment", "Placement", "Observers", "ProcessMemory"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Assignment:
    """What one node runs in one generation: its `rank`, the `layout`, each stage's layers
    (`parts`), the generation's first role map (`roles`) and its `redundancy` mode."""

    rank: int
    layout: Layout
    parts: Sequence[range]
    roles: RoleMap
    redundancy: RedundancyMode


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where it runs: the data `task`, the `device`, the coordinator `link`, the
    generation's process `group` and the `former` of the groups after a loss."""

    task: Task
    device: torch.device
    link: Votes
    group: Any
    former: GroupFormer | None = None


class ProcessMemory(Protocol):
    """The process's memory at one moment (`bamboo.node.procmem.MemorySample`)."""

    @property
    def rss(self) -> int: ...

    @property
    def rss_peak(self) -> int: ...

    @property
    def cuda_peak(self) -> int: ...

    @property
    def cuda_reserved(self) -> int: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Observers:
    """Who hears of the engine's progress: `hook` of every instruction executed (a fault
    plan), `progress(step, phase)` of each phase begun, and `memory()` samples the
    process's memory once each step's buffers are dropped (for its report)."""

    hook: InstructionHook | None = None
    progress: Callable[[int, int], None] | None = None
    memory: Callable[[], ProcessMemory] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineOptions:
    """Every job-wide setting the engine reads; the same on every node of a run."""

    lr: float
    """Peak learning rate (`optim.learning_rate`)."""
    warmup_steps: int
    total_steps: int
    """The run's length: the learning rate's schedule ends there."""
    weight_decay: float
    grad_clip: float
    """The global gradient norm is clipped to this."""
    seed: int
    """Every stage's initial parameters are a function of it."""
    schedule: str = "1f1b"
    """1f1b | zb-h1 (`bamboo.plan.schedule.SCHEDULES`)."""
    comm: str = "strict"
    """strict | tagged: the transport (`bamboo.engine.transport`)."""
    precision: str = "fp32"
    """fp32 | bf16 (autocast forwards; parameters and optimizer state stay fp32)."""
    exact: bool = False
    """Gradient sums in float64, data-parallel sums in pipeline order: bits independent of
    the layout."""
    activation_checkpointing: bool = False
    check_replicas: bool = False
    """Report every replica's and primary's digest after every step."""
    frc_offload: bool = False
    """Eager FRC keeps what it saves, and the replica its optimizer state, in host memory."""
    frc_at: str = "waits"
    """waits | slot: where eager FRC runs."""
    replica_step_later: bool = True
    """A replica kept in host memory takes its optimizer step on a thread of its own,
    overlapping the node's next work (`StageState.apply_later`); False (the environment's
    `BAMBOO_REPLICA_STEP=inline`, for side-by-side measurements): inside the step."""
    replica_step_yields: bool = True
    """That thread runs at a low priority (nice 10) where the node has a processor of its own
    (`replica_steps.yield_to_the_step`); False (`BAMBOO_REPLICA_STEP=thread`, or inline):
    at the normal one."""
    bucket_mb: float = 25.0
    """The data-parallel sums' buckets, begun during the backward (`buckets.py`); 0: one
    bucket a stage, launched at the commit round."""
    optimizer: str | None = None
    """The job's own optimizer, `MODULE:NAME(ARGS)` (`optim.make_optimizer`); None: AdamW."""
    lr_schedule: str | None = None
    """The job's own learning-rate schedule (`optim.step_lr`); None: warm-up, cosine decay."""

    @property
    def bucket_bytes(self) -> int:
        """`bucket_mb` in bytes (a positive size is at least one byte)."""
        return math.ceil(self.bucket_mb * 2**20)

    def lr_at(self, step: int) -> float:
        """The learning rate of `step` (`optim.step_lr`)."""
        from bamboo.engine.optim import step_lr
        return step_lr(step, lr=self.lr, warmup=self.warmup_steps, total=self.total_steps,
                       optimizer=self.optimizer, schedule=self.lr_schedule)

    @classmethod
    def from_config(cls, cfg: JobConfig) -> EngineOptions:
        """The engine's options of the job `cfg`."""
        t = cfg.training
        return cls(lr=t.lr, warmup_steps=t.warmup_steps, total_steps=t.steps,
                   weight_decay=t.weight_decay, grad_clip=t.grad_clip, seed=t.seed,
                   schedule=cfg.layout.schedule, comm=cfg.runtime.comm,
                   bucket_mb=cfg.runtime.bucket_mb,
                   precision=cfg.model.precision, exact=t.exact,
                   activation_checkpointing=cfg.model.activation_checkpointing,
                   check_replicas=cfg.redundancy.check_replicas,
                   frc_offload=cfg.redundancy.frc_offload, frc_at=cfg.redundancy.frc_at,
                   optimizer=t.optimizer, lr_schedule=t.lr_schedule,
                   replica_step_later=os.environ.get("BAMBOO_REPLICA_STEP") != "inline",
                   replica_step_yields=os.environ.get("BAMBOO_REPLICA_STEP") not in
                   ("inline", "thread"))
