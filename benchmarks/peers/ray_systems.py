"""The peers' job on a real Ray cluster of this machine, for `benchmarks.peers.run`'s systems
`ray-train` and `bamboo-ray`: each run gets a cluster of its own (`ray.cluster_utils.Cluster`:
a head with no CPU and one one-CPU raylet a worker, on loopback), and each kill of the
schedule SIGKILLs a raylet with every process under it (a machine lost), a new raylet
starting `boot_s` later (capacity back, as a spot pool refills).

- `ray-train`: `TorchTrainer` (DDP over gloo, one worker a raylet), a checkpoint every
  `every` steps (`ray.train.report` with rank 0's state), `FailureConfig(max_failures=...)`:
  its elastic restart of the whole worker group from the newest checkpoint after a loss.
- `bamboo-ray`: `bamboo train --ray ADDRESS` with the job's flags.

Each record has what the harness's other systems report (samples, the seconds from the first
step to the last step's end as `wall_s`, the whole run's as `launch_s`, losses, param_l2 and
param_sha256, the kills sent)."""
from __future__ import annotations

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
from typing import Any

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only, in drivers started here

from benchmarks.peers.job import Job
from benchmarks.peers.report import Kill

from bamboo.chaos.ray_nodes import kill_ray_node, processes_under

REPO = Path(__file__).resolve().parents[2]
RAY_SYSTEMS = ("bamboo-ray", "ray-train")


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
        if rank == 0:
            write_json(out / "progress.json", {"step": step, "t": time.time()})
        losses.append(parts.ddp_step(model, step, rank, world))
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
    """SIGKILL a raylet (and everything under it) at each kill's seconds after the run's first
    step, and start a new raylet `back_s` later. Runs in the main thread (Ray starts a
    raylet only from there) while the system trains in another thread or process."""

    def __init__(self, cluster: Any, kills: list[Kill], back_s: float) -> None:
        self.cluster, self.at_s, self.back_s = cluster, [k.at for k in kills], back_s
        self.first_step: float | None = None
        """time.time() when the first step was seen."""
        self.killed: list[float] = []
        """Seconds after the first step of each kill."""
        self.added: list[float] = []
        """... and of each new raylet."""

    def run(self, first_step: Callable[[], bool], finished: Callable[[], bool]) -> None:
        while not first_step():
            if finished():
                return
            time.sleep(0.05)
        self.first_step = time.time()
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
                    kill_ray_node(self.cluster, victim)
            else:
                self.cluster.add_node(num_cpus=1)
                self.added.append(round(time.monotonic() - t0, 1))

    def _busiest(self) -> Any:
        """A raylet running a training process (the one with the most processes under it)."""
        raylets = [n for n in self.cluster.list_all_nodes() if n is not self.cluster.head_node]
        return max(raylets, key=processes_under, default=None)


def run_on_ray(system: str, job: Job, out: Path, kills: list[Kill], boot_s: float,
               every: int, stages: int | str) -> dict:
    """One run of `system` (RAY_SYSTEMS) on a cluster of its own, torn down after it."""
    from ray.cluster_utils import Cluster
    out = out.resolve()  # Ray Train's storage path and its workers need it absolute
    out.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(job.workers):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        if system == "ray-train":
            return _ray_train(cluster, job, out, Kills(cluster, kills, boot_s), every)
        return _bamboo(cluster, job, out, Kills(cluster, kills, boot_s), stages)
    finally:
        cluster.shutdown()


def _ray_train(cluster: Any, job: Job, out: Path, kills: Kills, every: int) -> dict:
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 [str(REPO), os.environ.get("PYTHONPATH", "")])}})
    trainer = TorchTrainer(
        train_loop, train_loop_config={"job": asdict(job), "every": every, "out": str(out)},
        scaling_config=ScalingConfig(num_workers=job.workers, use_gpu=False,
                                     resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(out / "storage"), name="peers",
                             failure_config=FailureConfig(max_failures=len(kills.at_s) + 2),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    outcome: dict = {}

    def fit() -> None:
        try:
            trainer.fit()
        except Exception as e:  # noqa: BLE001 - reported as the run's outcome
            outcome["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"

    start = time.time()
    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    first = out / "progress.json"
    kills.run(first.exists, lambda: not thread.is_alive())
    thread.join()
    end = time.time()
    ray.shutdown()
    if "error" in outcome:
        raise RuntimeError(f"Ray Train failed: {outcome['error']}")
    result = json.loads((out / "result.json").read_text())
    attempts = (out / "attempts.jsonl").read_text().splitlines()
    t0 = kills.first_step or start
    return result | {"wall_s": result["t_end"] - t0, "launch_s": end - start,
                     "kills_sent": len(kills.killed), "attempts": len(attempts),
                     "samples": job.steps * job.global_batch, "killed_at": kills.killed,
                     "added_at": kills.added}


def _bamboo(cluster: Any, job: Job, out: Path, kills: Kills, stages: int | str) -> dict:
    run = out / "run"
    cmd = [sys.executable, "-m", "bamboo", "train", "--ray", cluster.address,
           *job.bamboo_flags(stages), "--json", "--quiet", "--no-report", "--out", str(run)]
    events = run / "events.jsonl"
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    kills.run(lambda: events.exists() and '"step_done"' in events.read_text(),
              lambda: proc.poll() is not None)
    stdout, stderr = proc.communicate(timeout=1800)
    end = time.time()
    (out / "stderr.txt").write_text(stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"bamboo train --ray failed ({proc.returncode}): {stderr[-400:]}")
    summary = json.loads(stdout)
    records = [json.loads(line) for line in events.read_text().splitlines()]
    ready = next(e["t"] for e in records if e["event"] == "generation_ready")
    last = max(e["t"] for e in records if e["event"] == "step_done")
    return summary | {"wall_s": last - ready, "launch_s": end - start, "startup_s": ready,
                      "kills_sent": len(kills.killed), "killed_at": kills.killed,
                      "added_at": kills.added,
                      "handled": [e["handled_as"] for e in records if e["event"] == "node_lost"]}
