"""Our pipeline engine against PyTorch's own `Schedule1F1B`, side by side.

Same model (gpt2-tiny by default), same partition, same micro-batches, same
number of processes (one per stage, gloo, one thread each), same optimizer work
(global-norm clipping across stages and AdamW), in one invocation. Prints the
steady-state steps/s of each (first steps excluded), their ratio, and our engine's
per-stage time breakdown (compute, send/recv wait, all-reduce, optimizer) from its
own timers.

    .venv/bin/python benchmarks/engine_vs_torch.py --stages 4 --micro-batches 8 --steps 30
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from bamboo.data import make_task
    from bamboo.models import build_layers, layer_param_counts, loss_fn, preset
    from bamboo.pipeline.optim import learning_rate, make_optimizer
    from bamboo.pipeline.partition import partition

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    p = preset(args.model)
    parts = partition(layer_param_counts(p), world)
    module = nn.Sequential(*build_layers(p, parts[rank], seed=0))
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    criterion = loss_fn(p)
    schedule = Schedule1F1B(stage, args.micro_batches, loss_fn=criterion)
    optimizer = make_optimizer(module, lr=3e-3, weight_decay=0.01)
    task = make_task(p, seed=0, global_micro_batches=args.micro_batches,
                     micro_batch_size=args.micro_batch_size)
    times, losses = [], []
    for step in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        batches = [task.batch(step, g) for g in range(args.micro_batches)] \
            if rank in (0, world - 1) else []
        step_losses: list = []
        if world == 1:
            schedule.step(torch.cat([b.inputs for b in batches]),
                          target=torch.cat([b.targets for b in batches]), losses=step_losses)
        elif rank == 0:
            schedule.step(torch.cat([b.inputs for b in batches]))
        elif rank == world - 1:
            schedule.step(target=torch.cat([b.targets for b in batches]), losses=step_losses)
        else:
            schedule.step()
        sq = torch.zeros(1, dtype=torch.float64)
        for q in module.parameters():
            if q.grad is not None:
                sq += q.grad.double().square().sum()
        dist.all_reduce(sq)
        coef = min(1.0, 1.0 / (float(sq.sqrt()) + 1e-6))
        for q in module.parameters():
            if q.grad is not None:
                q.grad.mul_(coef)
        for group in optimizer.param_groups:  # the same schedule as `bamboo train`'s default
            group["lr"] = learning_rate(step, peak=3e-3, warmup=5, total=args.steps)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        if step_losses:
            losses.append(float(torch.stack([x.detach() for x in step_losses]).mean()))
    queue.put((rank, times, losses))
    dist.destroy_process_group()


def run_torch(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=torch_worker, args=(r, args.stages, port, args, queue))
             for r in range(args.stages)]
    for proc in procs:
        proc.start()
    results = {}
    for _ in procs:
        rank, times, losses = queue.get(timeout=600)
        results[rank] = (times, losses)
    for proc in procs:
        proc.join(timeout=30)
    step_times = [max(results[r][0][i] for r in results) for i in range(args.steps)]
    return step_times, results[args.stages - 1][1]


def run_ours(args: argparse.Namespace) -> tuple[list[float], list[float], list[dict]]:
    out = Path(tempfile.mkdtemp(prefix="bench-ours-")) / "run"
    cmd = [sys.executable, "-m", "bamboo", "train", "--model", args.model,
           "--nodes", str(args.stages), "--stages", str(args.stages),
           "--micro-batches", str(args.micro_batches), "--micro-batch-size",
           str(args.micro_batch_size), "--steps", str(args.steps), "--redundancy", args.redundancy,
           "--quiet", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step_done"]
    return [e["wall_s"] for e in steps], [e["loss"] for e in steps], [e["nodes"] for e in steps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the figures")
    parser.add_argument("--redundancy", default="off",
                        help="our engine's mode (off: the same work as torch's schedule)")
    args = parser.parse_args()

    ours_times, ours_losses, breakdown = run_ours(args)
    torch_times, torch_losses = run_torch(args)
    w = args.warmup
    ours_rate = (args.steps - w) / sum(ours_times[w:])
    torch_rate = (args.steps - w) / sum(torch_times[w:])
    print(f"model {args.model}, {args.stages} stages, {args.micro_batches} micro-batches of "
          f"{args.micro_batch_size}, {args.steps} steps ({w} warm-up excluded)")
    print(f"  bamboo engine ({args.redundancy:5s}) {ours_rate:6.2f} steps/s  (median step "
          f"{1000 * statistics.median(ours_times[w:]):.0f} ms)  loss {ours_losses[0]:.3f} -> "
          f"{ours_losses[-1]:.3f}")
    print(f"  torch Schedule1F1B   {torch_rate:6.2f} steps/s  (median step "
          f"{1000 * statistics.median(torch_times[w:]):.0f} ms)  loss {torch_losses[0]:.3f} -> "
          f"{torch_losses[-1]:.3f}")
    print(f"  ratio bamboo / torch {ours_rate / torch_rate:6.2f}x")
    print("per-node breakdown of our engine, mean ms per step after warm-up "
          "(reduce = the commit round):")
    print("  stage  compute   wait  reduce  optim   step")
    for s in range(args.stages):
        rows = [b[s] for b in breakdown[w:]]
        mean = {k: 1000 * statistics.fmean(r[k] for r in rows)
                for k in ("compute_s", "wait_s", "reduce_s", "optim_s", "step_s")}
        print(f"  {s:5d} {mean['compute_s']:8.1f} {mean['wait_s']:6.1f} {mean['reduce_s']:7.1f} "
              f"{mean['optim_s']:6.1f} {mean['step_s']:6.1f}")


if __name__ == "__main__":
    main()
