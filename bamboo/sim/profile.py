"""`bamboo profile`: measure a model's step costs on this machine for `bamboo simulate --costs`.

    bamboo profile --model gpt2-tiny --stages 4 --out costs.json
    bamboo simulate --trace ../shared/traces/aws-p3-2xlarge.csv --costs costs.json

What is measured, and how:

- `forward_s` / `backward_s`: one micro-batch through each stage's layers in this process,
  one thread, median of `--repeats` timed runs after a warm-up; no communication.
- `rc_overhead`: the per-instruction timeline model (`bamboo.plan.timeline`) of eager
  FRC against no RC on these costs, one processor per node (the cloud case).
- `failover_pause_s`: a local run of the real engine with a node SIGKILLed mid-step: the
  extra wall time of that step over the median step (the run's `pause_s`).
- `reconfiguration_s`: a local run with two adjacent nodes lost in one step and D = 2: the
  extra time of the peer restore (a stage's state moved from a live peer mid-step), the part
  of a reconfiguration this version performs. When that step was no slower than the median
  (a few MB moved, on busy cores), the time from the restore's detection to the step's
  commit is used instead, so the figure is never a zero that was not measured.
- `allreduce_s`, `optimizer_s`: the commit round and optimizer timers of the failure-free run.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bamboo.cli.parsing import EXIT_USAGE, UsageParser  # one-line usage errors
from bamboo.run.runlog import read_events

__all__ = ["main", "stage_times"]


def stage_times(model: str, stages: int, micro_batch_size: int, repeats: int,
                seed: int = 0) -> tuple[list[float], list[float]]:
    """Median seconds of one micro-batch's forward and backward, per stage."""
    import torch
    from torch import nn

    from bamboo.data.datasets import make_task
    from bamboo.model import build_layers, layer_param_counts, loss_fn, preset
    from bamboo.plan.partition import partition

    torch.set_num_threads(1)
    p = preset(model)
    parts = partition(layer_param_counts(p), stages)
    task = make_task(p, seed=seed, global_micro_batches=1, micro_batch_size=micro_batch_size)
    batch = task.batch(0, 0)
    modules = [nn.Sequential(*build_layers(p, r, seed)) for r in parts]
    criterion = loss_fn(p)
    forward, backward = [], []
    x = batch.inputs
    for s, module in enumerate(modules):
        f_times, b_times = [], []
        for i in range(repeats + 1):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = module(inp)
            if s == stages - 1:
                out = criterion(out, batch.targets)
            mid = time.perf_counter()
            out.backward(torch.ones_like(out) if out.dim() else None)
            end = time.perf_counter()
            if i:  # the first run warms up
                f_times.append(mid - start)
                b_times.append(end - mid)
            module.zero_grad(set_to_none=True)
        forward.append(statistics.median(f_times))
        backward.append(statistics.median(b_times))
        with torch.no_grad():
            x = module(x.detach())
    return forward, backward


def _engine_runs(model: str, stages: int, micro_batches: int, micro_batch_size: int,
                 steps: int) -> dict[str, float]:
    """Failover pause, peer-restore pause, commit and optimizer time from real local runs."""
    from bamboo.control import run_job
    from bamboo.config import JobConfig, parse_kill
    from bamboo.run.progress import ProgressDisplay
    from bamboo.run.runlog import RunDir

    def run(**kw: object) -> tuple[dict, Path]:
        kills = [parse_kill(k) for k in kw.pop("kills", [])]  # type: ignore[union-attr]
        cfg = JobConfig.of(model=model, stages=stages, micro_batch_size=micro_batch_size,
                        steps=steps, kills=kills, **kw).validate()  # type: ignore[arg-type]
        out = Path(tempfile.mkdtemp(prefix="bamboo-profile-")) / "run"
        return run_job(cfg, RunDir(out), ProgressDisplay(steps, enabled=False)), out

    victim = min(2, stages - 1)
    clean, clean_dir = run(nodes=stages, micro_batches=micro_batches)
    killed, _ = run(nodes=stages, micro_batches=micro_batches, kills=[f"0:{victim}@{steps // 2}"])
    restored, restored_dir = run(nodes=2 * stages, micro_batches=max(1, micro_batches // 2),
                      kills=[f"0:{victim - 1}@{steps // 2}", f"0:{victim}@{steps // 2}"]) \
        if stages >= 3 else (None, None)
    records = read_events(clean_dir / "events.jsonl")
    nodes = [n for r in records if r["event"] == "step_done" and r["step"] > 0 for n in r["nodes"]]
    return {
        "failover_pause_s": killed["pause_s"][0] if killed["pause_s"] else 0.0,
        "reconfiguration_s": _restore_pause(restored, restored_dir) if restored else 0.0,
        "allreduce_s": statistics.median(n["reduce_s"] for n in nodes),
        "optimizer_s": statistics.median(n["optim_s"] for n in nodes),
        "step_s": clean["median_step_s"] or 0.0,
    }


def _restore_pause(summary: dict, run_dir: Path) -> float:
    """The peer restore's extra step time, or, when that is not measurable, the seconds from
    its detection (`fault_detected`) to the commit of its step (`step_done`)."""
    extra = sum(summary["pause_s"])
    if extra > 0:
        return extra
    events = read_events(run_dir / "events.jsonl")
    fault = next((e for e in events if e["event"] == "fault_detected"
                  and e.get("handled_as") == "peer_restore"), None)
    if fault is None:
        return extra
    done = next((e for e in events if e["event"] == "step_done" and e["step"] == fault["step"]
                 and e["t"] > fault["t"]), None)
    return done["t"] - fault["t"] if done else extra


def main(argv: list[str] | None = None) -> int:
    parser = UsageParser(prog="bamboo profile", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (G)")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="steps of each engine run")
    parser.add_argument("--out", default="costs.json")
    parser.add_argument("--data", help="with --layers-only: a prepared token directory whose "
                        "vocabulary the model takes (as bamboo train --data)")
    parser.add_argument("--layers-only", action="store_true",
                        help="only time each layer alone and write a layer-costs file for "
                        "`bamboo train --layer-costs` (no engine runs)")
    args = parser.parse_args(argv)

    from bamboo.config import ConfigError, JobConfig
    try:
        job = JobConfig.of(model=args.model, nodes=args.stages, stages=args.stages,
                        micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size,
                        steps=args.steps, data=args.data).validate()
        if args.data is not None and not args.layers_only:
            raise ConfigError("--data goes with --layers-only (the step costs use synthetic data)")
        if args.repeats < 1 or args.steps < 4:
            raise ConfigError("--repeats must be >= 1 and --steps >= 4")
        if Path(args.out).exists():
            raise ConfigError(f"--out {args.out} exists: choose another file or remove it")
    except ConfigError as e:
        print(f"bamboo profile: error: {e}", file=sys.stderr)
        return EXIT_USAGE

    if args.layers_only:
        return _layers_only(args, job)
    from bamboo.plan.timeline import Costs, compare
    from bamboo.sim.costs import StepCosts, save_costs

    print(f"profiling {args.model}: {args.stages} stages, micro-batches of "
          f"{args.micro_batch_size}", file=sys.stderr)
    forward, backward = stage_times(args.model, args.stages, args.micro_batch_size, args.repeats)
    overhead = compare(args.stages, args.micro_batches,
                       Costs(forward=tuple(forward), backward=tuple(backward))).overhead("eager")
    print("running the engine: failure-free, one failover, one peer restore", file=sys.stderr)
    engine = _engine_runs(args.model, args.stages, args.micro_batches, args.micro_batch_size,
                          args.steps)
    costs = StepCosts(model=args.model, stages=args.stages, micro_batches=args.micro_batches,
                      samples_per_step=args.micro_batches * args.micro_batch_size,
                      forward_s=forward, backward_s=backward, rc_overhead=max(0.0, overhead),
                      failover_pause_s=engine["failover_pause_s"],
                      reconfiguration_s=engine["reconfiguration_s"],
                      allreduce_s=engine["allreduce_s"], optimizer_s=engine["optimizer_s"])
    save_costs(costs, args.out)
    print(f"forward ms per stage {[round(1000 * f, 2) for f in forward]}, backward ms "
          f"{[round(1000 * b, 2) for b in backward]}; eager RC overhead {100 * overhead:.1f}% "
          f"(timeline model, one processor per node); failover pause "
          f"{engine['failover_pause_s']:.3f} s; peer restore {engine['reconfiguration_s']:.3f} s; "
          f"wrote {args.out}", file=sys.stderr)
    return 0


def _layers_only(args: Any, job: Any) -> int:
    from bamboo.engine.layer_costs import measure_layer_costs, save_layer_costs
    p = job.model_preset()
    print(f"timing each layer of {args.model} (vocabulary {p.vocab}) alone: micro-batches of "
          f"{args.micro_batch_size}, median of {args.repeats}", file=sys.stderr)
    costs = measure_layer_costs(args.model, args.micro_batch_size, args.repeats, data=args.data)
    save_layer_costs(costs, args.out)
    print(f"ms per layer {[round(1000 * t, 2) for t in costs.layer_s]}; wrote {args.out} "
          f"(bamboo train --model {args.model} --layer-costs {args.out})", file=sys.stderr)
    return 0
