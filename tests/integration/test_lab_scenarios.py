"""Multi-machine runs on hosts made of network namespaces: a coordinator host and agent
hosts on a bridge, each with its own address (no loopback between them), sharing a run
directory. Every scenario ends equal to the failure-free local run, every loss accounted."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.procs import BAMBOO, REPO, run_events
from support.runs import assert_equal_and_accounted, config

pytestmark = pytest.mark.slow
JOIN = 29400
ENV = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR")


class Job:
    """A coordinator on lab host "coord" and agents on the other hosts."""

    def __init__(self, lab, out: Path, job: list[str], bind: str = "0.0.0.0",
                 coordinator_flags: tuple[str, ...] = ()) -> None:
        self.lab, self.out, self.job = lab, out, job
        self.bind, self.coordinator_flags = bind, coordinator_flags
        self.token = out.parent / f"{out.name}-token"
        self.token.write_text("7" * 64 + "\n")
        self.coord_address = lab["coord"].address
        self.agents: list[subprocess.Popen] = []
        self.coord = self.start_coordinator()

    def start_coordinator(self) -> subprocess.Popen:
        argv = [*BAMBOO, "coordinator", "--bind", f"{self.bind}:{JOIN}", "--token-file",
                str(self.token), "--out", str(self.out), "--resume", "auto", "--json",
                "--quiet", "--no-report", *self.coordinator_flags, *self.job]
        return self.lab.run("coord", argv, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)

    def wait_listening(self, timeout: float = 60) -> None:
        """From an agent host, through the bridge: the join port answers (one TCP probe,
        as a Kubernetes tcpSocket probe would make)."""
        deadline = time.monotonic() + timeout
        probe = ("import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])),"
                 " timeout=2).close()")
        while self.lab.call("a1", [sys.executable, "-c", probe, self.coord_address,
                                   str(JOIN)]).returncode != 0:
            assert time.monotonic() < deadline and self.coord.poll() is None, "never listened"
            time.sleep(0.3)

    def start_agent(self, host: str, *extra: str) -> subprocess.Popen:
        argv = [*BAMBOO, "agent", "--join", f"{self.coord_address}:{JOIN}", "--token-file",
                str(self.token), *extra]
        # a file, not a pipe nobody reads: a chatty agent must never block on its stderr
        log = self.out.parent / f"agent-{host}-{len(self.agents)}.log"
        with log.open("w") as err:
            p = self.lab.run(host, argv, cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=err, text=True, env=ENV)
        p.log = log  # type: ignore[attr-defined]  # the test's note on the process object
        self.agents.append(p)
        return p

    def agents_exit_0(self, timeout: float = 30) -> None:
        """Every agent exits 0 once the run is over; else its last words."""
        for p in self.agents:
            try:
                code = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
            assert code == 0, f"agent exit {code}: {p.log.read_text()[-2000:]}"

    def wait_step(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not any(e["event"] == "step_done" and e["step"] >= step for e in run_events(self.out)):
            assert time.monotonic() < deadline and self.coord.poll() is None, \
                "the run never got there"
            time.sleep(0.2)

    def finish(self, timeout: float = 300) -> dict:
        stdout, stderr = self.coord.communicate(timeout=timeout)
        assert self.coord.returncode == 0, stderr[-3000:]
        return json.loads(stdout)


def _nodes_on(out: Path) -> dict[str, str]:
    return {e["node"]: e["machine"] for e in run_events(out) if e["event"] == "node_up"}


@pytest.mark.timeout(400)
def test_a_plain_run_across_hosts_after_probes_garbage_and_a_wrong_token(lab_factory,
                                                                          tmp_path: Path) -> None:
    lab = lab_factory(3)
    cfg = config(nodes=4, stages=2, steps=6)
    job = Job(lab, tmp_path / "run", ["--nodes", "4", "--stages", "2", "--steps", "6"])
    job.wait_listening()
    garbage = ("import os,socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])),"
               " timeout=5); s.sendall(os.urandom(2048)); s.close()")
    assert lab.call("a2", [sys.executable, "-c", garbage, job.coord_address,
                           str(JOIN)]).returncode == 0
    wrong = lab.call("a2", [*BAMBOO, "agent", "--join", f"{job.coord_address}:{JOIN}",
                            "--token", "0" * 64, "--rejoin-s", "0"], cwd=REPO, env=ENV, timeout=60)
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines() == [
        f"bamboo agent: error: the coordinator at {job.coord_address}:{JOIN} refused the join "
        f"token: use the token it printed (its run directory's join-token file)"]
    job.start_agent("a1", "--workers", "2")
    job.start_agent("a2", "--workers", "2")
    summary = job.finish()
    assert_equal_and_accounted(summary, cfg, lost=0)
    assert len(set(_nodes_on(job.out).values())) == 2
    job.agents_exit_0()


@pytest.mark.timeout(500)
def test_two_hosts_of_four_workers_survive_one_host_cut_off_mid_run(lab_factory,
                                                                     tmp_path: Path) -> None:
    """The issue's end-to-end case: 2 pipelines x 4 stages on two agent hosts of four
    workers each; one host's link goes down mid-step. Its four workers are fenced by their
    lease and failed over by their replicas on the other host, the job goes on there, and
    the cut-off agent, no longer hearing its coordinator, stops its workers."""
    lab = lab_factory(3)
    cfg = config(nodes=8, stages=4, steps=10)
    job = Job(lab, tmp_path / "run", ["--nodes", "8", "--stages", "4", "--steps", "10",
                                      "--lease", "4"])
    job.wait_listening()
    cut = job.start_agent("a1", "--workers", "4", "--rejoin-s", "5")
    job.start_agent("a2", "--workers", "4")
    job.wait_step(3)
    lab.cut("a1")
    summary = job.finish()
    assert_equal_and_accounted(summary, cfg, lost=4)
    assert summary["failovers"] == 4 and summary["checkpoint_restores"] == 0, summary
    fenced = {e["node"] for e in run_events(job.out) if e["event"] == "fenced"}
    machines = _nodes_on(job.out)
    assert len(fenced) == 4 and len({machines[n] for n in fenced}) == 1
    assert cut.wait(timeout=60) == 1  # gave up after its --rejoin-s, workers stopped
    deadline = time.monotonic() + 15  # its fork server follows it out
    while lab.pids("a1") and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120]
            for pid in lab.pids("a1") if Path(f"/proc/{pid}").exists()]
    assert left == [], left


@pytest.mark.timeout(400)
def test_an_agent_host_killed_whole(lab_factory, tmp_path: Path) -> None:
    lab = lab_factory(3)
    cfg = config(nodes=4, stages=2, steps=10)
    job = Job(lab, tmp_path / "run", ["--nodes", "4", "--stages", "2", "--steps", "10",
                                      "--lease", "4"], bind=lab["coord"].address)
    job.wait_listening()
    job.start_agent("a1", "--workers", "2")
    job.start_agent("a2", "--workers", "2")
    job.wait_step(3)
    lab.kill_host("a1")
    summary = job.finish()
    assert_equal_and_accounted(summary, cfg, lost=2)
    assert summary["checkpoint_restores"] == 0


@pytest.mark.timeout(400)
def test_a_bandwidth_capped_host_and_latency_where_the_kernel_has_netem(lab_factory,
                                                                        tmp_path: Path) -> None:
    from bamboo.chaos.lab import NetemUnavailable
    lab = lab_factory(3)
    lab.cap("a1", "20mbit")
    try:
        lab.delay("a2", 5)
    except NetemUnavailable:
        pass  # this kernel lacks netem: the cap alone is exercised
    assert "tbf" in " ".join(lab.qdiscs("a1").values()) or "netem" in " ".join(
        lab.qdiscs("a1").values())
    cfg = config(nodes=4, stages=2, steps=6, kills=["0:1@3"])
    job = Job(lab, tmp_path / "run", ["--nodes", "4", "--stages", "2", "--steps", "6",
                                      "--kill", "0:1@3"],
              coordinator_flags=("--advertise", lab["coord"].address, "--store-port", "29555"))
    job.wait_listening()
    job.start_agent("a1", "--workers", "2")
    job.start_agent("a2", "--workers", "2")
    summary = job.finish()
    assert_equal_and_accounted(summary, cfg, lost=1)
    store = next(e for e in run_events(job.out) if e["event"] == "store")
    assert (store["port"], store["advertised"]) == (29555, lab["coord"].address)


@pytest.mark.timeout(500)
def test_the_coordinator_host_killed_and_restarted_with_resume_auto(lab_factory,
                                                                     tmp_path: Path) -> None:
    lab = lab_factory(3)
    cfg = config(nodes=4, stages=2, steps=12, checkpoint_every=3)
    job = Job(lab, tmp_path / "run", ["--nodes", "4", "--stages", "2", "--steps", "12",
                                      "--checkpoint-every", "3", "--lease", "4"])
    job.wait_listening()
    job.start_agent("a1", "--workers", "2", "--rejoin-s", "120")
    job.start_agent("a2", "--workers", "2", "--rejoin-s", "120")
    job.wait_step(7)
    lab.kill_host("coord")
    killed = time.monotonic()
    job.coord = job.start_coordinator()
    summary = job.finish()
    assert summary["resumed_from_step"] in (3, 6)
    assert_equal_and_accounted(summary, cfg)
    job.agents_exit_0()
    assert time.monotonic() - killed < 300


@pytest.mark.timeout(300)
def test_the_lab_command_runs_a_job_with_a_cut_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """`bamboo lab`, as a user runs it: a coordinator host and three agent hosts of one
    worker each, the third cut off from the start and reconnected 30 s later (its agent
    keeps retrying to join meanwhile); exit 0, the run equal to the failure-free one, and no
    namespace left."""
    from bamboo.chaos.lab import lab_prefix, leftover_namespaces, unsupported_reason
    reason = unsupported_reason()
    if reason is not None:
        pytest.skip(f"a lab of network namespaces cannot be built here: {reason}")
    out = tmp_path / "run"
    # The lab's namespaces are named after the `bamboo lab` process's pid (lab_prefix), so
    # what it left is found by that name, whatever other labs the machine holds meanwhile.
    proc = subprocess.Popen([*BAMBOO, "lab", "--hosts", "4", "--out", str(out), "--cut",
                             "a3@1+30", "--", "--nodes", "2", "--stages", "2", "--pipelines",
                             "1", "--max-nodes", "3", "--steps", "8", "--lease", "4",
                             "--quiet", "--no-report"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV)
    try:
        _, stderr = proc.communicate(timeout=280)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert_equal_and_accounted(summary, config(nodes=2, stages=2, pipelines=1, steps=8))
    assert leftover_namespaces(lab_prefix(proc.pid)) == []


@pytest.mark.timeout(400)
@pytest.mark.parametrize("cut_s", [2.0, 6.0])
def test_a_short_cut_of_the_coordinators_link_mid_run(lab_factory, tmp_path: Path,
                                                      cut_s: float) -> None:
    """The coordinator's link down for 2 s (6 s) mid-run, with a 3 s lease: its nodes are
    fenced (their beats arrive late), while the agents may stay connected (TCP rides out the
    cut) or, having heard nothing for their lease, rejoin. Either way their machines take new
    workers, which restore from live copies or the checkpoint, and the run ends equal to
    the failure-free one instead of waiting for nodes until --comm-timeout."""
    lab = lab_factory(3)
    cfg = config(nodes=4, stages=2, steps=12, checkpoint_every=3)
    job = Job(lab, tmp_path / "run", ["--nodes", "4", "--stages", "2", "--steps", "12",
                                      "--checkpoint-every", "3", "--lease", "3"])
    job.wait_listening()
    for host in ("a1", "a2"):
        job.start_agent(host, "--workers", "2", "--rejoin-s", "60")
    job.wait_step(4)
    lab.cut("coord")
    time.sleep(cut_s)
    lab.reconnect("coord")
    summary = job.finish(timeout=240)
    assert_equal_and_accounted(summary, cfg)
    assert any(e["event"] == "fenced" for e in run_events(job.out)), "the cut fenced no node"
    job.agents_exit_0()


@pytest.mark.timeout(300)
def test_a_frozen_agent_host_with_every_node_ends_naming_the_wait(lab_factory,
                                                                 tmp_path: Path) -> None:
    """The only agent host freezes whole (SIGSTOP): its nodes are fenced, no worker is
    confirmed gone and none is offered. The stall watchdog stops the run, naming what it
    waited for, not a slow step."""
    lab = lab_factory(2)
    job = Job(lab, tmp_path / "run", ["--nodes", "2", "--stages", "2", "--steps", "40",
                                      "--checkpoint-every", "2", "--lease", "3",
                                      "--comm-timeout", "5"])
    job.wait_listening()
    job.start_agent("a1", "--workers", "2")
    job.wait_step(3)
    frozen = lab.pids("a1")
    try:
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        _, stderr = job.coord.communicate(timeout=120)
    finally:
        for pid in frozen:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
    assert job.coord.returncode == 1
    error = [line for line in stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and "no live node for" in error[0] and (
        "waiting for an agent to offer a worker (1 connected, none with a free worker slot; "
        "2 of their workers were fenced and never confirmed gone)") in error[0], stderr
    assert "raise --comm-timeout" not in stderr
