"""`bamboo train --ray` on a real Ray cluster of this machine (a head and one-CPU raylets):
the same job as on local processes, a raylet killed with every process under it, a drain
for preemption, a raylet that joins mid-run, a killed driver continued with --resume auto,
nothing of a run left on the cluster, and the one-line refusals."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the ray extra (make setup installs it)")

from support.agents import assert_failure_free, start, stop, wait_step
from support.procs import BAMBOO, REPO, run_bamboo, run_events
from support.ray_cluster import RayCluster, wait_gone

RAYLETS = 4
"""One-CPU raylets (machines): a pipeline of 2 stages and room for two standbys."""
JOB = ["--model", "gpt2-tiny", "--nodes", "2", "--stages", "2", "--no-report", "--quiet"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    c = RayCluster(RAYLETS)
    try:
        yield c
    finally:
        c.shutdown()


@pytest.fixture
def ray_cluster(cluster: RayCluster) -> Iterator[RayCluster]:
    """The module's cluster with its raylets back to RAYLETS, none of its actors left."""
    cluster.keep(RAYLETS)
    yield cluster
    cluster.keep(RAYLETS)


def _train(cluster: RayCluster, out: Path, steps: int, *extra: str) -> subprocess.Popen:
    return start(["train", "--ray", cluster.address, *JOB, "--steps", str(steps), "--json",
                  "--out", str(out), *extra])


def _summary(proc: subprocess.Popen, timeout: float = 200) -> dict:
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, stderr
    return json.loads(stdout)


def _ups(out: Path) -> list[dict]:
    return [e for e in run_events(out) if e["event"] == "node_up"]


def _holder(out: Path, pipeline: int, stage: int) -> dict:
    """The node_up event of the node that holds (pipeline, stage) now (by its role events)."""
    held = {}
    for e in run_events(out):
        if e["event"] == "role":
            held[(e["pipeline"], e["stage"])] = e["node"]
    return next(e for e in _ups(out) if e["node"] == held[(pipeline, stage)])


@pytest.mark.timeout(300)
def test_a_run_on_ray_equals_the_same_job_on_local_processes(ray_cluster: RayCluster,
                                                               tmp_path: Path) -> None:
    on_ray = _summary(_train(ray_cluster, tmp_path / "ray", 5))
    local = run_bamboo(["train", *JOB, "--steps", "5", "--json"], tmp_path / "local")
    assert local.code == 0, local.stderr
    local_summary = json.loads(local.stdout)
    assert on_ray["losses"] == local_summary["losses"]
    assert on_ray["param_sha256"] == local_summary["param_sha256"]
    assert_failure_free(on_ray, nodes=2, stages=2, steps=5)
    ups = _ups(tmp_path / "ray")
    raylets = {n.node_id for n in ray_cluster.raylets()}
    assert len(ups) == 2 and {e["ray_node_id"] for e in ups} <= raylets
    assert len({e["ray_node_id"] for e in ups}) == 2  # one node per one-CPU raylet
    assert all(e["machine"] == e["ray_node_id"] for e in ups)  # a Ray node is a machine
    # Nothing of the run stays: its agents are gone, its actors dead.
    assert wait_gone(tmp_path / "ray") == []
    assert "NodeActor" not in ray_cluster.live_actors()


@pytest.mark.timeout(300)
def test_a_raylet_killed_with_its_processes_is_a_preemption_and_one_that_joins_stands_by(
        ray_cluster: RayCluster, tmp_path: Path) -> None:
    out = tmp_path / "run"
    for raylet in ray_cluster.raylets()[2:]:  # two raylets left: the third node waits for room
        ray_cluster.kill(raylet)
    proc = _train(ray_cluster, out, 40, "--max-nodes", "3")  # steps of ~0.3 s: room to join
    try:
        wait_step(out, 2, proc)
        assert len(_ups(out)) == 2
        joined = ray_cluster.add()  # a new machine: the waiting actor lands there
        deadline = time.monotonic() + 60
        while not any(e.get("ray_node_id") == joined.node_id for e in _ups(out)):
            assert time.monotonic() < deadline and proc.poll() is None, "no standby on the new raylet"
            time.sleep(0.2)
        victim = _holder(out, 0, 1)
        killed_at = max(e["step"] for e in run_events(out) if e["event"] == "step_done")
        ray_cluster.kill(ray_cluster.node(victim["ray_node_id"]))
        summary = _summary(proc)
    finally:
        stop([proc])
    assert_failure_free(summary, nodes=2, stages=2, steps=40)
    events = run_events(out)
    lost = [e for e in events if e["event"] == "node_lost"]
    assert [(e["node"], e["ray_node_id"]) for e in lost] == [(victim["node"],
                                                              victim["ray_node_id"])]
    assert lost[0]["step"] >= killed_at and lost[0]["handled_as"] != "drain"
    standby = next(e["node"] for e in _ups(out) if e["ray_node_id"] == joined.node_id)
    roles = [e for e in events if e["event"] == "role" and e.get("node") == standby]
    assert roles, "the node on the new raylet never took a role (it did not fill the hole)"


@pytest.mark.timeout(300)
def test_a_drain_for_preemption_drains_that_node_at_a_step_boundary(ray_cluster: RayCluster,
                                                                     tmp_path: Path) -> None:
    out = tmp_path / "run"
    # A third node stands by on a third raylet, the fourth idle. Steps take ~0.3 s and `ray
    # drain-node` ~2 s to land: 40 steps leave the notice room even on a loaded machine.
    proc = _train(ray_cluster, out, 40, "--max-nodes", "3")
    try:
        wait_step(out, 2, proc)
        victim = _holder(out, 0, 1)
        ray_cluster.drain(victim["ray_node_id"], 30)
        summary = _summary(proc)
    finally:
        stop([proc])
    assert_failure_free(summary, nodes=2, stages=2, steps=40)
    events = run_events(out)
    lost = [e for e in events if e["event"] == "node_lost"]
    assert [(e["node"], e["handled_as"], e["ray_node_id"], e["host"]) for e in lost] == [
        (victim["node"], "drain", victim["ray_node_id"], victim["host"])]
    [notice] = [e for e in events if e["event"] == "notice"]
    assert notice["source"].startswith("ray drain, ") and notice["source"].endswith(" s left")
    assert (notice["node"], notice["ray_node_id"]) == (victim["node"], victim["ray_node_id"])
    assert summary["drains"] == 1 and summary["preemptions"] == 1  # a drain is one


@pytest.mark.timeout(300)
def test_the_driver_killed_then_resume_auto_continues_and_leaves_no_actor(
        ray_cluster: RayCluster, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _train(ray_cluster, out, 16, "--checkpoint-every", "2")
    try:
        wait_step(out, 3, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        # Ray ends the actors a dead driver owned; their agents and workers go with them.
        assert wait_gone(out, timeout=30) == []
        again = _train(ray_cluster, out, 16, "--resume", "auto")
        summary = _summary(again)
    finally:
        stop([proc])
    assert_failure_free(summary, nodes=2, stages=2, steps=16)
    starts = [e for e in run_events(out) if e["event"] == "run_start"]
    assert len(starts) >= 2
    assert wait_gone(out) == []


def _one_line(args: list[str], cwd: Path = REPO, timeout: float = 90,
              env: dict | None = None) -> tuple[int, str, float]:
    t0 = time.monotonic()
    proc = subprocess.run(BAMBOO + args, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return proc.returncode, lines[0], time.monotonic() - t0


@pytest.mark.timeout(120)
def test_no_cluster_at_the_address_is_one_line(tmp_path: Path) -> None:
    from support.procs import free_port
    port = free_port()
    code, line, took = _one_line(["train", "--ray", f"127.0.0.1:{port}", *JOB, "--steps", "2",
                                  "--out", str(tmp_path / "run")])
    assert code != 0 and took < 60
    assert line.startswith(f"bamboo train: error: no Ray cluster at 127.0.0.1:{port}")
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(120)
def test_too_few_resources_for_one_pipeline_stop_naming_what_is_missing(
        ray_cluster: RayCluster, tmp_path: Path) -> None:
    code, line, took = _one_line(["train", "--ray", ray_cluster.address, *JOB, "--steps", "2",
                                  "--ray-resources", "CPU=2", "--ray-wait-s", "5",
                                  "--out", str(tmp_path / "run")])
    assert code != 0 and took < 60
    assert "Ray placed 0/2 nodes within --ray-wait-s 5 s: each asks CPU=2" in line
    assert f"CPU {RAYLETS} (" in line, line  # what the cluster has of it
    assert wait_gone(tmp_path / "run") == []


@pytest.mark.timeout(120)
def test_a_run_directory_the_ray_nodes_cannot_see_is_refused(ray_cluster: RayCluster,
                                                             tmp_path: Path) -> None:
    """The driver's run directory on a tmpfs mounted in its own mount namespace: a path the
    raylets, outside it, do not have (a disk only the driver's machine mounts)."""
    private = tmp_path / "private"
    private.mkdir()
    args = " ".join(BAMBOO + ["train", "--ray", ray_cluster.address, *JOB, "--steps", "2",
                              "--out", str(private / "run")])
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           f"mount -t tmpfs tmpfs {private} && exec {args}"], cwd=REPO,
                          capture_output=True, text=True, timeout=90)
    if "unshare failed" in proc.stderr or "mount:" in proc.stderr:
        pytest.skip(f"no private mount namespace here: {proc.stderr.strip()}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("bamboo train: error: the run directory must be one every Ray "
                               "node can write (a path all nodes mount): on Ray node ")
    assert f"{private}/run does not exist there; give --out such a path" in lines[0]


@pytest.mark.timeout(120)
def test_without_ray_installed_the_flag_names_the_extra(tmp_path: Path) -> None:
    """Ray made unimportable (as where the extra is not installed)."""
    script = ("import sys; sys.modules['ray'] = None; from bamboo.cli import main; "
              f"sys.exit(main(['train', '--ray', 'auto', '--steps', '2', '--out', "
              f"{str(tmp_path / 'run')!r}]))")
    proc = subprocess.run([BAMBOO[0], "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=90, env=dict(os.environ))
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "bamboo train: error: --ray needs Ray, which is not installed here: pip install "
        "'bamboo-train[ray]'"]
