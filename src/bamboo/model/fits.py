"""Whether a job can fit before any worker starts: a lower bound of each node's memory.

Counted only what a node certainly holds, so a job that fits is never refused:

- its largest stage's parameters with their gradients and AdamW's two moments (16 bytes a
  parameter in fp32), and where the redundancy mode keeps one (eager, lazy, auto) its
  replica of the next stage (the same again);
- the activations 1F1B keeps in flight at stage 0: min(M, P) micro-batches, each at least
  the boundary tensor of every layer of the stage;
- the step's instruction list (four instructions a micro-batch, a Python object each).

`bamboo train` refuses a job whose local workers together need more than this machine's
memory (one line with both figures), instead of letting a worker die of MemoryError in its
first step.

Likewise for time: a step longer than the coordinator waits for news of it would only end in
a stall after minutes. The lower bound of a step is its micro-batches through the largest
stage at a rate no node of the device reaches (`OPTIMISTIC_FLOPS`), counting only the
forward's multiply-adds of each parameter once a position (2 x parameters x positions a
sample), so a job that could finish its steps is never refused.
"""
from __future__ import annotations

import math
import os

from bamboo.config import ConfigError, JobConfig
from bamboo.config.presets import CustomSizing
from bamboo.plan.layout_choice import NodeNeed

__all__ = ["node_memory_lower_bound", "machine_memory_bytes", "check_fits",
           "step_seconds_lower_bound", "check_step_length", "OPTIMISTIC_FLOPS"]

OPTIMISTIC_FLOPS = {"cpu": 1e12, "cuda": 1e15}
"""FLOP/s above what one node of each kind computes (a server CPU's cores together reach
a few 1e11 in fp32; one GPU a few 1e14 in bf16)."""

_BYTES_PER_INSTRUCTION = 56
"""The smallest a slotted dataclass instance with a few fields takes in CPython."""


def node_memory_lower_bound(cfg: JobConfig, sizing: CustomSizing | None = None) -> NodeNeed:
    from bamboo.model import boundary_shapes, layer_param_counts
    from bamboo.plan.partition import partition
    p = cfg.model_preset(sizing)
    counts = layer_param_counts(p)
    stages, micro_batches = cfg.layout.stages, cfg.layout.micro_batches
    parts = partition(cfg.partition_costs(counts), stages)
    per_stage = [sum(counts[i] for i in part) for part in parts]
    replica = cfg.redundancy.kind.may_keep_replica and stages > 1
    state = max(per_stage[s] + (per_stage[(s + 1) % stages] if replica else 0)
                for s in range(stages)) * 16
    boundaries = boundary_shapes(p, cfg.layout.micro_batch_size)
    stage_0 = sum(math.prod(boundaries[i].shape) * boundaries[i].dtype.itemsize
                  for i in parts[0])
    activations = min(micro_batches, stages) * stage_0
    schedule = (4 * micro_batches + 8) * _BYTES_PER_INSTRUCTION
    return NodeNeed(state, activations, schedule)


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


def check_fits(cfg: JobConfig, local_workers: int, sizing: CustomSizing | None = None) -> None:
    """ConfigError (one line) when `local_workers` nodes of this job cannot fit in this
    machine's memory, by the lower bound above (your own model sized by `sizing`)."""
    machine = machine_memory_bytes()
    if machine is None or local_workers < 1:
        return
    need = node_memory_lower_bound(cfg, sizing)
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


def _positions(p) -> int:
    """Positions a sample's parameters are applied at: its tokens, or 1 (images: a lower
    bound, a convolution applies its weights at every pixel)."""
    return 1 if p.family == "cnn" else max(1, p.context)


def step_seconds_lower_bound(cfg: JobConfig, device: str,
                             sizing: CustomSizing | None = None) -> float:
    """Seconds one step takes at the least on `device` ("cpu" or "cuda"): the pipeline's
    micro-batches, one after another, through its largest stage."""
    from bamboo.model import layer_param_counts
    from bamboo.plan.partition import partition
    p = cfg.model_preset(sizing)
    counts = layer_param_counts(p)
    parts = partition(cfg.partition_costs(counts), cfg.layout.stages)
    largest = max(sum(counts[i] for i in part) for part in parts)
    flops = 2.0 * largest * _positions(p) * cfg.layout.micro_batch_size
    return cfg.layout.micro_batches * flops / OPTIMISTIC_FLOPS[device]


def check_step_length(cfg: JobConfig, *, nodes_here: bool = True,
                      sizing: CustomSizing | None = None) -> None:
    """ConfigError (one line) when even the lower bound of one step is longer than the run
    waits for a step (`--comm-timeout` plus a grace): such a run could only stall. With
    `nodes_here` false (the nodes run on other machines), `--device auto` counts as a GPU."""
    device = "cpu" if cfg.runtime.device == "cpu" else "cuda"
    if nodes_here and device == "cuda":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    least, limit = step_seconds_lower_bound(cfg, device, sizing), cfg.runtime.step_stall_s
    if least <= limit:
        return
    m, b = cfg.layout.micro_batches, cfg.layout.micro_batch_size
    raise ConfigError(
        f"--micro-batches {m}: one step would take at least {least:.0f} s on {device} ({m} "
        f"micro-batches of {b} samples through the largest stage), longer than the "
        f"{limit:.0f} s the run waits for a step (--comm-timeout {cfg.runtime.comm_timeout_s:g} "
        f"+ 30 s): lower --micro-batches, or raise --comm-timeout", "micro_batches")
