"""A worker process: one node of the cluster, playing one spot instance.

It joins the process group through the coordinator's store, runs its stages with
the engine step after step, and reports to the coordinator over its own pipe (a
worker killed mid-write corrupts only its own channel). A background thread stamps a
shared heartbeat slot, so a frozen process (no thread runs) is noticed by its lease.
Any exception is reported with its traceback before the process exits; the process
also dies with its parent (the fork server, which dies with the coordinator), so no
worker outlives the run.
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from bamboo.cluster.link import CoordinatorLink
from bamboo.config import JobConfig
from bamboo.data import make_task
from bamboo.faults import Fault, FaultPlan
from bamboo.models import layer_param_counts, preset
from bamboo.pipeline.comm import PeerLost
from bamboo.pipeline.engine import NodeEngine, TrainingHyper
from bamboo.pipeline.layout import Layout
from bamboo.pipeline.partition import partition
from bamboo.redundancy.roles import RoleMap

__all__ = ["WorkerSpec", "worker_main", "SHUTDOWN_KEY", "HEARTBEAT_S"]

SHUTDOWN_KEY = "shutdown"
HEARTBEAT_S = 0.5
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
    check_replicas: bool = False


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


def _wait_for_shutdown(store: dist.Store) -> None:
    while True:
        try:
            store.wait([SHUTDOWN_KEY], timedelta(seconds=5))
            return
        except dist.DistStoreError:
            continue


def _train(spec: WorkerSpec, link: CoordinatorLink, store: dist.Store, device: torch.device,
           progress: Any) -> None:
    cfg = spec.config
    p = preset(cfg.model)
    layout = Layout(nodes=spec.world_size, pipelines=cfg.data_parallel, stages=cfg.stages,
                    global_micro_batches=cfg.global_micro_batches)
    roles = RoleMap.initial(stages=cfg.stages, pipelines=cfg.data_parallel,
                            redundancy=cfg.redundancy != "off")
    if roles.pipeline_of(spec.rank) is None:  # a standby
        link.send("ready")
        _wait_for_shutdown(store)
        link.send("done")
        return
    parts = partition(layer_param_counts(p), cfg.stages)
    task = make_task(p, seed=cfg.seed, global_micro_batches=cfg.global_micro_batches,
                     micro_batch_size=cfg.micro_batch_size, data_file=cfg.data)
    hyper = TrainingHyper(lr=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps,
                          weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip)
    engine = NodeEngine(preset=p, parts=parts, layout=layout, rank=spec.rank, roles=roles,
                        task=task, hyper=hyper, seed=cfg.seed, device=device, link=link,
                        redundancy=cfg.redundancy, faults=FaultPlan(list(spec.faults)),
                        progress=progress, check_replicas=spec.check_replicas,
                        frc_offload=cfg.frc_offload)
    link.send("ready", stages=sorted(engine.stages),
              replica=engine.replica.stage if engine.replica is not None else None)
    for step in range(cfg.steps):
        report = engine.run_step(step)
        link.send("step", **asdict(report))
    link.send("params", layers=engine.parameters_by_layer())
    link.send("done")
    _wait_for_shutdown(store)


def worker_main(spec: WorkerSpec, conn: Connection, beats: Any, progress: Any) -> None:
    """Entry point of a worker process."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle
    link = None
    try:
        cfg = spec.config
        torch.set_num_threads(cfg.threads)
        timeout = timedelta(seconds=cfg.comm_timeout_s)
        store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
        watch = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
        link = CoordinatorLink(rank=spec.rank, conn=conn, store=store, timeout_s=cfg.comm_timeout_s,
                               watch_store=watch)
        threading.Thread(target=link.heartbeat_forever, args=(HEARTBEAT_S, beats),
                         daemon=True, name="heartbeat").start()
        device, backend = _device(cfg, spec.rank)
        dist.init_process_group(backend, store=dist.PrefixStore("gen0", store), rank=spec.rank,
                                world_size=spec.world_size, timeout=timeout)
        _train(spec, link, store, device, progress)
        os._exit(0)
    except BaseException as e:  # reported to the coordinator, which decides the run's fate
        try:
            message = {"kind": "error", "rank": spec.rank,
                       "step": int(progress[2 * spec.rank]) if progress is not None else -1,
                       "peer_lost": isinstance(e, PeerLost),
                       "error": f"{type(e).__name__}: {e}".splitlines()[0][:500],
                       "traceback": traceback.format_exc()}
            if link is not None:
                with link.lock:
                    conn.send(message)
            else:
                conn.send(message)
        finally:
            os._exit(1)
