"""torchft with a pipeline in each replica group (P >= 2): D = W / P groups of P stage
processes (`ft_pipe_worker`), the driver's Lighthouse, each kill's worker mapped to group
w // P, stage w % P. A group that loses a stage is lost whole (its other stages are ended) and
started again `boot_s` later; it heals from the other groups, and where every group was lost at
once (no state left: torchft keeps no checkpoint here) training begins again at step 0. The
run's record is put together from every group's commits: each step's loss and participants
from its latest commit (the lineage that finished); the final parameters from a group that
finished."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from benchmarks.peers.job import ENV, Job, param_digest
from benchmarks.peers.report import Kill
from benchmarks.peers.systems import REPO, drive_kills, lighthouse_server, read_json, with_t0

GRACE_S = 30.0  # after the first group finishes, the others have this long to finish


def lineage(commits: list[dict], steps: int) -> tuple[list[dict] | None, int]:
    """Of every group's commits ({"step", "t", ...}), the latest of each step (the lineage
    that finished) in step order, or None where a step is missing; and how many times
    training began again from an earlier step (every group lost at once: no state left)."""
    commits = sorted(commits, key=lambda c: c["t"])
    latest = {c["step"]: c for c in commits}
    again = sum(1 for a, b in zip(commits, commits[1:]) if b["step"] < a["step"] - 1)
    if sorted(latest) != list(range(steps)):
        return None, again
    return [latest[k] for k in range(steps)], again


def run_torchft_pipelines(job: Job, out: Path, kills: list[Kill], boot_s: float, stall_s: float,
                          stages: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    groups = job.workers // stages
    lighthouse = lighthouse_server()
    env = dict(os.environ, **{ENV: job.to_env(), "TORCHFT_LIGHTHOUSE": lighthouse.address()})
    procs: dict[tuple[int, int], subprocess.Popen] = {}
    started: set[int] = set()
    booting: set[int] = set()  # groups lost, waiting for their replacement to boot
    log = (out / "log.txt").open("w")
    port = [29700 + (os.getpid() % 100) * 50]
    lock = threading.Lock()

    def start(group: int) -> None:
        with lock:
            for s in range(stages):  # what is left of the group's last incarnation
                old = procs.get((group, s))
                if old is not None and old.poll() is None:
                    old.kill()
            port[0] += 1
            for s in range(stages):
                procs[(group, s)] = subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.peers.ft_pipe_worker", str(out), str(group),
                     str(s), str(stages), str(port[0]), str(int(group in started))],
                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            started.add(group)
            booting.discard(group)

    def kill(i: int) -> None:
        group, stage = divmod(kills[i].worker, stages)
        with lock:
            if group in booting:  # already lost with its group: this kill is that loss
                return
            if procs[(group, stage)].poll() is not None:
                raise ProcessLookupError(kills[i].worker)
            procs[(group, stage)].send_signal(signal.SIGKILL)
            for s in range(stages):  # the group is lost whole
                procs[(group, s)].kill()
            booting.add(group)
        threading.Timer(boot_s, start, args=(group,)).start()

    def progress() -> dict | None:
        seen = [p for g in range(groups) if (p := read_json(out / f"progress.{g}.json")) is not None]
        if not seen:
            return None
        return {"step": max(p["step"] for p in seen), "t": min(p["t"] for p in seen)}

    first: list = [None]

    done_at: list = [None]

    def running() -> bool:
        if time.time() > t_launch + stall_s:
            return False
        if done_at[0] is None and any((out / f"result.{g}.json").exists() for g in range(groups)):
            done_at[0] = time.time()
        alive = bool(booting) or any(p.poll() is None for p in procs.values())
        return alive and (done_at[0] is None or time.time() < done_at[0] + GRACE_S)

    t_launch = time.time()
    for g in range(groups):
        start(g)
    t0, sent = drive_kills(kills, lambda: with_t0(progress, first), kill, running)
    end = time.time()
    time.sleep(boot_s + 1)  # a group started late finishes or is ended here
    with lock:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
    lighthouse.shutdown()
    finished = [g for g in range(groups) if (out / f"result.{g}.json").exists()
                and all((out / f"params.{g}.{s}.pt").exists() for s in range(stages))]
    if not finished:
        raise RuntimeError(f"torchft (pipelines) failed or hung: see {out / 'log.txt'}")
    g = finished[0]
    result = read_json(out / f"result.{g}.json")
    commits = []
    for h in range(groups):
        path = out / f"steps.{h}.jsonl"
        commits += [json.loads(x) for x in (path.read_text().splitlines() if path.exists() else [])]
    ordered, from_scratch = lineage(commits, job.steps)
    if ordered is None:
        raise RuntimeError(f"torchft (pipelines): steps missing from every group's log in {out}")
    params = [q for s in range(stages) for q in torch.load(out / f"params.{g}.{s}.pt")]
    model = torch.nn.ParameterList([torch.nn.Parameter(q) for q in params])
    share = job.global_batch / groups
    return {"losses": [c["loss"] for c in ordered], "steps_completed": job.steps,
            "t_end": result["t_end"], **param_digest(model),
            "wall_s": result["t_end"] - (t0 or t_launch), "launch_s": end - t_launch,
            "kills_sent": sent, "samples": sum(c["participants"] * share for c in ordered),
            "participants": [c["participants"] for c in ordered], "record_group": g,
            "restarts_from_scratch": from_scratch}
