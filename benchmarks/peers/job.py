"""The one job every system trains: bamboo's model preset, data, seed, global batch, AdamW
and learning-rate schedule, for the peers' workers (torchrun + DCP, torchft), which run it as
plain data parallelism (P=1). The job travels to a worker as environment variables."""
from __future__ import annotations

import hashlib
import json
import math
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from bamboo.data.sizing import SIZING

ENV = "PEERS_JOB"


@dataclass(frozen=True)
class Job:
    """What stays equal across the systems: G micro-batches of B samples a step."""

    model: str = "gpt2-tiny"
    steps: int = 40
    seed: int = 0
    micro_batches: int = 8
    micro_batch_size: int = 4
    workers: int = 4
    pin: bool = False
    """Each worker on a core of its own (`--pin`), as each node has its own accelerator."""

    @property
    def global_batch(self) -> int:
        return self.micro_batches * self.micro_batch_size

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_env() -> Job:
        return Job(**json.loads(os.environ[ENV]))

    def bamboo_flags(self, stages: int | str = 1) -> list[str]:
        """`bamboo train`'s flags for this job in pipelines of `stages` (P=1: one pipeline a
        worker; "auto": Bamboo's planner picks the layout for the global batch), the global
        batch kept."""
        if stages == "auto":
            layout = ["--stages", "auto", "--global-batch-size", str(self.global_batch)]
        else:
            layout = ["--stages", str(stages),
                      "--micro-batches", str(self.micro_batches // (self.workers // int(stages)))]
        return ["--model", self.model, "--nodes", str(self.workers), *layout, "--micro-batch-size",
                str(self.micro_batch_size), "--steps", str(self.steps), "--seed", str(self.seed),
                *(["--pin-cpus", "auto"] if self.pin else [])]

    def pin_worker(self, slot: int) -> None:
        """Under `pin`, the calling worker onto the cores of `slot`, as Bamboo's
        `--pin-cpus auto` pins its own (`bamboo.node.pinning`)."""
        if self.pin:
            from bamboo.node.pinning import pin_this_process
            if pin_this_process("auto", slot, self.workers) is None:
                raise SystemExit(f"--pin: {self.workers} workers need a core each")


class Parts:
    """The model, task, loss, optimizer and learning rates of `job`, built as bamboo builds
    them (bamboo.model.build_layers, bamboo.data.datasets.make_task, AdamW, lr_at)."""

    def __init__(self, job: Job) -> None:
        from bamboo.config import JobConfig
        from bamboo.data.datasets import make_task
        from bamboo.engine.optim import make_optimizer
        from bamboo.engine.options import EngineOptions
        from bamboo.model import build_layers, loss_fn

        if not job.pin:  # pinned, the worker has its cores' threads (`Job.pin_worker`)
            torch.set_num_threads(1)
        cfg = JobConfig.of(model=job.model, nodes=job.workers, stages=1,
                           micro_batches=job.micro_batches // job.workers,
                           micro_batch_size=job.micro_batch_size, steps=job.steps,
                           seed=job.seed).validate(SIZING)
        p = cfg.model_preset(SIZING)
        self.job = job
        self.grad_clip = cfg.training.grad_clip
        self.model = nn.Sequential(*build_layers(p, range(p.layers), job.seed))
        self.task = make_task(p, seed=job.seed, global_micro_batches=job.micro_batches,
                              micro_batch_size=job.micro_batch_size)
        self.criterion = loss_fn(p)
        self.optimizer = make_optimizer(self.model, lr=cfg.training.lr,
                                        weight_decay=cfg.training.weight_decay)
        self._options = EngineOptions.from_config(cfg)

    def lr_at(self, step: int) -> float:
        return float(self._options.lr_at(step))

    def share_loss(self, model: nn.Module, step: int, share: int, shares: int,
                   device: torch.device | None = None) -> float:
        """Forward and backward of this share's micro-batches of `step` (micro-batch g goes
        to share g % shares), each loss scaled so the mean over shares is the global mean;
        each micro-batch moved to `device` first when given."""
        G = self.job.micro_batches
        total, mine = 0.0, list(range(share, G, shares))
        for g in mine:
            # DDP reduces once, on the share's last backward
            quiet = model.no_sync() if hasattr(model, "no_sync") and g != mine[-1] else nullcontext()
            torch.manual_seed(hash((self.job.seed, step, g)) & 0x7FFFFFFF)
            batch = self.task.batch(step, g)
            with quiet:
                inputs, targets = batch.inputs, batch.targets
                if device is not None:
                    inputs, targets = inputs.to(device), targets.to(device)
                loss = self.criterion(model(inputs), targets)
                (loss * (shares / G)).backward()
            total += float(loss.detach()) * shares / G
        return total

    def ddp_step(self, model: nn.Module, step: int, share: int, shares: int) -> float:
        """One data-parallel step of `shares` workers (DDP's `model` reduces the gradients):
        this share's forward and backward, clipping, the step's learning rate and the
        optimizer step; the mean loss over the shares."""
        import torch.distributed as dist
        total = torch.tensor([self.share_loss(model, step, share, shares)])
        dist.all_reduce(total)
        self.clip()
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(total) / shares

    def clip(self) -> None:
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)


def param_digest(model: nn.Module) -> dict:
    """param_l2 and param_sha256 as bamboo's summary.json writes them."""
    h, sq = hashlib.sha256(), 0.0
    for q in model.parameters():
        t = q.detach().float().contiguous()
        h.update(t.numpy().tobytes())
        sq += float(t.double().square().sum())
    return {"param_l2": math.sqrt(sq), "param_sha256": h.hexdigest()}


def write_json(path: Path, data: dict) -> None:
    """Whole or not at all: a reader never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
