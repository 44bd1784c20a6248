"""Our pipeline engine against PyTorch's own schedules, side by side.

Our `--schedule 1f1b` and `--schedule zb-h1` against torch's `Schedule1F1B` and its
zero-bubble schedule (`ScheduleInterleavedZeroBubble` with one stage per rank, torch's
ZB-H1-like case), all in one invocation and interleaved over `--reps` repetitions. Same
model (gpt2-tiny by default), same partition, same micro-batches, same number of
processes (one per stage, gloo), same optimizer work (global-norm clipping across stages
and AdamW). With `--pin-cpus auto` (when the machine has a core per stage) every worker,
ours and torch's, runs on cores of its own, so bubbles are real idle time. Prints the
steady-state steps/s of each (first steps excluded), the ratios, and our engine's
per-stage time breakdown (compute, send/recv wait, all-reduce, optimizer) from its own
timers.

    .venv/bin/python benchmarks/engine_vs_torch.py --stages 2 --micro-batches 4 --pin-cpus auto
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

from bamboo.data.sizing import SIZING

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_worker(rank: int, world: int, port: int, args: argparse.Namespace, schedule_name: str,
                 queue) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleavedZeroBubble,
    )

    from bamboo.config.presets import preset
    from bamboo.data.datasets import make_task
    from bamboo.engine.optim import learning_rate, make_optimizer
    from bamboo.model import build_layers, layer_param_counts, loss_fn
    from bamboo.plan.partition import partition

    cores = sorted(os.sched_getaffinity(0))
    if args.pin_cpus == "auto" and len(cores) >= world:
        share = len(cores) // world
        os.sched_setaffinity(0, cores[rank * share:(rank + 1) * share])
        torch.set_num_threads(share)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    p = preset(args.model, SIZING)
    parts = partition(layer_param_counts(p), world)
    module = nn.Sequential(*build_layers(p, parts[rank], seed=0))
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    criterion = loss_fn(p)
    if schedule_name == "1f1b":
        schedule = Schedule1F1B(stage, args.micro_batches, loss_fn=criterion)
    else:
        schedule = ScheduleInterleavedZeroBubble([stage], args.micro_batches, loss_fn=criterion)
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


def run_torch(args: argparse.Namespace, schedule: str) -> tuple[list[float], list[float]]:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=torch_worker, args=(r, args.stages, port, args, schedule, queue))
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


def run_ours(args: argparse.Namespace, schedule: str) -> tuple[list[float], list[float], list[dict]]:
    out = Path(tempfile.mkdtemp(prefix="bench-ours-")) / "run"
    cmd = [sys.executable, "-m", "bamboo", "train", "--model", args.model,
           "--nodes", str(args.stages), "--stages", str(args.stages),
           "--micro-batches", str(args.micro_batches), "--micro-batch-size",
           str(args.micro_batch_size), "--steps", str(args.steps), "--redundancy", args.redundancy,
           "--schedule", schedule, "--pin-cpus", args.pin_cpus, "--quiet", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step_done"]
    return [e["wall_s"] for e in steps], [e["loss"] for e in steps], [e["nodes"] for e in steps]


RUNS = {"ours 1f1b": (run_ours, "1f1b"), "ours zb-h1": (run_ours, "zb-h1"),
        "torch 1f1b": (run_torch, "1f1b"), "torch zb": (run_torch, "zb")}
"""Name -> (runner, schedule): torch's `zb` is `ScheduleInterleavedZeroBubble`."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the figures")
    parser.add_argument("--reps", type=int, default=1, help="interleaved repetitions of each")
    parser.add_argument("--runs", default=",".join(RUNS),
                        help=f"comma-separated, of: {', '.join(RUNS)}")
    parser.add_argument("--pin-cpus", choices=("off", "auto"), default="off",
                        help="auto: every worker on cores of its own (a core per stage needed)")
    parser.add_argument("--redundancy", default="off",
                        help="our engine's mode (off: the same work as torch's schedule)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    names = [n.strip() for n in args.runs.split(",")]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown --runs {unknown}: choose among {', '.join(RUNS)}")

    w = args.warmup
    rates: dict[str, list[float]] = {n: [] for n in names}
    medians: dict[str, list[float]] = {n: [] for n in names}
    final_loss: dict[str, float] = {}
    breakdown: dict[str, list] = {}
    for _ in range(args.reps):
        for name in names:
            runner, schedule = RUNS[name]
            result = runner(args, schedule)
            times, losses = result[0], result[1]
            if name.startswith("ours"):
                breakdown.setdefault(name, []).extend(result[2][w:])
            rates[name].append((args.steps - w) / sum(times[w:]))
            medians[name].append(statistics.median(times[w:]))
            final_loss[name] = losses[-1] if losses else float("nan")
    print(f"model {args.model}, {args.stages} stages, {args.micro_batches} micro-batches of "
          f"{args.micro_batch_size}, {args.steps} steps ({w} warm-up excluded), pin-cpus "
          f"{args.pin_cpus}, {args.reps} repetition(s), medians over them")
    rate = {n: statistics.median(r) for n, r in rates.items()}
    for name in names:
        print(f"  {name:11s} {rate[name]:6.3f} steps/s  (median step "
              f"{1000 * statistics.median(medians[name]):.0f} ms)  last loss "
              f"{final_loss[name]:.4f}")
    pairs = [("ours zb-h1", "ours 1f1b"), ("ours 1f1b", "torch 1f1b"), ("ours zb-h1", "torch zb"),
             ("torch zb", "torch 1f1b")]
    for a, b in pairs:
        if a in rate and b in rate:
            print(f"  {a} / {b}: {rate[a] / rate[b]:.3f}x")
    ours = [n for n in names if n.startswith("ours")]
    theirs = [n for n in names if n.startswith("torch")]
    if ours and theirs:
        best_ours, best_theirs = max(ours, key=rate.get), max(theirs, key=rate.get)
        print(f"  best ours ({best_ours}) / best torch ({best_theirs}): "
              f"{rate[best_ours] / rate[best_theirs]:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rates": rates,
                                               "median_step_s": medians}, indent=1))
    if not breakdown:
        return
    print("per-node breakdown of our engine, mean ms per step after warm-up, all repetitions "
          "(reduce = the commit round):")
    print("  run          stage  compute   wait  reduce  optim   step")
    for name, steps in breakdown.items():
        for s in range(args.stages):
            rows = [b[s] for b in steps]
            mean = {k: 1000 * statistics.fmean(r[k] for r in rows)
                    for k in ("compute_s", "wait_s", "reduce_s", "optim_s", "step_s")}
            print(f"  {name:11s} {s:6d} {mean['compute_s']:8.1f} {mean['wait_s']:6.1f} "
                  f"{mean['reduce_s']:7.1f} {mean['optim_s']:6.1f} {mean['step_s']:6.1f}")


if __name__ == "__main__":
    main()
