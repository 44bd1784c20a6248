"""A worker's device and collective backend: which GPU a worker on a machine uses, TF32,
and NCCL or gloo (`BAMBOO_BACKEND`)."""
from __future__ import annotations

import os

import torch

from bamboo.config import JobConfig

__all__ = ["choose_device_index", "configure_tf32", "choose_backend", "worker_device", "BACKENDS"]


def choose_device_index(slot: int | None, local_rank_env: str | None, device_count: int) -> int:
    """The CUDA device index (into the visible devices) of the worker in `slot` on its
    machine. `LOCAL_RANK` (a torchrun-style launch), when set, wins over the slot. The
    index wraps around the `device_count` visible devices (torch's count already honours
    CUDA_VISIBLE_DEVICES), so slots 0..count-1 get distinct GPUs and only more live
    workers than GPUs share one."""
    if device_count <= 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise RuntimeError(f"--device cuda, but no GPU is visible{where}")
    if local_rank_env is not None and local_rank_env.strip():
        try:
            chosen = int(local_rank_env)
        except ValueError:
            raise ValueError(f"LOCAL_RANK={local_rank_env!r} is not a whole number") from None
        if chosen < 0:
            raise ValueError(f"LOCAL_RANK={local_rank_env!r} is negative")
    else:
        chosen = 0 if slot is None else slot
        if chosen < 0:
            raise ValueError(f"device slot {slot} is negative")
    return chosen % device_count


def configure_tf32(exact: bool) -> bool:
    """TF32 for float32 matmuls and cuDNN convolutions, unless the job is `--exact`
    (then both are turned off explicitly: cuDNN allows TF32 by default). Returns whether
    TF32 is allowed."""
    allow = not exact
    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow
    return allow


BACKENDS = ("nccl", "gloo")


def choose_backend(use_cuda: bool, requested: str | None) -> str:
    """The collective backend: `requested` (the `BAMBOO_BACKEND` environment variable:
    nccl | gloo; unset or empty: nccl with CUDA, gloo on the CPU). gloo with CUDA lets
    several workers share one GPU (NCCL refuses two ranks of one communicator on one
    device); their transfers are staged through host memory (`bamboo.engine.comm`)."""
    choice = (requested or "").strip().lower()
    if not choice:
        return "nccl" if use_cuda else "gloo"
    if choice not in BACKENDS:
        raise ValueError(f"BAMBOO_BACKEND={requested!r} is not one of {', '.join(BACKENDS)}")
    if choice == "nccl" and not use_cuda:
        raise RuntimeError("BAMBOO_BACKEND=nccl needs CUDA, but this worker runs on the CPU "
                           "(use --device cuda, or BAMBOO_BACKEND=gloo or unset)")
    return choice


def worker_device(cfg: JobConfig, node: int, index: int | None = None) -> tuple[torch.device, str]:
    """The worker's device and backend (`choose_backend`, from `BAMBOO_BACKEND`). `index`
    is its slot on its machine (`WorkerSpec.device_index`); `node` is not used to pick a
    GPU."""
    use_cuda = cfg.runtime.device == "cuda" or (cfg.runtime.device == "auto" and torch.cuda.is_available())
    backend = choose_backend(use_cuda, os.environ.get("BAMBOO_BACKEND"))
    if use_cuda:
        index = choose_device_index(index, os.environ.get("LOCAL_RANK"),
                                    torch.cuda.device_count())
        torch.cuda.set_device(index)
        configure_tf32(cfg.training.exact)
        return torch.device("cuda", index), backend
    return torch.device("cpu"), backend
