"""One stage of a torchft replica group that is a pipeline (P >= 2): the group's stages run
`torch.distributed.pipelining`'s 1F1B over a gloo group of their own, and each stage's
gradients are averaged with the same stage of the other groups through its torchft Manager
(per-step quorum through the driver's Lighthouse; a group that (re)joins heals each stage
from a peer's). A stage that loses its pipeline peer exits; the driver restarts the group.
`python -m benchmarks.peers.ft_pipe_worker DIR GROUP STAGE STAGES STORE_PORT RESTARTED`
(TORCHFT_LIGHTHOUSE set)."""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from benchmarks.peers.ft_worker import reduce_gradients, wait_for_all
from benchmarks.peers.job import Job, Parts, write_json
from torch import nn
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torchft import Manager, ProcessGroupGloo
from torchft.optim import OptimizerWrapper

from bamboo.engine.optim import make_optimizer


def stage_layers(parts: Parts, stage: int, stages: int) -> nn.Sequential:
    """Stage `stage` of `stages`: an even cut of the model's layers, as a user of
    `torch.distributed.pipelining` cuts a `nn.Sequential` by hand."""
    layers = list(parts.model)
    n = len(layers)
    return nn.Sequential(*layers[stage * n // stages:(stage + 1) * n // stages])


def pipeline_lost(group: int, stage: int, error: Exception) -> None:
    """A pipeline peer is gone: this stage ends, and the driver restarts the whole group."""
    print(f"group {group} stage {stage}: pipeline lost ({error})", file=sys.stderr, flush=True)
    os._exit(3)


def main(out: Path, group: int, stage: int, stages: int, store_port: int, restarted: bool) -> None:
    job = Job.from_env()
    job.pin_worker(group * stages + stage)
    groups = job.workers // stages
    parts = Parts(job)
    module = stage_layers(parts, stage, stages)
    optimizer = make_optimizer(module, lr=parts.optimizer.defaults["lr"],
                               weight_decay=parts.optimizer.defaults["weight_decay"])
    worker = group * stages + stage
    if not restarted:
        wait_for_all(out, worker, job.workers)
    store = TCPStore("127.0.0.1", store_port, is_master=stage == 0, wait_for_workers=False,
                     timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=PrefixStore("pipe", store), rank=stage,
                            world_size=stages, timeout=timedelta(seconds=30))
    last = stage == stages - 1

    def load_state(sd: dict) -> None:
        module.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])

    def state() -> dict:
        return {"model": module.state_dict(), "optim": optimizer.state_dict()}

    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=load_state,
                      state_dict=state, replica_id=f"peers_{group}", store_addr="127.0.0.1",
                      store_port=store_port, rank=stage, world_size=stages, use_async_quorum=False,
                      timeout=timedelta(seconds=30))
    wrapped = OptimizerWrapper(manager, optimizer)
    per_group = job.micro_batches // groups
    pipe = PipelineStage(module, stage, stages, torch.device("cpu"))
    schedule = Schedule1F1B(pipe, per_group, loss_fn=parts.criterion)
    log = (out / f"steps.{group}.jsonl").open("a") if last else None
    while manager.current_step() < job.steps:
        wrapped.zero_grad()  # the quorum: a joining group heals here
        step = manager.current_step()
        if stage == 0:
            write_json(out / f"progress.{group}.json", {"step": step, "t": time.time()})
        mine = [parts.task.batch(step, g) for g in range(group, job.micro_batches, groups)]
        try:
            if stage == 0:
                schedule.step(torch.cat([b.inputs for b in mine]))
            elif last:
                out_losses: list = []
                schedule.step(target=torch.cat([b.targets for b in mine]), losses=out_losses)
            else:
                schedule.step()
        except Exception as e:  # noqa: BLE001 (a failure of the pipeline's collectives is a lost peer)
            pipeline_lost(group, stage, e)
        loss = reduce_gradients(manager, module, float(torch.stack(out_losses).mean()) if last else 0.0)
        params = list(module.parameters())
        if parts.grad_clip > 0:  # the global norm over the group's stages
            sq = torch.stack([q.grad.double().square().sum() for q in params]).sum().reshape(1)
            try:
                dist.all_reduce(sq)
            except Exception as e:  # noqa: BLE001 (a failure of the pipeline's collectives is a lost peer)
                pipeline_lost(group, stage, e)
            scale = min(1.0, parts.grad_clip / (float(sq.sqrt()) + 1e-6))
            for q in params:
                q.grad.mul_(scale)
        for g in optimizer.param_groups:
            g["lr"] = parts.lr_at(step)
        wrapped.step()
        if manager.current_step() > step and log is not None:
            log.write(json.dumps({"step": step, "participants": manager.num_participants(),
                                  "loss": loss, "t": time.time()}) + "\n")
            log.flush()
    torch.save([q.detach().clone() for q in module.parameters()], out / f"params.{group}.{stage}.pt")
    if last:
        write_json(out / f"result.{group}.json", {"steps_completed": job.steps, "t_end": time.time()})
    manager.shutdown(wait=False)
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
         sys.argv[6] == "1")
