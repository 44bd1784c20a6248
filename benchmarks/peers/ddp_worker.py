"""A torchrun elastic worker: DDP over gloo (P=1), a DCP checkpoint every K steps, and on
every (re)start the newest whole checkpoint loaded. A restarted attempt first waits the boot
delay (capacity coming back). Run by torchrun: `python -m benchmarks.peers.ddp_worker DIR K BOOT_S`."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from benchmarks.peers.job import Job, Parts, param_digest, write_json
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel


def newest_checkpoint(root: Path) -> tuple[Path | None, int, list[float]]:
    """The newest checkpoint that was written whole, its step and the losses before it."""
    done = sorted(root.glob("step_*/meta.json"), key=lambda p: int(p.parent.name[5:]))
    if not done:
        return None, 0, []
    meta = json.loads(done[-1].read_text())
    return done[-1].parent, meta["step"], meta["losses"]


def save(root: Path, step: int, losses: list[float], parts: Parts) -> None:
    model_sd, optim_sd = get_state_dict(parts.model, parts.optimizer)
    path = root / f"step_{step}"
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        write_json(path / "meta.json", {"step": step, "losses": losses})


def load(path: Path, parts: Parts) -> None:
    model_sd, optim_sd = get_state_dict(parts.model, parts.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(parts.model, parts.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def main(out: Path, every: int, boot_s: float) -> None:
    rank = int(os.environ["RANK"])
    Job.from_env().pin_worker(rank)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        time.sleep(boot_s)  # the lost machine's replacement boots
    (out / f"pid.{rank}").write_text(str(os.getpid()))
    dist.init_process_group("gloo")
    job, world = Job.from_env(), dist.get_world_size()
    parts = Parts(job)
    ckpt, start, losses = newest_checkpoint(out / "ckpt")
    if ckpt is not None:
        load(ckpt, parts)
    model = DistributedDataParallel(parts.model)
    if rank == 0:  # when each attempt began training, and from which step (the simulator's calibration)
        with (out / "attempts.jsonl").open("a") as log:
            log.write(json.dumps({"from_step": start, "t": time.time()}) + "\n")
    for step in range(start, job.steps):
        if rank == 0:
            write_json(out / "progress.json", {"step": step, "t": time.time()})
        losses.append(parts.ddp_step(model, step, rank, world))
        if every and (step + 1) % every == 0 and step + 1 < job.steps:
            save(out / "ckpt", step + 1, losses, parts)
    if rank == 0:
        write_json(out / "result.json", {"losses": losses, "steps_completed": job.steps,
                                          "t_end": time.time(), **param_digest(parts.model)})
    os._exit(0)  # destroy_process_group can hang on gloo at exit; torchrun needs only the exit status


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
