"""The simulator's prediction of each cell of a peers run (`benchmarks.peers.run`'s --out):
each system's policy in `bamboo.sim` (Bamboo: the redundancy mode it ran; torchrun; torchft)
fed the costs measured in that run, on the same kills, its goodput over the same window set
against the measured one. The costs are the failure-free seconds a step and what each
recovery took, read from the runs' own logs (Bamboo's events, torchrun's attempts, torchft's
commits), never fitted to the goodput.

    python -m benchmarks.peers.predict --out runs/peers-density --steps 800 --bamboo-stages 2 \\
        --kills p3-quiet --kills p3-dense --kills every:60 --boot-s 3   # the run's own flags

`--calibrate-on SCHEDULE` reads the recovery costs from that schedule's runs only, so the
other schedules' cells are predictions of runs the costs did not come from.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import median

from benchmarks.peers.job import Job
from benchmarks.peers.report import Kill, kills_sent, run_tag
from benchmarks.peers.run import parse_args

from bamboo.sim.core import SimConfig
from bamboo.sim.cost_presets import SimModel
from bamboo.sim.policies import make_policy
from bamboo.traces.trace import parse_trace_text


@dataclass
class Cell:
    system: str
    schedule: str
    kills: int
    measured: float
    predicted: float
    step_s: float
    """The step time the prediction took: the failure-free run's, or the run's own pace."""

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1.0 if self.measured else float("inf")


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def bamboo_costs(runs: list[Path]) -> dict:
    """From Bamboo's events: a failover's pause and the reconfiguration after it (loss_cost),
    a re-route's pause (its node_lost: the loss step's excess), a lost stage restored after a
    fatal loss (fault to the next generation ready), and the step time while a shadow holds
    two stages against a clean step. A re-route's pause holds the lost slot's share of the
    step already, which the simulator's re-route adds again (a step / (D - 1) a loss, on a
    processor per worker): its prediction errs low by that much."""
    pauses, added, restarts, shadow, clean = [], [], [], [], []
    every, write = [], []
    for run in runs:
        events = _lines(run / "run" / "events.jsonl")
        shadowed = False
        fault_t = None
        for e in events:
            kind = e["event"]
            if kind == "loss_cost":
                if e["handled_as"] != "reroute":  # a re-route's pause is its node_lost's
                    (pauses if e["handled_as"] == "failover" else restarts).append(e["pause_s"])
                added.append(e["added_s"])
            elif kind == "node_lost" and e.get("handled_as") == "reroute":
                pauses.append(e["pause_s"])  # the loss step's excess: re-routed in flight
            elif kind == "fault_detected":
                shadowed = e["handled_as"] == "failover"
                if e["handled_as"] not in ("failover", "reroute"):
                    fault_t = e["t"]
            elif kind == "generation_ready" and fault_t is not None:
                restarts.append(e["t"] - fault_t)
                fault_t = None
            elif kind == "reconfigured":
                shadowed = False
            elif kind == "step_done" and e.get("attempts", 1) == 1:
                (shadow if shadowed else clean).append(e["wall_s"])
            elif kind == "checkpoint_interval":
                every.append(e["every"])
                write.append(e["write_s"])
    return {"failover_pause_s": median(pauses) if pauses else 0.0,
            "rebalance_s": median(added) if added else 0.0,
            "restart_s": median(restarts) if restarts else (median(added) if added else 0.0),
            "shadow_slowdown": median(shadow) / median(clean) if shadow and clean else 1.0,
            "checkpoint_every": median(every) if every else 0, "ckpt_save_s": median(write) if write else 0.0}


def kill_times(first_t: float, kills: list[Kill], sent: int) -> list[float]:
    return [first_t + k.at for k in kills[:sent]]


def torchrun_costs(runs: list[tuple[Path, list[Kill], int]], boot_s: float) -> dict:
    """From each attempt's start (attempts.jsonl): the seconds from the kill before it to its
    first step, less the boot the replacement needed."""
    restarts = []
    for run, kills, sent in runs:
        attempts = _lines(run / "attempts.jsonl")
        if not attempts:
            continue
        times = kill_times(attempts[0]["t"], kills, sent)
        for a in attempts[1:]:
            before = [t for t in times if t < a["t"]]
            if before:
                restarts.append(a["t"] - before[-1] - boot_s)
    return {"ckpt_restart_s": median(restarts) if restarts else 0.0}


def torchft_costs(runs: list[tuple[Path, list[Kill], int]], boot_s: float, step_s: float,
                  workers: int, cores: int, stages: int = 1) -> dict:
    """From replica 0's commits (steps.0.jsonl), for each kill the longest wait between two
    commits after it: what it added to a step (quorum_s), and the seconds from the
    replacement's boot to the first commit with every group again, where that comes before
    the next kill (else the heal time would hold the next kill's too) (heal_s). A group is
    `stages` workers (a pipeline under --torchft-stages); participants count groups."""
    groups = workers // stages
    quorum, heal = [], []
    for run, kills, sent in runs:
        commits = [c for c in _lines(run / "steps.0.jsonl") if "t" in c]
        if len(commits) < 2:
            continue
        times = kill_times(commits[0]["t"] - step_s, kills, sent)
        pairs = list(zip(commits, commits[1:]))
        for tk in times:
            after = min((t for t in times if t > tk), default=float("inf"))  # the next kill
            near = [(a, b) for a, b in pairs if b["t"] > tk and a["t"] < tk + 120.0]
            if not near:
                continue
            a, b = max(near, key=lambda ab: ab[1]["t"] - ab[0]["t"])
            k = b["participants"]
            share = max(k * stages, cores) / max(workers, cores) if cores else 1.0  # pinned: each its own
            quorum.append(max(0.0, b["t"] - max(a["t"], tk) - step_s * share))
            whole = next((c for c in commits if c["t"] >= b["t"] and c["participants"] == groups), None)
            if whole is not None and whole["t"] < after:  # healed before the next kill
                heal.append(max(0.0, whole["t"] - tk - boot_s))
    return {"quorum_s": median(quorum) if quorum else 0.0, "heal_s": median(heal) if heal else 0.0}


def pace(system: str, run: Path, kills: list[Kill], sent: int, steps: int) -> float | None:
    """Seconds a step in a run under kills while no kill touched it: Bamboo's steps before
    its first preemption, torchft's commits before the first kill, torchrun's steps after
    its last restart (the machine's speed drifts between runs; this is the run's own)."""
    if system == "bamboo":
        events = _lines(run / "run" / "events.jsonl")
        first = next((e["t"] for e in events if e["event"] == "preempt"), float("inf"))
        done = [e["t"] for e in events if e["event"] == "step_done" and e["t"] < first]
        return (done[-1] - done[0]) / (len(done) - 1) if len(done) > 10 else None
    if system == "torchft":
        commits = [c["t"] for c in _lines(run / "steps.0.jsonl") if "t" in c]
        if len(commits) < 10:
            return None
        first = commits[0] + (kills[0].at if sent else float("inf"))
        done = [t for t in commits if t < first]
        return (done[-1] - done[0]) / (len(done) - 1) if len(done) > 10 else None
    attempts = _lines(run / "attempts.jsonl")
    result = json.loads((run / "result.json").read_text()) if (run / "result.json").exists() else None
    if not attempts or result is None or steps - attempts[-1]["from_step"] < 10:
        return None
    return (result["t_end"] - attempts[-1]["t"]) / (steps - attempts[-1]["from_step"])


def model_for(system: str, job: Job, stages: int, step_s: float, costs: dict,
              ft_stages: int = 1) -> tuple[SimModel, int]:
    """The simulator's model of this job under `system` (P, pipelines) on this machine: where
    the workers share its processors a step keeps its time with fewer pipelines; pinned
    (`job.pin`, a processor each) Bamboo's d pipelines take D/d times as long for the global
    batch (the peers' steps are modelled in their policies: torchrun's world is whole,
    torchft's groups, of `ft_stages` workers each, each do their own share)."""
    P = stages if system == "bamboo" else ft_stages if system == "torchft" else 1
    D = job.workers // P
    model = SimModel(name=job.model, stages=P,
                     step_s={d: step_s * (D / d if job.pin and system == "bamboo" else 1.0) for d in range(1, D + 1)},
                     samples_per_step=job.global_batch, rc_overhead=0.0, lazy_overhead=0.0,
                     failover_pause_s=costs.get("failover_pause_s", 0.0),
                     rebalance_s=costs.get("rebalance_s", 0.0), restart_s=costs.get("restart_s", 0.0),
                     shadow_slowdown=costs.get("shadow_slowdown", 1.0),
                     ckpt_save_s=costs.get("ckpt_save_s", 0.0),
                     ckpt_restart_s=costs.get("ckpt_restart_s", 0.0),
                     heal_s=costs.get("heal_s", 0.0), quorum_s=costs.get("quorum_s", 0.0),
                     source="measured in the peers run", measured=True)
    return model, D * P


def sim_trace(kills: list[Kill], workers: int, offset: float) -> str:
    """The kills as trace rows: each worker removed at offset + its time and a replacement
    added then (ready after the configured allocation delay, the boot)."""
    rows = [(0.0, "add", f"n{i}") for i in range(workers)]
    live = [f"n{i}" for i in range(workers)]
    for i, k in enumerate(kills):
        new = f"n{workers + i}"
        rows += [(offset + k.at, "remove", live[k.worker]), (offset + k.at, "add", new)]
        live[k.worker] = new
    return "\n".join(f"{int(t * 1000)},{kind},{n}" for t, kind, n in sorted(rows, key=lambda r: r[0])) + "\n"


def predict(policy: str, model: SimModel, config: SimConfig, workers: int, kills: list[Kill],
            window_s: float) -> float:
    """Samples per second over the window the run measured (its first step to its last)."""
    probe = make_policy(policy, model, config)
    trace = parse_trace_text(sim_trace([], workers, 0.0), "probe")
    trace.duration = 3600.0
    probe.run(trace)
    start = probe.first_run_t or 0.0
    trace = parse_trace_text(sim_trace(kills, workers, start), "kills")
    trace.duration = start + window_s
    result = make_policy(policy, model, config).run(trace)
    return result.samples / window_s


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--calibrate-on", help="a schedule whose runs alone give the costs")
    mine, rest = own.parse_known_args(argv)
    a = parse_args(rest)
    if mine.calibrate_on and mine.calibrate_on not in [n for n, _, _ in a.schedules]:
        print(f"--calibrate-on {mine.calibrate_on}: not one of the run's --kills", file=sys.stderr)
        return 2
    job = Job(model=a.model, steps=a.steps, seed=a.seed, micro_batches=a.micro_batches,
              micro_batch_size=a.micro_batch_size, workers=a.workers, pin=a.pin)
    if not (a.out / "results.json").exists():
        print(f"no results.json in {a.out}: run benchmarks.peers.run with this --out first",
              file=sys.stderr)
        return 2
    records = {r["run"]: r for r in json.loads((a.out / "results.json").read_text()) if "wall_s" in r}
    cores = 0 if a.pin else os.cpu_count() or 1  # 0: a processor each (bamboo.sim's SimConfig)
    cells: list[Cell] = []
    for system in a.system_list:
        free = records.get(run_tag(system, None, 0))
        if free is None:
            continue
        step_s = free["wall_s"] / job.steps
        killed = []
        for name, _, kills in a.schedules:
            tag = run_tag(system, name, 0)
            if tag in records:
                rec = records[tag]
                killed.append((name, a.out / tag, kills, rec))
        source = [k for k in killed if mine.calibrate_on in (None, k[0])]
        runs = [(path, kills, kills_sent(rec, kills)) for _, path, kills, rec in source]
        if system == "bamboo":
            costs = bamboo_costs([path for path, _, _ in runs])
            flags = a.bamboo_flags.split()
            policy = flags[flags.index("--redundancy") + 1] if "--redundancy" in flags else "lazy"
        elif system == "torchrun":
            costs, policy = torchrun_costs(runs, a.boot_s), "torchrun"
        else:
            costs = torchft_costs(runs, a.boot_s, step_s, job.workers, cores, a.torchft_stages)
            policy = "torchft"
        # the depth Bamboo ran at: under --bamboo-stages auto, the one its planner chose
        stages = free.get("config", {}).get("stages", 1) if a.bamboo_stages == "auto" else a.bamboo_stages
        model, used = model_for(system, job, stages, step_s, costs, a.torchft_stages)
        config = SimConfig(alloc_delay_s=a.boot_s, checkpoint_every_steps=a.checkpoint_every,
                           torchrun_min_nodes=job.workers, shared_cores=cores,
                           fallback_every_s=costs.get("checkpoint_every", 0) * step_s)
        print(f"{system} ({policy}): step {step_s * 1000:.1f} ms, costs "
              + ", ".join(f"{k} {v:.3g}" for k, v in costs.items()), file=sys.stderr)
        cells.append(Cell(system, "failure-free", 0, free["samples"] / free["wall_s"],
                          predict(policy, model, config, used, [], free["wall_s"]), step_s))
        for name, path, kills, rec in killed:
            sent = kills_sent(rec, kills)
            own = pace(system, path, kills, sent, job.steps) or step_s
            paced, _ = model_for(system, job, stages, own, costs, a.torchft_stages)
            label = f"{name} (calibration)" if name == mine.calibrate_on else name
            cells.append(Cell(system, label, sent, rec["samples"] / rec["wall_s"],
                              predict(policy, paced, config, used, kills[:sent], rec["wall_s"]), own))
    lines = ["| kills | system | kills sent | step s (input) | measured samples/s | predicted | error |",
             "|---|---|---|---|---|---|---|"]
    for c in sorted(cells, key=lambda c: (c.schedule != "failure-free", c.schedule)):
        lines.append(f"| {c.schedule} | {c.system} | {c.kills} | {c.step_s:.4f} | {c.measured:.1f} | "
                     f"{c.predicted:.1f} | {c.error * 100:+.1f}% |")
    text = "\n".join(lines)
    suffix = f"-{mine.calibrate_on.replace(':', '')}" if mine.calibrate_on else ""
    (a.out / f"predicted{suffix}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
