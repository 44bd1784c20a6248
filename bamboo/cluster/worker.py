"""A worker process: one node of the cluster, playing one spot instance.

It joins the process group through the coordinator's store, runs its stage's
engine step after step, and reports every step to the coordinator over its own
pipe (one pipe per worker: a worker killed mid-write corrupts only its own
channel). Any exception is reported with its traceback before the process exits;
the process also dies with its parent (the fork server, which dies with the
coordinator), so no worker outlives the run.
"""
from __future__ import annotations

import ctypes
import os
import signal
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from bamboo.config import JobConfig
from bamboo.data import make_task
from bamboo.faults import Fault, FaultPlan
from bamboo.models import layer_param_counts, preset
from bamboo.pipeline.comm import PeerLost
from bamboo.pipeline.engine import StageEngine, TrainingHyper
from bamboo.pipeline.layout import Layout
from bamboo.pipeline.partition import partition

__all__ = ["WorkerSpec", "worker_main", "SHUTDOWN_KEY"]

SHUTDOWN_KEY = "shutdown"
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSpec:
    """Everything a worker needs to start."""

    rank: int
    world_size: int
    store_host: str
    store_port: int
    config: JobConfig
    faults: tuple[Fault, ...] = ()


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _device(cfg: JobConfig, rank: int) -> tuple[torch.device, str]:
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index), "nccl"
    return torch.device("cpu"), "gloo"


def _groups(layout: Layout, rank: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's data-parallel group (None when D = 1) and the group of all active ranks.

    `new_group` is collective over the whole world: every rank creates every group in
    the same order, standbys included.
    """
    dp_group = None
    if layout.pipelines > 1:
        for stage in range(layout.stages):
            group = dist.new_group(layout.stage_ranks(stage))
            if rank in layout.stage_ranks(stage):
                dp_group = group
    active = list(range(layout.pipelines * layout.stages))
    norm_group = dist.new_group(active) if len(active) > 1 else None
    return dp_group, norm_group


def _wait_for_shutdown(store: dist.Store, cfg: JobConfig) -> None:
    while True:
        try:
            store.wait([SHUTDOWN_KEY], timedelta(seconds=5))
            return
        except dist.DistStoreError:
            continue


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a worker process."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle
    step = -1
    try:
        cfg = spec.config
        torch.set_num_threads(cfg.threads)
        timeout = timedelta(seconds=cfg.comm_timeout_s)
        store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
        device, backend = _device(cfg, spec.rank)
        dist.init_process_group(backend, store=dist.PrefixStore("gen0", store), rank=spec.rank,
                                world_size=spec.world_size, timeout=timeout)
        p = preset(cfg.model)
        layout = Layout(nodes=spec.world_size, pipelines=cfg.data_parallel, stages=cfg.stages,
                        global_micro_batches=cfg.global_micro_batches)
        dp_group, norm_group = _groups(layout, spec.rank)
        if layout.role(spec.rank).standby:
            conn.send({"kind": "ready", "rank": spec.rank})
            _wait_for_shutdown(store, cfg)
            conn.send({"kind": "done", "rank": spec.rank})
            os._exit(0)
        parts = partition(layer_param_counts(p), cfg.stages)
        task = make_task(p, seed=cfg.seed, global_micro_batches=cfg.global_micro_batches,
                         micro_batch_size=cfg.micro_batch_size, data_file=cfg.data)
        hyper = TrainingHyper(lr=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps,
                              weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip)
        engine = StageEngine(preset=p, parts=parts, layout=layout, rank=spec.rank, task=task,
                             hyper=hyper, seed=cfg.seed, device=device, dp_group=dp_group,
                             norm_group=norm_group, faults=FaultPlan(list(spec.faults)))
        conn.send({"kind": "ready", "rank": spec.rank,
                   "layers": [engine.layer_indices.start, engine.layer_indices.stop]})
        for step in range(cfg.steps):
            report = engine.run_step(step)
            conn.send({"kind": "step", **asdict(report)})
        if engine.pipeline == 0:
            conn.send({"kind": "params", "rank": spec.rank, "layers": engine.parameters_by_layer()})
        conn.send({"kind": "done", "rank": spec.rank})
        _wait_for_shutdown(store, cfg)
        os._exit(0)
    except BaseException as e:  # reported to the coordinator, which decides the run's fate
        try:
            conn.send({"kind": "error", "rank": spec.rank, "step": step,
                       "peer_lost": isinstance(e, PeerLost),
                       "error": f"{type(e).__name__}: {e}".splitlines()[0][:500],
                       "traceback": traceback.format_exc()})
        finally:
            os._exit(1)
