"""Goodput against Ray Train on the same Ray cluster, job and kills.

A real Ray cluster of this machine (`ray.cluster_utils.Cluster`: a head with no CPU and
`--workers` one-CPU raylets, on loopback) runs the peers' job (`benchmarks.peers.job`: bamboo's
model, data, seed, global batch and AdamW) twice, the same way each time: `--kills` raylets,
each SIGKILLed with every process under it at fixed seconds after the run's first step, a new
raylet started `--back-s` seconds after each kill (capacity back, as a spot pool refills).

- Ray Train: `TorchTrainer` (DDP over gloo, one worker a raylet), a checkpoint every
  `--every` steps (`ray.train.report` with rank 0's state), `FailureConfig(max_failures=...)`:
  its elastic restart of the whole worker group from the newest checkpoint after a loss.
- Bamboo: `bamboo train --ray ADDRESS` with the job's flags (`--stages auto`).

Goodput: steps of the job per second of wall time, from the call (`fit()`, the command) to the
result; each system's losses are checked against the job's failure-free run when it is given
(`--check`). Say how many cores the raylets share when quoting a figure.

    .venv/bin/python -m benchmarks.peers.ray_train --model gpt2-mini --steps 60 --kills 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only, in drivers started here

from benchmarks.peers.job import Job
from ray.cluster_utils import Cluster

from bamboo.chaos.ray_nodes import kill_ray_node, processes_under

REPO = Path(__file__).resolve().parents[2]


def train_loop(config: dict) -> None:
    """Ray Train's worker: the job's share of each step under DDP, a checkpoint every
    `every` steps, and on every (re)start the newest checkpoint loaded."""
    import ray.train
    import ray.train.torch
    import torch
    from benchmarks.peers.job import Parts, param_digest, write_json

    job, every, out = Job(**config["job"]), config["every"], Path(config["out"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    parts = Parts(job)
    start, losses = 0, []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=False)
        parts.model.load_state_dict(state["model"])
        parts.optimizer.load_state_dict(state["optim"])
        start, losses = state["step"], state["losses"]
    if rank == 0:
        with (out / "attempts.jsonl").open("a") as log:
            log.write(json.dumps({"from_step": start, "t": time.time()}) + "\n")
    model = ray.train.torch.prepare_model(parts.model)
    for step in range(start, job.steps):
        losses.append(parts.ddp_step(model, step, rank, world))
        if rank == 0:
            write_json(out / "progress.json", {"step": step, "t": time.time()})
        if every and (step + 1) % every == 0 and step + 1 < job.steps:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save({"model": parts.model.state_dict(),
                                "optim": parts.optimizer.state_dict(), "step": step + 1,
                                "losses": losses}, Path(d) / "state.pt")
                ray.train.report({"step": step + 1},
                                 checkpoint=ray.train.Checkpoint.from_directory(d)
                                 if rank == 0 else None)
    if rank == 0:
        write_json(out / "result.json", {"losses": losses, "steps_completed": job.steps,
                                          "t_end": time.time(), **param_digest(parts.model)})


class Kills:
    """SIGKILL a raylet (and everything under it) at each of `at_s` seconds after the run's
    first step, and start a new raylet `back_s` later. Runs in the main thread (Ray starts a
    raylet only from there), while the system trains in another."""

    def __init__(self, cluster: Cluster, at_s: list[float], back_s: float) -> None:
        self.cluster, self.at_s, self.back_s = cluster, at_s, back_s
        self.killed: list[float] = []
        """Seconds after the first step of each kill."""
        self.added: list[float] = []
        """... and of each new raylet."""

    def run(self, first_step: Callable[[], bool], finished: Callable[[], bool]) -> None:
        while not first_step():
            if finished():
                return
            time.sleep(0.05)
        t0 = time.monotonic()
        plan = [(at, "kill") for at in self.at_s] + [(at + self.back_s, "add") for at in self.at_s]
        for at, what in sorted(plan):
            while time.monotonic() < t0 + at:
                if finished():
                    return
                time.sleep(0.05)
            if what == "kill":
                victim = self._busiest()
                if victim is not None:
                    self.killed.append(round(time.monotonic() - t0, 1))
                    self._kill(victim)
            else:
                self.cluster.add_node(num_cpus=1)
                self.added.append(round(time.monotonic() - t0, 1))

    def _kill(self, victim) -> None:  # type: ignore[no-untyped-def]  # ray's Node
        kill_ray_node(self.cluster, victim)

    def _busiest(self):  # type: ignore[no-untyped-def]  # ray's Node
        """A raylet running a training process (the one with the most processes under it)."""
        raylets = [n for n in self.cluster.list_all_nodes() if n is not self.cluster.head_node]
        return max(raylets, key=processes_under, default=None)


def run_ray_train(cluster: Cluster, job: Job, args: argparse.Namespace, out: Path) -> dict:
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    out.mkdir(parents=True)
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 [str(REPO), os.environ.get("PYTHONPATH", "")])}})
    trainer = TorchTrainer(
        train_loop, train_loop_config={"job": asdict(job), "every": args.every, "out": str(out)},
        scaling_config=ScalingConfig(num_workers=job.workers, use_gpu=False,
                                     resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(out / "storage"), name="peers",
                             failure_config=FailureConfig(max_failures=args.kills + 2),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    kills = Kills(cluster, args.kill_at, args.back_s)
    outcome: dict = {}

    def fit() -> None:
        try:
            trainer.fit()
        except Exception as e:  # noqa: BLE001 - reported as the run's outcome
            outcome["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"

    t = time.monotonic()
    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    kills.run(lambda: (out / "progress.json").exists(), lambda: not thread.is_alive())
    thread.join()
    wall = time.monotonic() - t
    ray.shutdown()
    if "error" in outcome:
        raise SystemExit(f"Ray Train failed: {outcome['error']}")
    result = json.loads((out / "result.json").read_text())
    attempts = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    return {"wall_s": wall, "losses": result["losses"], "param_sha256": result["param_sha256"],
            "attempts": len(attempts), "kills": kills.killed, "added": kills.added}


def run_bamboo(cluster: Cluster, job: Job, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "bamboo", "train", "--ray", cluster.address,
           *job.bamboo_flags("auto"), "--json", "--quiet", "--no-report", "--out", str(out)]
    kills = Kills(cluster, args.kill_at, args.back_s)
    events = out / "events.jsonl"
    t = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    kills.run(lambda: events.exists() and '"step_done"' in events.read_text(),
              lambda: proc.poll() is not None)
    stdout, stderr = proc.communicate(timeout=1800)
    wall = time.monotonic() - t
    if proc.returncode != 0:
        raise SystemExit(f"bamboo failed: {stderr.strip()[-500:]}")
    summary = json.loads(stdout)
    return {"wall_s": wall, "losses": summary["losses"], "param_sha256": summary["param_sha256"],
            "kills": kills.killed, "added": kills.added, "handled": [e["handled_as"] for e in map(
                json.loads, events.read_text().splitlines()) if e["event"] == "node_lost"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-mini")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--every", type=int, default=10, help="Ray Train's checkpoint interval")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--first-kill-s", type=float, default=15.0)
    p.add_argument("--kill-gap-s", type=float, default=25.0)
    p.add_argument("--back-s", type=float, default=10.0)
    p.add_argument("--systems", default="bamboo,ray-train")
    p.add_argument("--out", type=Path, help="keep each system's run here (default: a temporary "
                   "directory, removed)")
    args = p.parse_args()
    args.kill_at = [args.first_kill_s + k * args.kill_gap_s for k in range(args.kills)]
    job = Job(model=args.model, steps=args.steps, micro_batches=args.micro_batches,
              micro_batch_size=args.micro_batch_size, workers=args.workers)
    print(f"job {job.model}, {job.steps} steps, {job.workers} workers, global batch "
          f"{job.global_batch}; kills at {args.kill_at} s after the first step, a new raylet "
          f"{args.back_s:g} s after each; {os.cpu_count()} cores", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bamboo-ray-train-") as scratch:
        tmp = args.out or scratch
        for system in args.systems.split(","):
            cluster = Cluster(initialize_head=True,
                              head_node_args={"num_cpus": 0, "include_dashboard": False})
            try:
                for _ in range(job.workers):
                    cluster.add_node(num_cpus=1)
                cluster.wait_for_nodes()
                run = run_bamboo if system == "bamboo" else run_ray_train
                r = results[system] = run(cluster, job, args, Path(tmp) / system)
            finally:
                cluster.shutdown()
            print(f"{system:10} wall {r['wall_s']:.1f} s, goodput {job.steps / r['wall_s']:.3f} "
                  f"steps/s, killed at {r['kills']} s and raylets added at {r['added']} s after its first step, last loss "
                  f"{r['losses'][-1]:.4f}, param_sha256 {r['param_sha256'][:12]}"
                  + (f", {r['attempts']} attempts" if "attempts" in r else "")
                  + (f", handled {r['handled']}" if "handled" in r else ""), flush=True)
    if len(results) == 2:
        b, t = results["bamboo"], results["ray-train"]
        print(f"goodput bamboo / ray-train: {t['wall_s'] / b['wall_s']:.2f}x (goal >= 2x); "
              f"losses equal to 1e-4: "
              f"{all(abs(x - y) <= 1e-4 * max(1.0, abs(y)) for x, y in zip(b['losses'], t['losses']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
