"""The driver: one job under Bamboo, torchrun elastic + DCP and torchft (and, on a Ray
cluster of this machine, Ray Train and Bamboo on Ray), failure-free and under each kill
schedule, repetitions interleaved; a table per schedule (table.md), a plot (peers.png) and
every run's record (results.json) in --out.

    python -m benchmarks.peers.run --kills 8,20 --boot-s 5 --reps 1 --out runs/peers
    python -m benchmarks.peers.run --kills p3-quiet --kills p3-dense --kills every:60 ...
    python -m benchmarks.peers.run --systems bamboo-ray,ray-train --kills 15,40,65 --boot-s 10
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import time
from pathlib import Path

from benchmarks.peers import systems
from benchmarks.peers.job import Job
from benchmarks.peers.ray_systems import RAY_SYSTEMS
from benchmarks.peers.report import (
    Kill,
    Outcome,
    assign_workers,
    judge,
    kills_sent,
    markdown_table,
    named_schedule,
    run_tag,
    summarize,
)

SYSTEMS = ("bamboo", "torchrun", "torchft", *RAY_SYSTEMS)
DEFAULT_SYSTEMS = ("bamboo", "torchrun", "torchft")
P3 = Path(__file__).resolve().parents[2] / "traces" / "aws-p3-2xlarge.csv"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                    help="comma-separated, of " + ", ".join(SYSTEMS) + " (the last two on a Ray "
                    "cluster of this machine, a one-CPU raylet a worker; a kill there is a "
                    "raylet SIGKILLed with its processes)")
    ap.add_argument("--model", default="gpt2-tiny")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--micro-batches", type=int, default=8, help="global, of all workers")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--kills", action="append", help="a schedule (repeatable; default 8,20): "
                    "seconds after the first step (8 or 8s), steps (@15), every:S (a kill every "
                    "S seconds), p3-dense or p3-quiet (the p3 trace's densest or quietest "
                    "--trace-window, --trace-scale times faster)")
    ap.add_argument("--trace-scale", type=float, default=15.0)
    ap.add_argument("--trace-window", type=float, default=1800.0, help="seconds of trace")
    ap.add_argument("--stall-s", type=float, default=systems.STALL_S,
                    help="a torchft run not finished by then has hung: recorded as failed")
    ap.add_argument("--boot-s", type=float, default=5.0, help="seconds before capacity comes back")
    ap.add_argument("--checkpoint-every", type=int, default=10,
                    help="torchrun's DCP and Ray Train's checkpoint interval in steps")
    ap.add_argument("--baseline", help="the system each mean is also given as a multiple of "
                    "(default: torchrun, else ray-train, where run)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--bamboo-stages", type=_stages, default=1, help="Bamboo's pipeline depth P, "
                    "or auto (`bamboo train --stages auto --global-batch-size`: Bamboo picks P, D "
                    "and M; seconds schedules only); the global batch kept; the peers run P=1")
    ap.add_argument("--torchft-stages", type=int, default=1, help="P of each torchft replica "
                    "group: >= 2 runs a torch.distributed.pipelining pipeline in each group")
    ap.add_argument("--pin", action="store_true", help="each worker of every system on a core of "
                    "its own (Bamboo's --pin-cpus auto), as each node has its own accelerator: a "
                    "lost worker's capacity is lost; needs a core per worker")
    ap.add_argument("--bamboo-flags", default="", help="more `bamboo train` flags, e.g. '--redundancy off'")
    ap.add_argument("--out", type=Path, default=Path("runs/peers"))
    ap.add_argument("--report-only", action="store_true", help="rebuild table.md and the plot "
                    "from --out's results.json (the same --kills and --systems) without running")
    a = ap.parse_args(argv)
    a.schedules = []  # (name, what it is, kills with their workers)
    try:
        for spec in a.kills or ["8,20"]:
            kills, what = named_schedule(spec, P3.read_text(), a.trace_scale, a.trace_window)
            if kills:  # `--kills ""`: failure-free runs only
                a.schedules.append((spec, what, assign_workers(kills, a.workers, a.boot_s)))
    except ValueError as e:
        ap.error(str(e))
    a.system_list = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = [s for s in a.system_list if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown system {unknown[0]!r}: choose from {', '.join(SYSTEMS)}")
    ray_systems = [s for s in a.system_list if s in RAY_SYSTEMS]
    if ray_systems and not a.report_only and importlib.util.find_spec("ray") is None:
        ap.error(f"{ray_systems[0]} needs Ray: pip install -e '.[peers]'")
    if ray_systems and any(k.unit != "s" for _, _, ks in a.schedules for k in ks):
        ap.error(f"{ray_systems[0]} takes kills in seconds only (a raylet is killed at a time)")
    if not a.report_only and "torchft" in a.system_list and importlib.util.find_spec("torchft") is None:
        print("torchft is not installed (pip install -e '.[peers]'): left out", file=sys.stderr)
        a.system_list.remove("torchft")
    if a.workers < 2 or a.micro_batches % a.workers:
        ap.error("--micro-batches must be a multiple of --workers (>= 2)")
    if a.pin and a.workers > len(os.sched_getaffinity(0)):
        ap.error(f"--pin needs a core per worker: {a.workers} workers, "
                 f"{len(os.sched_getaffinity(0))} cores (lower --workers)")
    if a.bamboo_stages == "auto" and any(k.unit != "s" for _, _, ks in a.schedules for k in ks):
        ap.error("--bamboo-stages auto takes kills in seconds only: a kill by step (@K) names a "
                 "pipeline and a stage, so give --bamboo-stages P")
    for flag, stages in (("--bamboo-stages", a.bamboo_stages), ("--torchft-stages", a.torchft_stages)):
        if stages == "auto":
            continue
        if stages < 1 or a.workers % stages or a.micro_batches % (a.workers // stages):
            ap.error(f"{flag} must divide --workers, leaving pipelines that divide --micro-batches")
    return a


def _stages(text: str) -> int | str:
    """`--bamboo-stages`: a pipeline depth, or auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of stages or auto") from None


def one_run(a: argparse.Namespace, job: Job, system: str, kills: list[Kill], out: Path) -> dict:
    """The system's record of one run: its summary plus wall_s (first step to end)."""
    if system == "bamboo":
        return systems.run_bamboo(job, out, kills, a.boot_s, shlex.split(a.bamboo_flags),
                                  a.bamboo_stages)
    if system in RAY_SYSTEMS:
        from benchmarks.peers.ray_systems import run_on_ray
        return run_on_ray(system, job, out, kills, a.boot_s, a.checkpoint_every, a.bamboo_stages)
    if system == "torchrun":
        return systems.run_torchrun(job, out, kills, a.boot_s, a.checkpoint_every)
    if a.torchft_stages > 1:
        from benchmarks.peers.ft_pipelines import run_torchft_pipelines
        return run_torchft_pipelines(job, out, kills, a.boot_s, a.stall_s, a.torchft_stages)
    return systems.run_torchft(job, out, kills, a.boot_s, a.stall_s)


def outcome(system: str, record: dict, kills: int, free: dict | None) -> Outcome:
    bits = equal = gap = None
    if free is not None:
        bits, equal, gap = judge(record, free)
    return Outcome(system, record["samples"], record["wall_s"], kills, equal, gap,
                   {k: record.get(k) for k in ("launch_s", "param_l2", "participants",
                                               "preemptions", "kills_sent")}, bits)


def plot(tables: dict[str, list], path: Path) -> None:
    """Bars per system: failure-free, then goodput under each schedule."""
    import matplotlib
    matplotlib.use("Agg")
    from statistics import mean

    import matplotlib.pyplot as plt

    names = list(tables)
    first = tables[names[0]]
    width = 0.8 / (len(names) + 1)
    fig, ax = plt.subplots(figsize=(6 + len(names), 3.5))
    x = range(len(first))
    ax.bar([i - 0.4 for i in x], [mean(r.free_rate) if r.free_rate else 0 for r in first], width,
           label="failure-free", align="edge")
    for j, name in enumerate(names, 1):
        ax.bar([i - 0.4 + j * width for i in x],
               [mean(r.goodput) if r.goodput else 0 for r in tables[name]], width,
               label=f"goodput, {name}", align="edge")
    ax.set_xticks(list(x), [r.system for r in first])
    ax.set_ylabel("samples/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_all(a: argparse.Namespace) -> list[dict]:
    """Every run, repetitions interleaved; results.json rewritten after each."""
    job = Job(model=a.model, steps=a.steps, seed=a.seed, micro_batches=a.micro_batches,
              micro_batch_size=a.micro_batch_size, workers=a.workers, pin=a.pin)
    records: list[dict] = []
    for rep in range(a.reps):
        for name, _, kills in [("free", "", [])] + a.schedules:
            for system in a.system_list:  # interleaved: each system once, then again
                tag = run_tag(system, name if kills else None, rep)
                print(f"{time.strftime('%H:%M:%S')} {tag}", file=sys.stderr, flush=True)
                try:
                    rec = one_run(a, job, system, kills, a.out / tag)
                except RuntimeError as e:  # kept as a failed run: the others still count
                    print(f"{tag}: {e}", file=sys.stderr, flush=True)
                    records.append({"run": tag, "system": system, "error": str(e)})
                    continue
                records.append({"run": tag, "schedule": name, "system": system,
                                **{k: v for k, v in rec.items() if k != "config"}})
                (a.out / "results.json").write_text(json.dumps(records, indent=1, default=str))
    return records


def tables_of(a: argparse.Namespace, records: list[dict]) -> tuple[dict[str, list], dict[str, str]]:
    """The rows of each schedule's table from the runs' records, each run under kills judged
    against its system's first failure-free run."""
    free: list[Outcome] = []
    killed: dict[str, list[Outcome]] = {name: [] for name, _, _ in a.schedules}
    kills_of = {name: kills for name, _, kills in a.schedules}
    first_free: dict[str, dict] = {}
    for rec in records:
        system = rec.get("system") or rec["run"].split("-")[0]
        if "error" in rec and rec["error"] or system not in a.system_list:
            continue
        if rec["schedule"] == "free":
            first_free.setdefault(system, rec)
            free.append(outcome(system, rec, 0, None))
        elif rec["schedule"] in killed:
            kills = kills_of[rec["schedule"]]
            killed[rec["schedule"]].append(outcome(system, rec, kills_sent(rec, kills),
                                                   first_free.get(system)))
    tables = {name: summarize(free, killed[name]) for name, _, _ in a.schedules}
    titles = {name: f"Kills: {what} ({len(kills)} at most)" for name, what, kills in a.schedules}
    if not tables:
        tables, titles = {"free": summarize(free, [])}, {"free": "Failure-free only"}
    return tables, titles


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.report_only:
        try:
            records = json.loads((a.out / "results.json").read_text())
        except (OSError, ValueError) as e:
            print(f"--report-only: cannot read {a.out / 'results.json'} ({e}): run the "
                  "command without --report-only first", file=sys.stderr)
            return 2
    else:
        a.out.mkdir(parents=True, exist_ok=True)
        records = run_all(a)
    tables, titles = tables_of(a, records)
    baseline = a.baseline or next((s for s in ("torchrun", "ray-train") if s in a.system_list),
                                  None)
    text = "\n\n".join(f"{titles[n]}\n\n{markdown_table(rows, baseline=baseline)}"
                        for n, rows in tables.items())
    (a.out / "table.md").write_text(text + "\n")
    plot(tables, a.out / "peers.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
