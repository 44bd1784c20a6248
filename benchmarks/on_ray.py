"""Bamboo on a Ray cluster of this machine against the same job on local processes.

A real Ray cluster (`ray.cluster_utils.Cluster`: a head with no CPU and one-CPU raylets, on
loopback) and, in one invocation:

(a) failure-free: the same job (`bamboo train`, one node per raylet) on Ray and on local
    worker processes, alternating, `--reps` times each: the median step's wall time over the
    steps after the first `--warm` (events.jsonl `step_done` `wall_s`), and the ratio
    local / Ray (goal >= 0.97: Ray costs at most 3% of the step);
(b) a raylet and every process under it SIGKILLed after step `--kill-after`, with a fifth
    raylet that joined earlier standing by: the seconds from the SIGKILL to the next step
    done, against the median step, and from the new raylet's start to its node's `node_up`
    (its worker started) and to its `standby` event (ready to fill a hole).

The workers, raylets and the coordinator share the machine's cores; say how many when
quoting a figure.

    .venv/bin/python benchmarks/on_ray.py --reps 3 --steps 30
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only, for drivers started here

from ray.cluster_utils import Cluster

from bamboo.chaos.ray_nodes import kill_ray_node

REPO = Path(__file__).resolve().parents[1]


def events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train(out: Path, args: argparse.Namespace, steps: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bamboo", "train", "--model", args.model, "--nodes",
           str(args.nodes), "--stages", str(args.stages), "--steps", str(steps), "--json",
           "--quiet", "--no-report", "--out", str(out), *extra]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> dict:
    stdout, stderr = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"a run failed: {stderr.strip()[-400:]}")
    return json.loads(stdout)


def median_step(out: Path, warm: int) -> float:
    walls = [e["wall_s"] for e in events(out) if e["event"] == "step_done" and e["step"] >= warm]
    return statistics.median(walls)


def wait_for(pred, timeout: float = 300.0, poll: float = 0.02) -> float:  # type: ignore[no-untyped-def]  # a predicate of any shape
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting")
        time.sleep(poll)
    return time.monotonic()


def failure_free(cluster: Cluster, args: argparse.Namespace, tmp: Path) -> None:
    ray_s, local_s = [], []
    for rep in range(args.reps):
        for where in ("ray", "local"):
            out = tmp / f"{where}-{rep}"
            extra = ("--ray", cluster.address) if where == "ray" else ()
            summary = finish(train(out, args, args.steps, *extra))
            step = median_step(out, args.warm)
            (ray_s if where == "ray" else local_s).append(step)
            print(f"  {where:5} rep {rep}: median step {step * 1000:.0f} ms, last loss "
                  f"{summary['losses'][-1]:.4f}, param_sha256 {summary['param_sha256'][:12]}",
                  flush=True)
    ray_m, local_m = statistics.median(ray_s), statistics.median(local_s)
    print(f"(a) failure-free, median of {args.reps}: Ray {ray_m * 1000:.0f} ms, local "
          f"{local_m * 1000:.0f} ms a step: local / Ray = {local_m / ray_m:.3f} (goal >= 0.97); "
          f"per repetition " + ", ".join(f"{lo / r:.3f}" for lo, r in zip(local_s, ray_s)))


def kill_and_join(cluster: Cluster, args: argparse.Namespace, tmp: Path) -> None:
    out = tmp / "kill"
    proc = train(out, args, args.steps, "--ray", cluster.address, "--max-nodes",
                 str(args.nodes + 1))
    wait_for(lambda: any(e["event"] == "step_done" and e["step"] >= 2 for e in events(out)))
    started = time.monotonic()
    joined = cluster.add_node(num_cpus=1)
    up = wait_for(lambda: any(e.get("ray_node_id") == joined.node_id for e in events(out)
                              if e["event"] == "node_up"))
    name = next(e["node"] for e in events(out)
                if e["event"] == "node_up" and e.get("ray_node_id") == joined.node_id)
    ready = wait_for(lambda: any(e["event"] == "standby" and e["node"] == name
                                 for e in events(out)))
    print(f"(b) a new raylet: {up - started:.2f} s from its start (ray start) to its node's "
          f"node_up (its worker started), {ready - started:.2f} s to standing by (ready, "
          f"torch imported and the model built while the others train)", flush=True)
    wait_for(lambda: any(e["event"] == "step_done" and e["step"] >= args.kill_after
                         for e in events(out)))
    ups = {e["node"]: e["ray_node_id"] for e in events(out) if e["event"] == "node_up"}
    active = [e["node"] for e in events(out) if e["event"] == "role" and e["stage"] is not None]
    victim = next(n for n in active if ups[n] != joined.node_id)
    node = next(n for n in cluster.list_all_nodes() if n.node_id == ups[victim])
    done_before = max(e["step"] for e in events(out) if e["event"] == "step_done")
    killed = time.monotonic()
    kill_ray_node(cluster, node)
    went_on = wait_for(lambda: any(e["event"] == "step_done" and e["step"] > done_before
                                   for e in events(out)))
    summary = finish(proc)
    step = median_step(out, args.warm)
    lost = [e for e in events(out) if e["event"] == "node_lost"]
    print(f"    raylet of {victim} SIGKILLed with its processes after step {done_before}: "
          f"{went_on - killed:.2f} s to the next step done (median step "
          f"{step * 1000:.0f} ms); handled as {[e['handled_as'] for e in lost]}, "
          f"pause_s {[e.get('pause_s') for e in lost]}; ended with {summary['steps_completed']} "
          f"steps, loss {summary['losses'][-1]:.4f}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warm", type=int, default=3, help="steps left out of the median")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kill-after", type=int, default=10)
    args = p.parse_args()
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        print(f"Ray cluster {cluster.address}: a head and {args.nodes} one-CPU raylets on "
              f"{os.cpu_count()} cores; job {args.model}, {args.nodes} nodes, {args.stages} "
              f"stages, {args.steps} steps", flush=True)
        with tempfile.TemporaryDirectory(prefix="bamboo-on-ray-") as tmp:
            failure_free(cluster, args, Path(tmp))
            kill_and_join(cluster, args, Path(tmp))
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
