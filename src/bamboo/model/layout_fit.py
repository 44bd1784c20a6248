"""`--stages auto` resolved before any worker starts: the model's per-layer figures, the
nodes' memory and the redundancy mode handed to the planner (`bamboo.plan.layout_choice`),
and the job it returns with the chosen P, D and M, checked whole.

`bamboo.api.start.launch` (behind `bamboo train`, `bamboo coordinator`, `bamboo.train` and
`bamboo.Trainer`) calls `resolve_stages` first, then the fit checks of `bamboo.model.fits` on
the job it returns.
"""
from __future__ import annotations

import dataclasses
import math

from bamboo.config import ConfigError, JobConfig
from bamboo.config.layout import AUTO, ChosenStages, parse_size
from bamboo.config.presets import CustomSizing
from bamboo.plan.layout_choice import Footprint, choose_layout

__all__ = ["resolve_stages", "footprint", "node_memory", "host_memory"]


def footprint(cfg: JobConfig, sizing: CustomSizing | None = None) -> Footprint:
    """The job's model as the planner sees it: per-layer parameters, what stages are cut by
    (--layer-costs, else parameters) and each layer's output for one micro-batch."""
    from bamboo.config.data import check_layer_costs
    from bamboo.model import boundary_shapes, layer_param_counts
    p = cfg.model_preset(sizing)
    check_layer_costs(cfg, p.layers)
    counts = layer_param_counts(p)
    boundaries = boundary_shapes(p, cfg.layout.micro_batch_size)
    return Footprint(cfg.model.name, tuple(counts), tuple(cfg.partition_costs(counts)),
                     tuple(math.prod(b.shape) * b.dtype.itemsize for b in boundaries))


def node_memory(cfg: JobConfig, local_workers: int) -> tuple[int, str]:
    """Bytes one node may use and how the line names them: --memory-per-node, else this
    machine's memory shared by its `local_workers`."""
    given = cfg.layout.memory_per_node
    if given is not None:
        return parse_size(given), f"--memory-per-node {given}"
    share = _machine_share(local_workers)
    if share is None:
        raise ConfigError("--stages auto needs the nodes' memory and this machine's cannot be "
                          "read: give --memory-per-node SIZE (e.g. 16GiB)", "memory_per_node")
    return share, f"1/{max(1, local_workers)} of this machine's memory ({share / 2**30:.1f} GiB)"


def _machine_share(local_workers: int) -> int | None:
    """This machine's memory shared by its `local_workers` (None: it cannot be read)."""
    from bamboo.model.fits import machine_memory_bytes
    machine = machine_memory_bytes()
    return None if machine is None else machine // max(1, local_workers)


def host_memory(cfg: JobConfig, local_workers: int) -> int | None:
    """Bytes of host memory one node may keep its replica in, where the mode keeps it there
    and that memory is not the device's (--host-memory-per-node, else on CUDA nodes this
    machine's memory shared by its `local_workers`); None: the replica counts against
    --memory-per-node (CPU nodes, or a replica on the device)."""
    if not cfg.redundancy.kind.keeps_replica_on_host:
        return None
    given = cfg.layout.host_memory_per_node
    if given is not None:
        return parse_size(given)
    if cfg.runtime.device == "cpu":
        return None
    import torch
    return _machine_share(local_workers) if torch.cuda.is_available() else None


def resolve_stages(cfg: JobConfig, local_workers: int,
                   sizing: CustomSizing | None = None) -> tuple[JobConfig, str | None]:
    """The job with --stages auto replaced by the planner's P, D and M (validated), and the
    line saying what was chosen and why; the job as it is (and None) for a fixed --stages.
    ConfigError (one line) when no layout fits."""
    layout = cfg.layout
    if layout.stages != AUTO:
        return cfg, None
    memory, source = node_memory(cfg, local_workers)
    mode = cfg.redundancy.kind
    choice = choose_layout(footprint(cfg, sizing), nodes=layout.nodes, memory_per_node=memory,
                           global_batch=layout.batch_samples,
                           micro_batch_size=layout.micro_batch_size,
                           replica=mode.may_keep_replica,
                           least_pipelines=2 if mode.reroutes else 1, memory_source=source,
                           host_memory_per_node=host_memory(cfg, local_workers))
    chosen = dataclasses.replace(layout, stages=ChosenStages(choice.stages),
                                 pipelines=choice.pipelines, micro_batches=choice.micro_batches)
    p, d, m = choice.stages, choice.pipelines, choice.micro_batches
    line = (f"--stages auto: {p} stage{'s' if p > 1 else ''} x {d} pipeline"
            f"{'s' if d > 1 else ''}, {m} micro-batch{'es' if m > 1 else ''} of "
            f"{layout.micro_batch_size} ({choice.why})")
    return dataclasses.replace(cfg, layout=chosen).validate(sizing), line
