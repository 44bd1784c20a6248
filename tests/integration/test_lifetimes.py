"""Process lifetimes: nothing a run started outlives its `bamboo train` process, whatever
state a worker is in; a lost fork server stops a local run with a line that names it, and
on an agent is the loss of its workers."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from support.agents import agent as start_agent
from support.agents import assert_failure_free, coordinator, stop, wait_step
from support.processes import (
    alive,
    command,
    descendants,
    fork_server,
    kill_all,
    start_training,
    wait_for_steps,
    wait_gone,
)
from support.procs import free_port, run_events


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_nothing_outlives_a_killed_launcher_while_a_worker_is_stopped(tmp_path: Path) -> None:
    """SIGKILL of `bamboo train` while a worker is frozen (SIGSTOP): the fork server, the
    resource tracker and every worker, the stopped one too, are gone within seconds (well
    within the lease), not left until the stopped worker is continued."""
    out = tmp_path / "run"
    proc = start_training(out, "--lease", "5")
    wait_for_steps(out, proc)
    family = descendants(proc.pid)
    workers = [e["pid"] for e in run_events(out) if e["event"] == "node_up"]
    assert set(workers) <= set(family) and len(family) >= len(workers) + 2, family
    os.kill(workers[0], signal.SIGSTOP)
    try:
        proc.kill()
        proc.communicate(timeout=30)
        left = wait_gone(family, timeout=5)
        assert left == [], [command(p) for p in left]
    finally:
        kill_all([p for p in family if alive(p)])


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_a_killed_fork_server_stops_the_run_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = start_training(out)
    wait_for_steps(out, proc)
    family = descendants(proc.pid)
    server = fork_server(proc.pid)
    try:
        os.kill(server, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
        assert time.monotonic() - killed < 10
        assert proc.returncode == 1
        assert "Traceback" not in stderr and "code 255 before finishing" not in stderr, stderr
        error = [line for line in stderr.splitlines() if "error:" in line]
        assert len(error) == 1 and error[0].startswith(
            f"bamboo train: error: the fork server (pid {server}) that starts the local "
            f"workers was killed by SIGKILL, and every local worker died with it"), stderr
        assert wait_gone(family, timeout=10) == []
    finally:
        kill_all([p for p in family if alive(p)])


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_an_agents_killed_fork_server_is_a_loss_of_its_workers(tmp_path: Path) -> None:
    """On an agent, a killed fork server takes its workers with it: the agent reports them
    killed (not "exited with code 255", a software error that would stop the run), names
    the fork server, and its next workers come from a fresh one; the run restores and ends
    equal to the failure-free run."""
    out, port = tmp_path / "run", free_port()
    coord = coordinator(out, port, "--nodes", "2", "--stages", "2", "--pipelines", "1",
                         "--steps", "14", "--checkpoint-every", "3")
    agent = None
    try:
        deadline = time.monotonic() + 60
        while not (out / "join-token").exists():
            assert time.monotonic() < deadline and coord.poll() is None, "no join token"
            time.sleep(0.1)
        agent = start_agent(out, port, "--workers", "2")
        wait_step(out, 4, coord)
        os.kill(fork_server(agent.pid), signal.SIGKILL)
        stdout, stderr = coord.communicate(timeout=180)
        if coord.returncode != 0:
            stop([agent])
        agent_err = agent.communicate(timeout=30)[1]
        assert coord.returncode == 0, (stderr[-2000:], agent_err[-3000:])
    finally:
        stop([p for p in (coord, agent) if p is not None])
    summary = json.loads(stdout)
    assert_failure_free(summary, nodes=2, stages=2, pipelines=1, steps=14)
    assert summary["preemptions"] == 2, summary
    assert "fork server" in agent_err and "was killed by SIGKILL" in agent_err, agent_err
