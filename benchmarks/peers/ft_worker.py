"""A torchft replica group of one process (P=1): a per-step quorum through the driver's
Lighthouse on ProcessGroupGloo; a replica that (re)joins heals live from a peer. The
gradients go through the manager's allreduce in one flat buffer, outside a DDP comm hook:
torchft 0.2.0's hook lets a SIGKILL inside an all-reduce crash every survivor on gloo.
`python -m benchmarks.peers.ft_worker DIR REPLICA STORE_PORT RESTARTED` (TORCHFT_LIGHTHOUSE set)."""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from benchmarks.peers.job import Job, Parts, param_digest, write_json
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo
from torchft.optim import OptimizerWrapper


def reduce_gradients(manager: Manager, module: torch.nn.Module, loss: float) -> float:
    """Every gradient of `module` and the loss averaged over the step's participants, in one
    buffer; the mean loss."""
    params = [q for q in module.parameters()]
    for q in params:
        if q.grad is None:
            q.grad = torch.zeros_like(q)
    flat = torch.cat([q.grad.reshape(-1) for q in params] + [torch.tensor([loss])])
    manager.allreduce(flat).wait()
    at = 0
    for q in params:
        q.grad.copy_(flat[at:at + q.numel()].view_as(q))
        at += q.numel()
    return float(flat[-1])


def wait_for_all(out: Path, replica: int, workers: int) -> None:
    """The first launch's barrier: the first quorum holds every replica group, as the
    other systems' first step holds every worker."""
    (out / f"ready.{replica}").touch()
    while len(list(out.glob("ready.*"))) < workers:
        time.sleep(0.02)


def main(out: Path, replica: int, store_port: int, restarted: bool) -> None:
    job = Job.from_env()
    job.pin_worker(replica)
    parts = Parts(job)
    if not restarted:
        wait_for_all(out, replica, job.workers)
    store = TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)

    def load_state(sd: dict) -> None:
        parts.model.load_state_dict(sd["model"])
        parts.optimizer.load_state_dict(sd["optim"])

    def state() -> dict:
        return {"model": parts.model.state_dict(), "optim": parts.optimizer.state_dict()}

    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=load_state,
                      state_dict=state, replica_id=f"peers_{replica}", store_addr="127.0.0.1",
                      store_port=store_port, rank=0, world_size=1, use_async_quorum=False,
                      timeout=timedelta(seconds=30))
    optimizer = OptimizerWrapper(manager, parts.optimizer)
    log = (out / f"steps.{replica}.jsonl").open("a")
    losses: list[float] = []
    while manager.current_step() < job.steps:
        optimizer.zero_grad()  # the quorum: a joining replica heals here
        step = manager.current_step()
        write_json(out / f"progress.{replica}.json", {"step": step, "t": time.time()})
        loss = parts.share_loss(parts.model, step, replica, job.workers)
        mean = reduce_gradients(manager, parts.model, loss)
        parts.clip()
        for group in parts.optimizer.param_groups:
            group["lr"] = parts.lr_at(step)
        optimizer.step()
        if manager.current_step() > step:  # committed
            losses.append(mean)
            log.write(json.dumps({"step": step, "participants": manager.num_participants(),
                                  "loss": mean, "t": time.time()}) + "\n")
            log.flush()
    write_json(out / f"result.{replica}.json", {"losses": losses, "steps_completed": job.steps,
                                                "t_end": time.time(),
                                                **param_digest(parts.model)})
    manager.shutdown(wait=False)
    del store
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1")
