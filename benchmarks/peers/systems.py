"""Each system run once on the job, failure-free or under the kill schedule, measured from
outside: Bamboo (`bamboo train --json`, its kills from a generated trace replayed at the
same wall times), torchrun elastic + DCP, and torchft with the driver's Lighthouse.
Each kill hits the worker `report.assign_workers` gave it, never worker 0, whose record is
whole."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.peers.job import ENV, Job
from benchmarks.peers.report import Kill, bamboo_trace

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STALL_S = 240.0  # default: a torchft replica 0 not finished by then has hung, the run failed


def lighthouse_server():
    """torchft's Lighthouse for one run, in this process. Its per-quorum INFO lines would fill
    the driver's terminal: warnings only, unless RUST_LOG says otherwise (the workers
    inherit it; their logs go to each run's log.txt)."""
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10000)


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None while it is not (yet) there whole."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def drive_kills(kills: list[Kill], progress: Callable[[], dict | None],
                kill: Callable[[int], None], running: Callable[[], bool]) -> tuple[float | None, int]:
    """Sends the schedule's kills while `running()`; returns when the first step began and
    how many kills were sent (none after the run ended)."""
    t0, sent = None, 0
    for i, k in enumerate([Kill(0, "s")] + kills):
        while running():
            p = progress()
            if t0 is None and p is not None:
                t0 = p["t0"]
            if t0 is not None and (k.at <= (time.time() - t0 if k.unit == "s" else p["step"])):
                break
            time.sleep(0.02)
        if not running():
            break
        while i > 0 and running():  # a victim still booting is killed once it is up
            try:
                kill(i - 1)
                sent += 1
                break
            except (ProcessLookupError, FileNotFoundError):
                time.sleep(0.1)
    while running():
        time.sleep(0.05)
    return t0, sent


def run_bamboo(job: Job, out: Path, kills: list[Kill], boot_s: float, extra: list[str],
               stages: int | str = 1) -> dict:
    """`bamboo train --json` in pipelines of `stages`: its summary, its seconds from the first
    step (when its first generation is ready, trace time 0) to the last step's end as
    `wall_s`, the whole process's as `launch_s`. A kill of worker w in steps is `--kill`
    of pipeline w // stages, stage w % stages."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(BIN / "bamboo"), "train", *job.bamboo_flags(stages), "--json", "--out",
           str(out / "run"), *extra]
    if kills and kills[0].unit == "s":
        (out / "trace.csv").write_text(bamboo_trace(kills, job.workers, boot_s))
        cmd += ["--trace", str(out / "trace.csv"), "--time-scale", "1", "--boot-s", "0",
                "--max-nodes", str(job.workers)]
    else:
        if kills and stages == "auto":
            raise ValueError("kills by step need a fixed number of stages")
        for k in kills:
            cmd += ["--kill", f"{k.worker // int(stages)}:{k.worker % int(stages)}@{int(k.at)}"]
    start = time.time()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    (out / "stderr.txt").write_text(done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"bamboo train failed ({done.returncode}): {done.stderr[-400:]}")
    summary = json.loads(done.stdout)
    events = [json.loads(line) for line in (out / "run" / "events.jsonl").read_text().splitlines()]
    ready = next(e["t"] for e in events if e["event"] == "generation_ready")
    last = max(e["t"] for e in events if e["event"] == "step_done")
    return summary | {"launch_s": time.time() - start, "wall_s": last - ready,
                      "startup_s": ready}


def run_torchrun(job: Job, out: Path, kills: list[Kill], boot_s: float, every: int) -> dict:
    """torchrun elastic, DCP every `every` steps; a kill restarts every worker from the
    newest checkpoint after `boot_s`."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **{ENV: job.to_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(job.workers),
           "--max-restarts", str(len(kills) + 1), "-m", "benchmarks.peers.ddp_worker",
           str(out), str(every), str(boot_s)]
    start = time.time()
    with (out / "log.txt").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def kill(i: int) -> None:
        pid = int((out / f"pid.{kills[i].worker}").read_text())
        os.kill(pid, signal.SIGKILL)

    first: list = [None]
    t0, sent = drive_kills(kills, lambda: with_t0(lambda: read_json(out / "progress.json"), first), kill,
                     lambda: proc.poll() is None)
    end = time.time()
    result = read_json(out / "result.json")
    if proc.returncode != 0 or result is None:
        raise RuntimeError(f"torchrun failed ({proc.returncode}): see {out / 'log.txt'}")
    return result | {"wall_s": result["t_end"] - (t0 or start), "launch_s": end - start, "kills_sent": sent,
                     "samples": job.steps * job.global_batch}


def with_t0(read: Callable[[], dict | None], first: list) -> dict | None:
    """`read()`'s progress with `t0`, the time step 0 began (kept from its first reading)."""
    p = read()
    if p is None:
        return None
    if first[0] is None:
        first[0] = p["t"]
    return p | {"t0": first[0]}


def run_torchft(job: Job, out: Path, kills: list[Kill], boot_s: float,
                stall_s: float = STALL_S) -> dict:
    """W replica groups of one process with the driver's Lighthouse; a killed replica is
    started again `boot_s` later and heals from a peer. Replica 0's record is the run's."""
    out.mkdir(parents=True, exist_ok=True)
    lighthouse = lighthouse_server()
    env = dict(os.environ, **{ENV: job.to_env(), "TORCHFT_LIGHTHOUSE": lighthouse.address()})
    procs: dict[int, subprocess.Popen] = {}
    log = (out / "log.txt").open("w")
    port = [29700 + (os.getpid() % 100) * 50]

    def start(replica: int) -> None:
        port[0] += 1
        procs[replica] = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.peers.ft_worker", str(out), str(replica), str(port[0]),
             str(int(replica in procs))],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def kill(i: int) -> None:
        replica = kills[i].worker
        if procs[replica].poll() is not None:
            raise ProcessLookupError(replica)
        procs[replica].send_signal(signal.SIGKILL)
        threading.Timer(boot_s, start, args=(replica,)).start()

    t_launch = time.time()
    for r in range(job.workers):
        start(r)
    first: list = [None]
    t0, sent = drive_kills(kills, lambda: with_t0(lambda: read_json(out / "progress.0.json"), first), kill,
                     lambda: procs[0].poll() is None and time.time() < t_launch + stall_s)
    end = time.time()
    time.sleep(boot_s + 1)  # a replica started late finishes or is ended here
    for p in procs.values():
        if p.poll() is None:
            p.kill()
        p.wait()
    lighthouse.shutdown()
    result = read_json(out / "result.0.json")
    if procs[0].returncode != 0 or result is None:
        raise RuntimeError(f"torchft failed or hung ({procs[0].returncode}): see {out / 'log.txt'}")
    share = job.global_batch / job.workers
    steps = [json.loads(line) for line in (out / "steps.0.jsonl").read_text().splitlines()]
    return result | {"wall_s": result["t_end"] - (t0 or t_launch), "launch_s": end - t_launch, "kills_sent": sent,
                     "samples": sum(s["participants"] * share for s in steps),
                     "participants": [s["participants"] for s in steps]}
