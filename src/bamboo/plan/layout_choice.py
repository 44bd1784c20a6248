"""`--stages auto`: the layout chosen for the job (P stages, D pipelines, M micro-batches).

The user fixes the global batch in samples (S, the unit every later layout keeps) and the
nodes; this planner picks the smallest P whose stage fits a node's memory, by the same lower
bound `bamboo.model.fits` refuses jobs with (a stage's parameters, gradients and AdamW
moments at 16 bytes a parameter, with its replica of the next stage where the redundancy
mode keeps one; 1F1B's activations in flight at stage 0; the step's schedule), so P=1 when
the model fits one node. Then D = as many whole pipelines as the nodes allow and the global
batch divides into, and M = S / (D x B). Stages are cut by the layer costs given
(`bamboo profile --layers-only` seconds, else parameter counts), as for a fixed --stages.

Pure: the model comes in as per-layer numbers (`Footprint`); no torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bamboo.config import ConfigError
from bamboo.plan.partition import partition

__all__ = ["Footprint", "NodeNeed", "LayoutChoice", "node_need", "choose_layout",
           "BYTES_PER_PARAMETER", "BYTES_PER_INSTRUCTION"]

BYTES_PER_PARAMETER = 16
"""fp32 parameter, gradient and AdamW's two moments."""

BYTES_PER_INSTRUCTION = 56
"""The smallest a slotted dataclass instance with a few fields takes in CPython."""


@dataclass(frozen=True, slots=True)
class Footprint:
    """What the planner knows of the model, layer by layer."""

    name: str
    layer_params: tuple[int, ...]
    layer_costs: tuple[float, ...]
    """What stages are cut by: measured seconds, or parameter counts."""
    boundary_bytes: tuple[int, ...]
    """Each layer's output for one micro-batch of the job's B samples, in bytes."""


@dataclass(frozen=True, slots=True)
class NodeNeed:
    """The lower bound of one node's memory at a layout."""

    state_bytes: int
    activation_bytes: int
    schedule_bytes: int
    host_bytes: int = 0
    """The replica's state where it lives in host memory (not in `total`)."""

    @property
    def total(self) -> int:
        """Device bytes."""
        return self.state_bytes + self.activation_bytes + self.schedule_bytes


def node_need(model: Footprint, stages: int, micro_batches: int, replica: bool,
              replica_on_host: bool = False) -> NodeNeed:
    """What the fullest node certainly holds with `stages` stages and M micro-batches (its
    replica in host memory with `replica_on_host`)."""
    parts = partition(model.layer_costs, stages)
    per_stage = [sum(model.layer_params[i] for i in part) for part in parts]
    with_replica = replica and stages > 1
    on_device = with_replica and not replica_on_host
    state = max(per_stage[s] + (per_stage[(s + 1) % stages] if on_device else 0)
                for s in range(stages)) * BYTES_PER_PARAMETER
    host = max(per_stage[(s + 1) % stages] for s in range(stages)) * BYTES_PER_PARAMETER \
        if with_replica and replica_on_host else 0
    stage_0 = sum(model.boundary_bytes[i] for i in parts[0])
    schedule = (4 * micro_batches + 8) * BYTES_PER_INSTRUCTION
    return NodeNeed(state, min(micro_batches, stages) * stage_0, schedule, host)


@dataclass(frozen=True, slots=True)
class LayoutChoice:
    """The chosen layout and the one line saying why."""

    stages: int
    pipelines: int
    micro_batches: int
    need: NodeNeed
    why: str


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.1f} GiB"


def _pipelines(micro_batches: int, most: int, least: int) -> int | None:
    """The most pipelines, from `least` to `most`, that the global micro-batches divide into."""
    return next((d for d in range(most, least - 1, -1) if micro_batches % d == 0), None)


def choose_layout(model: Footprint, *, nodes: int, memory_per_node: int, global_batch: int,
                  micro_batch_size: int, replica: bool, least_pipelines: int = 1,
                  memory_source: str | None = None,
                  host_memory_per_node: int | None = None) -> LayoutChoice:
    """The smallest P whose fullest node fits `memory_per_node`, with D and M for a global
    batch of `global_batch` samples; ConfigError (one line) when none does. With
    `host_memory_per_node` the replica lives in host memory and must fit that instead.
    `least_pipelines`: 2 where the mode needs a data-parallel peer (reroute); `memory_source`:
    how the line names the memory (default "a node's N MiB")."""
    b, source = micro_batch_size, memory_source or f"a node's {_mib(memory_per_node)}"
    if global_batch % b:
        low = global_batch // b * b
        near = f"{low} or {low + b}" if low else f"{b}"
        raise ConfigError(f"--global-batch-size {global_batch} is not a multiple of "
                          f"--micro-batch-size {b}: use {near}", "global_batch_size")
    total, tried = global_batch // b, list[tuple[int, NodeNeed]]()
    for p in range(1, min(len(model.layer_params), nodes) + 1):
        d = _pipelines(total, nodes // p, least_pipelines)
        if d is None:
            continue
        need = node_need(model, p, total // d, replica, host_memory_per_node is not None)
        if need.total <= memory_per_node and \
                (host_memory_per_node is None or need.host_bytes <= host_memory_per_node):
            return LayoutChoice(p, d, total // d, need,
                                _why(model, p, d, need, replica, source, tried))
        tried.append((p, need))
    fit_device = [(p, n) for p, n in tried if n.total <= memory_per_node]
    if host_memory_per_node is not None and fit_device:
        p, need = min(fit_device, key=lambda t: t[1].host_bytes)
        raise ConfigError(f"--stages auto: no layout of {model.name} fits a node's "
                          f"--host-memory-per-node {_mib(host_memory_per_node)} on {nodes} "
                          f"nodes: its replica needs at least {_mib(need.host_bytes)} (P={p}); "
                          f"give more --host-memory-per-node or --nodes", "host_memory_per_node")
    raise ConfigError(_none_fits(model, nodes, source, tried, total, least_pipelines), "stages")


def _why(model: Footprint, p: int, d: int, need: NodeNeed, replica: bool, source: str,
         tried: Sequence[tuple[int, NodeNeed]]) -> str:
    state = f"{_mib(need.state_bytes)} of state" + (
        f" (its replica's {_mib(need.host_bytes)} in host memory)" if need.host_bytes
        else " with its replica" if replica and p > 1 else "")
    fits = (f"{model.name}'s {state} and {_mib(need.total - need.state_bytes)} of activations "
            f"and schedule fit {source} at P={p}")
    if tried:
        last_p, last = tried[-1]
        fits += f"; at P={last_p} a node needs {_mib(last.total)}"
    return fits + f"; {d} pipeline{'s' if d > 1 else ''} on {d * p} of the nodes"


def _none_fits(model: Footprint, nodes: int, source: str,
               tried: Sequence[tuple[int, NodeNeed]], total: int, least: int) -> str:
    if not tried:
        return (f"--stages auto: {total} micro-batches a step cannot be shared by {least} or "
                f"more pipelines on {nodes} nodes: give --global-batch-size a multiple of "
                f"{least} x --micro-batch-size, or more --nodes")
    p, need = min(tried, key=lambda t: t[1].total)
    return (f"--stages auto: no layout of {model.name} fits {source} on "
            f"{nodes} nodes: the least a node needs is {_mib(need.total)} (P={p}, "
            f"{_mib(need.state_bytes)} of state); give more --nodes or --memory-per-node, a "
            f"smaller --micro-batch-size, or --redundancy off")
