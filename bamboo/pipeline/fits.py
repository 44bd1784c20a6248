"""Whether a job can fit before any worker starts: a lower bound of each node's memory.

Counted only what a node certainly holds, so a job that fits is never refused:

- its largest stage's parameters with their gradients and AdamW's two moments (16 bytes a
  parameter in fp32), and with redundancy its replica of the next stage (the same again);
- the activations 1F1B keeps in flight at stage 0: min(M, P) micro-batches, each at least
  the boundary tensor of every layer of the stage;
- the step's instruction list (four instructions a micro-batch, a Python object each).

`bamboo train` refuses a job whose local workers together need more than this machine's
memory (one line with both figures), instead of letting a worker die of MemoryError in its
first step.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from bamboo.config import ConfigError, JobConfig

__all__ = ["NodeMemory", "node_memory_lower_bound", "machine_memory_bytes", "check_fits"]

_BYTES_PER_INSTRUCTION = 56
"""The smallest a slotted dataclass instance with a few fields takes in CPython."""


@dataclass(frozen=True, slots=True)
class NodeMemory:
    state_bytes: int
    activation_bytes: int
    schedule_bytes: int

    @property
    def total(self) -> int:
        return self.state_bytes + self.activation_bytes + self.schedule_bytes


def node_memory_lower_bound(cfg: JobConfig) -> NodeMemory:
    from bamboo.models import boundary_shapes, layer_param_counts
    from bamboo.pipeline.partition import partition
    p = cfg.model_preset()
    counts = layer_param_counts(p)
    stages, micro_batches = cfg.layout.stages, cfg.layout.micro_batches
    parts = partition(cfg.partition_costs(counts), stages)
    per_stage = [sum(counts[i] for i in part) for part in parts]
    replica = cfg.redundancy.mode != "off" and stages > 1
    state = max(per_stage[s] + (per_stage[(s + 1) % stages] if replica else 0)
                for s in range(stages)) * 16
    boundaries = boundary_shapes(p, cfg.layout.micro_batch_size)
    stage_0 = sum(math.prod(boundaries[i].shape) * boundaries[i].dtype.itemsize
                  for i in parts[0])
    activations = min(micro_batches, stages) * stage_0
    schedule = (4 * micro_batches + 8) * _BYTES_PER_INSTRUCTION
    return NodeMemory(state, activations, schedule)


def machine_memory_bytes() -> int | None:
    """MemTotal of /proc/meminfo (None where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n < 2**40 else f"{n / 2**40:.1f} TiB"


def check_fits(cfg: JobConfig, local_workers: int) -> None:
    """ConfigError (one line) when `local_workers` nodes of this job cannot fit in this
    machine's memory, by the lower bound above."""
    machine = machine_memory_bytes()
    if machine is None or local_workers < 1:
        return
    need = node_memory_lower_bound(cfg)
    if need.total * local_workers <= machine:
        return
    biggest = max((("parameters and optimizer state", need.state_bytes),
                   ("activations in flight", need.activation_bytes),
                   ("the step's schedule", need.schedule_bytes)), key=lambda kv: kv[1])
    raise ConfigError(
        f"this job needs at least {_gib(need.total)} a node ({biggest[0]}: "
        f"{_gib(biggest[1])}), {_gib(need.total * local_workers)} for {local_workers} local "
        f"workers, and this machine has {_gib(machine)}: lower --micro-batch-size (now "
        f"{cfg.layout.micro_batch_size}), --micro-batches (now {cfg.layout.micro_batches}) or "
        f"--nodes, or take a smaller --model")
