"""Measure a model's step costs on this machine for `bamboo simulate --costs` (the library of
`bamboo profile`, whose flags live in `bamboo.cli.profile`).

    bamboo profile --model gpt2-tiny --stages 4 --out costs.json
    bamboo simulate --trace traces/aws-p3-2xlarge.csv --costs costs.json

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

import logging
import statistics
import tempfile
import time
from pathlib import Path

from bamboo.run.runlog import read_events
from bamboo.sim.costs import StepCosts

__all__ = ["profile_costs", "profile_layers", "stage_times"]

log = logging.getLogger(__name__)


def stage_times(model: str, stages: int, micro_batch_size: int, repeats: int,
                seed: int = 0, dataset: str | None = None, loss: str | None = None
                ) -> tuple[list[float], list[float]]:
    """Median seconds of one micro-batch's forward and backward, per stage (on a
    `dataset`'s samples, with its `loss`, when given)."""
    import torch
    from torch import nn

    from bamboo.config import JobConfig
    from bamboo.data.sizing import SIZING
    from bamboo.engine.layer_costs import first_batch
    from bamboo.model import build_layers, layer_param_counts
    from bamboo.model.structure import detach, float32, leaves, map_floats
    from bamboo.plan.partition import partition

    torch.set_num_threads(1)
    p = JobConfig.of(model=model, dataset=dataset).model_preset(SIZING)
    parts = partition(layer_param_counts(p), stages)
    batch, criterion = first_batch(model, micro_batch_size, seed, dataset=dataset, loss=loss)
    modules = [nn.Sequential(*build_layers(p, r, seed)) for r in parts]
    forward, backward = [], []
    x = batch.inputs
    for s, module in enumerate(modules):
        f_times, b_times = [], []
        for i in range(repeats + 1):
            inp = map_floats(lambda t: t.requires_grad_(), detach(x))  # a tuple or dict too
            start = time.perf_counter()
            out = module(inp)
            if s == stages - 1:
                out = criterion(float32(out), batch.targets)
            mid = time.perf_counter()
            outs = [t for t in leaves(out) if t.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(t) if t.dim() else None for t in outs])
            end = time.perf_counter()
            if i:  # the first run warms up
                f_times.append(mid - start)
                b_times.append(end - mid)
            module.zero_grad(set_to_none=True)
        forward.append(statistics.median(f_times))
        backward.append(statistics.median(b_times))
        with torch.no_grad():
            x = detach(module(detach(x)))
    return forward, backward


def _engine_runs(model: str, stages: int, micro_batches: int, micro_batch_size: int,
                 steps: int, user_data: dict[str, str]) -> dict[str, float]:
    """Failover pause, peer-restore pause, commit and optimizer time from real local runs."""
    from bamboo.config import JobConfig, parse_kill
    from bamboo.control import run_job
    from bamboo.data.sizing import SIZING
    from bamboo.launch.local import LocalWorkers
    from bamboo.run.progress import ProgressDisplay
    from bamboo.run.runlog import RunDir

    def run(**kw: object) -> tuple[dict, Path]:
        kills = [parse_kill(k) for k in kw.pop("kills", [])]  # type: ignore[union-attr]  # the kills keyword is a list of specs when given
        cfg = JobConfig.of(model=model, stages=stages, micro_batch_size=micro_batch_size,
                           steps=steps, kills=kills, **user_data,
                           **kw).validate(SIZING)  # type: ignore[arg-type]  # the JobConfig keywords the caller passes through
        out = Path(tempfile.mkdtemp(prefix="bamboo-profile-")) / "run"
        return run_job(cfg, RunDir(out), ProgressDisplay(steps, enabled=False),
                       LocalWorkers()), out

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


def profile_costs(model: str, stages: int, micro_batches: int, micro_batch_size: int,
                  repeats: int, steps: int, dataset: str | None = None,
                  loss: str | None = None) -> StepCosts:
    """The costs file's figures for `model` cut into `stages`, measured here (its progress
    logged at INFO): the stage times, the timeline model's eager RC overhead on them, and the
    pauses and commit times of three real local runs; on a `dataset`'s samples with its
    `loss` when given (a model that takes other inputs than tokens)."""
    from bamboo.plan.timeline import Costs, compare

    log.info("profiling %s: %d stages, micro-batches of %d", model, stages, micro_batch_size)
    forward, backward = stage_times(model, stages, micro_batch_size, repeats,
                                    dataset=dataset, loss=loss)
    overhead = compare(stages, micro_batches,
                       Costs(forward=tuple(forward), backward=tuple(backward))).overhead("eager")
    log.info("running the engine: failure-free, one failover, one peer restore")
    user_data = {k: v for k, v in (("dataset", dataset), ("loss", loss)) if v is not None}
    engine = _engine_runs(model, stages, micro_batches, micro_batch_size, steps, user_data)
    return StepCosts(model=model, stages=stages, micro_batches=micro_batches,
                     samples_per_step=micro_batches * micro_batch_size,
                     forward_s=forward, backward_s=backward, rc_overhead=max(0.0, overhead),
                     failover_pause_s=engine["failover_pause_s"],
                     reconfiguration_s=engine["reconfiguration_s"],
                     allreduce_s=engine["allreduce_s"], optimizer_s=engine["optimizer_s"])


def profile_layers(model: str, vocab: int, micro_batch_size: int, repeats: int,
                   data: str | None, out: str, dataset: str | None = None,
                   loss: str | None = None) -> None:
    """Time each layer of `model` alone and write the layer-costs file `out` for
    `bamboo train --layer-costs` (no engine runs)."""
    from bamboo.config.layer_costs import save_layer_costs
    from bamboo.engine.layer_costs import measure_layer_costs
    on = f"on {dataset}" if dataset else f"(vocabulary {vocab})"
    log.info("timing each layer of %s %s alone: micro-batches of %d, median of %d", model, on,
             micro_batch_size, repeats)
    costs = measure_layer_costs(model, micro_batch_size, repeats, data=data, dataset=dataset,
                                loss=loss)
    save_layer_costs(costs, out)
    log.info("ms per layer %s; wrote %s (bamboo train --model %s --layer-costs %s)",
             [round(1000 * t, 2) for t in costs.layer_s], out, model, out)
