"""`bamboo coordinator` and `bamboo agent` on loopback: one job, its nodes joining over the
network with the job's token; a wrong token or an unreachable coordinator is one line;
an agent killed with SIGKILL is a preemption like any other."""
from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest

from support.agents import agent as start_agent
from support.agents import (
    assert_failure_free,
    kill_machine,
    signal_machine,
    start,
    stop,
    wait_for,
    wait_step,
)
from support.agents import coordinator as start_coordinator
from support.processes import session_processes
from support.procs import BAMBOO, REPO, free_port, run_events
from support.servers import MetadataServer

pytestmark = pytest.mark.procs  # every test here starts processes


@pytest.mark.timeout(240)
def test_agents_join_with_the_token_and_train_to_the_failure_free_result(tmp_path: Path) -> None:
    out, port = tmp_path / "run", free_port()
    coord = start(["coordinator", "--bind", f"127.0.0.1:{port}", "--nodes", "4", "--stages",
                    "4", "--steps", "8", "--kill", "0:2@4", "--out", str(out), "--json",
                    "--quiet", "--no-report"])
    agents = []
    try:
        token_file = out / "join-token"
        wait_for(token_file)
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        # A wrong token is refused at the door, in one line; the job is unaffected.
        bad = subprocess.run(BAMBOO + ["agent", "--join", f"127.0.0.1:{port}", "--token", "0" * 32],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0
        assert bad.stderr.strip().splitlines() == [
            f"bamboo agent: error: the coordinator at 127.0.0.1:{port} refused the join token: "
            f"use the token it printed (its run directory's join-token file)"]
        agents = [start(["agent", "--join", f"127.0.0.1:{port}", "--token-file",
                          str(token_file)]) for _ in range(4)]
        stdout, stderr = coord.communicate(timeout=200)
    finally:
        stop([coord, *agents])
    assert coord.returncode == 0, stderr
    summary = json.loads(stdout)
    assert_failure_free(summary, nodes=4, stages=4, steps=8)
    assert summary["failovers"] == 1 and summary["preemptions"] == 1
    ups = [e for e in run_events(out) if e["event"] == "node_up"]
    assert all(e["host"] for e in ups)
    # The killed worker's machine stayed: a replacement standby took its GPU (worker index).
    lost = next(e["node"] for e in run_events(out) if e["event"] == "node_lost")
    killed = next(e for e in ups if e["node"] == lost)
    assert len(ups) == 5 and (ups[4]["machine"], ups[4]["worker"]) == (killed["machine"],
                                                                     killed["worker"])


@pytest.mark.timeout(240)
def test_an_agent_killed_by_sigkill_is_a_preemption(tmp_path: Path) -> None:
    out, port = tmp_path / "run", free_port()
    secret = tmp_path / "secret"  # a token made beforehand, as a mounted secret would be
    secret.write_text("f" * 64 + "\n")
    coord = start(["coordinator", "--bind", f"127.0.0.1:{port}", "--token-file", str(secret),
                    "--nodes", "2", "--stages", "2", "--pipelines", "1", "--steps", "30",
                    "--checkpoint-every", "5", "--out", str(out), "--json", "--quiet",
                    "--no-report"])
    agents = []
    try:
        token = "f" * 64
        wait_for(out / "events.jsonl")
        agents = [start(["agent", "--join", f"127.0.0.1:{port}", "--token", token])
                  for _ in range(3)]  # the third is a standby
        deadline = time.monotonic() + 150
        while not any(e["event"] == "step_done" and e["step"] >= 3 for e in run_events(out)):
            assert time.monotonic() < deadline and coord.poll() is None
            time.sleep(0.2)
        # An agent with a node (one refused for --max-nodes keeps retrying, and has none).
        nodes_of = {e["pid"] for e in run_events(out) if e["event"] == "node_up"}
        victim = next(p for p in agents if p.pid in nodes_of)
        victim.send_signal(signal.SIGKILL)  # the machine is gone, worker and all
        stdout, stderr = coord.communicate(timeout=150)
    finally:
        stop([coord, *agents])
    assert coord.returncode == 0, stderr
    summary = json.loads(stdout)
    assert_failure_free(summary, nodes=2, stages=2, steps=30)
    assert summary["preemptions"] == 1
    assert summary["failovers"] + summary["standby_losses"] == 1


def test_an_unreachable_coordinator_is_one_line() -> None:
    port = free_port()
    result = subprocess.run(BAMBOO + ["agent", "--join", f"127.0.0.1:{port}", "--token", "x",
                                      "--rejoin-s", "0"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the coordinator" in lines[0]


@pytest.mark.parametrize("args, message", [
    (["--join", "nowhere", "--token", "x"], "--join 'nowhere' is not ADDRESS:PORT"),
    (["--join", "127.0.0.1:1"], "exactly one of --token or --token-file"),
    (["--join", "127.0.0.1:1", "--token-file", "/nonexistent/t"], "--token-file /nonexistent/t"),
    (["--join", "127.0.0.1:1", "--token", "x", "--notices", "ibm"], "unknown source 'ibm'"),
])
def test_agent_usage_errors_are_one_line(args: list[str], message: str) -> None:
    result = subprocess.run(BAMBOO + ["agent", *args], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_coordinator_rejects_a_bad_bind_and_local_only_flags(tmp_path: Path) -> None:
    for args, message in ((["--bind", "localhost"], "--bind 'localhost' is not ADDRESS:PORT"),
                          (["--trace", str(REPO / "traces/aws-p3-2xlarge.csv")],
                           "need local workers"),
                          (["--bind", f"127.0.0.1:{free_port()}", "--etcd",
                            "http://127.0.0.1:1"], "etcd at http://127.0.0.1:1 is unreachable")):
        result = subprocess.run(BAMBOO + ["coordinator", *args, "--out", str(tmp_path / "x")],
                                cwd=REPO, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], lines


@pytest.mark.timeout(240)
def test_an_agent_drains_on_its_cloud_notice(tmp_path: Path) -> None:
    """The agent of n0 watches an AWS IMDSv2 endpoint (a local server answering as AWS
    does); when the spot interruption notice appears, n0 drains at the next step boundary:
    its stage moves to the standby, no redundant backward, nothing redone."""
    imds = MetadataServer("aws").start()
    out, port = tmp_path / "run", free_port()
    coord = start(["coordinator", "--bind", f"127.0.0.1:{port}", "--nodes", "2", "--stages",
                    "2", "--pipelines", "1", "--max-nodes", "3", "--steps", "16",
                    "--out", str(out), "--json", "--quiet", "--no-report"])
    agents = []
    try:
        wait_for(out / "join-token")
        wait_for(out / "events.jsonl")
        token = (out / "join-token").read_text().strip()
        join = ["agent", "--join", f"127.0.0.1:{port}", "--token", token]
        agents.append(start([*join, "--notices", "aws", "--metadata-url", imds.url]))
        deadline = time.monotonic() + 60
        while not any(e["event"] == "node_up" for e in run_events(out)):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        agents += [start(join), start(join)]  # n1, and n2 as a standby
        while not any(e["event"] == "step_done" and e["step"] >= 3 for e in run_events(out)):
            assert time.monotonic() < deadline + 90 and coord.poll() is None
            time.sleep(0.2)
        imds.notice = True
        stdout, stderr = coord.communicate(timeout=150)
        noticed_agent = agents[0].wait(timeout=30)
    finally:
        imds.shutdown()
        stop([coord, *agents])
    assert coord.returncode == 0, stderr
    summary = json.loads(stdout)
    assert (summary["drains"], summary["failovers"], summary["preemptions"]) == (1, 0, 1)
    assert summary["redone_steps"] == 0 and noticed_agent == 3  # EXIT_DRAINED
    assert_failure_free(summary, nodes=2, stages=2, steps=16)
    notices = [e for e in run_events(out) if e["event"] == "notice"]
    assert [e["node"] for e in notices] == ["n0"]


def test_coordinator_token_file_too_short_is_one_line(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("short\n")
    result = subprocess.run(BAMBOO + ["coordinator", "--bind", f"127.0.0.1:{free_port()}",
                                      "--token-file", str(token), "--out", str(tmp_path / "r")],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "at least 16" in lines[0], lines


@pytest.mark.timeout(240)
def test_with_etcd_a_frozen_machine_is_fenced_by_its_lease(tmp_path: Path, etcd_url: str) -> None:
    """`--etcd`: agents hold leases in a real etcd. Freezing n0's whole machine (agent,
    fork server and worker: SIGSTOP to its process group) stops its keep-alives; etcd
    expires the lease, the coordinator's watch sees it and fences n0, the shadow takes
    over, and the run ends equal to the failure-free one."""
    from bamboo.node.membership import EtcdMembership
    out, port = tmp_path / "run", free_port()
    coord = start(["coordinator", "--bind", f"127.0.0.1:{port}", "--etcd", etcd_url,
                    "--nodes", "2", "--stages", "2", "--pipelines", "1", "--max-nodes", "3",
                    "--steps", "40", "--out", str(out), "--json", "--quiet", "--no-report"])
    agents: list[subprocess.Popen] = []
    try:
        wait_for(out / "join-token")
        wait_for(out / "events.jsonl")
        join = ["agent", "--join", f"127.0.0.1:{port}", "--token-file", str(out / "join-token")]
        agents.append(start(join, session=True))
        deadline = time.monotonic() + 90
        while not any(e["event"] == "node_up" for e in run_events(out)):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        agents += [start(join), start(join)]
        while not any(e["event"] == "step_done" and e["step"] >= 3 for e in run_events(out)):
            assert time.monotonic() < deadline + 60 and coord.poll() is None
            time.sleep(0.2)
        # The third agent is a standby: it joins while the others train, so its lease may
        # appear after step 3 on a loaded machine. Every agent holds one, within the deadline.
        membership = EtcdMembership.connect(etcd_url, job=out.name)
        while sorted(view := membership.alive()) != ["n0", "n1", "n2"]:
            assert time.monotonic() < deadline + 90 and coord.poll() is None, sorted(view)
            time.sleep(0.2)
        signal_machine(agents[0], signal.SIGSTOP)  # the whole machine freezes
        stdout, stderr = coord.communicate(timeout=150)
    finally:
        if agents:
            kill_machine(agents[0])
        stop([coord, *agents])
    assert coord.returncode == 0, stderr
    summary = json.loads(stdout)
    assert summary["failovers"] == 1 and summary["preemptions"] == 1
    assert_failure_free(summary, nodes=2, stages=2, steps=40)
    fenced = [e for e in run_events(out) if e["event"] == "fenced"]
    assert fenced and fenced[0]["node"] == "n0" and fenced[0]["why"] == "etcd lease expired"


# -- the join port, machines of several workers, restarts --------------------------------


@pytest.mark.timeout(240)
def test_the_join_port_survives_probes_garbage_and_stalled_clients(tmp_path: Path) -> None:
    """Before any agent joins: TCP probes (connect and close), random bytes, a frame that
    announces 4 GB, a wrong proof and a client that connects and never speaks. None of them
    stops the listener; the agents then join and train to the failure-free result, and the
    stalled client is dropped after the handshake deadline."""
    import struct
    out, port = tmp_path / "run", free_port()
    coord = start_coordinator(out, port, "--nodes", "2", "--stages", "2", "--pipelines", "1",
                         "--steps", "6")
    agents: list[subprocess.Popen] = []
    stalled = None
    try:
        wait_for(out / "join-token")
        deadline = time.monotonic() + 60
        while True:  # the listener is up once a connection is accepted
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        for _ in range(3):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(os.urandom(4096))
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(struct.pack(">I", 0xFFFFFFF0) + b"x" * 100)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            body = json.dumps({"bamboo": 1, "proof": "0" * 64, "hello": {}}).encode()
            s.sendall(struct.pack(">I", len(body)) + body)
        stalled = socket.create_connection(("127.0.0.1", port), timeout=30)
        stalled_at = time.monotonic()
        agents = [start_agent(out, port, "--workers", "2")]
        stdout, stderr = coord.communicate(timeout=200)
        stalled.settimeout(max(1.0, 20 - (time.monotonic() - stalled_at)))
        received = b""
        while chunk := stalled.recv(4096):  # the challenge, then the end of the connection
            received += chunk
        assert b"challenge" in received
        assert agents[0].wait(timeout=30) == 0
    finally:
        if stalled is not None:
            stalled.close()
        stop([coord])
        for a in agents:
            kill_machine(a)
    assert coord.returncode == 0, stderr
    assert_failure_free(json.loads(stdout), nodes=2, stages=2, steps=6)


@pytest.mark.timeout(300)
def test_losing_a_machine_loses_all_its_workers_and_placement_covers_it(tmp_path: Path) -> None:
    """Two agents of two workers each, 2 pipelines x 2 stages. Placement puts every stage's
    replica on the other machine, so when one machine dies (its whole process group
    SIGKILLed), both of its workers are lost at once and both are failed over: no
    checkpoint, and the result equals the failure-free run."""
    out, port = tmp_path / "run", free_port()
    http = free_port()
    coord = start_coordinator(out, port, "--nodes", "4", "--stages", "2", "--steps", "10",
                         "--lease", "3", "--http", f"127.0.0.1:{http}")
    agents: list[subprocess.Popen] = []
    try:
        wait_for(out / "join-token")
        agents = [start_agent(out, port, "--workers", "2") for _ in range(2)]
        wait_step(out, 3, coord)
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10) as r:
            scraped = {s.name: s.value for f in text_string_to_metric_families(r.read().decode())
                       for s in f.samples}
        assert scraped["bamboo_live_nodes"] == 4 and scraped["bamboo_step"] >= 3
        kill_machine(agents[0])
        stdout, stderr = coord.communicate(timeout=200)
    finally:
        stop([coord])
        for a in agents:
            kill_machine(a)
    assert coord.returncode == 0, stderr
    summary = json.loads(stdout)
    assert_failure_free(summary, nodes=4, stages=2, steps=10)
    assert summary["preemptions"] == 2 and summary["failovers"] == 2, summary
    assert summary["checkpoint_restores"] == 0
    ups = [e for e in run_events(out) if e["event"] == "node_up"]
    assert sorted(e["worker"] for e in ups) == [0, 0, 1, 1]
    assert len({e["machine"] for e in ups}) == 2
    lost = {e["node"] for e in run_events(out) if e["event"] == "node_lost"}
    machine = {e["node"]: e["machine"] for e in ups}
    assert len(lost) == 2 and len({machine[n] for n in lost}) == 1


@pytest.mark.timeout(300)
def test_a_killed_coordinator_restarted_with_resume_auto_ends_equal(tmp_path: Path) -> None:
    """The coordinator is SIGKILLed mid-run after a checkpoint; its agents stop their
    workers and keep trying to rejoin; the same command line started again continues from
    the newest whole checkpoint (`--resume auto`), the agents rejoin, and the run ends equal
    to the failure-free one. A third start finds the run complete and does nothing."""
    out, port = tmp_path / "run", free_port()
    job = ["--nodes", "2", "--stages", "2", "--pipelines", "1", "--steps", "16",
           "--checkpoint-every", "3", "--resume", "auto", "--lease", "3"]
    coord = start_coordinator(out, port, *job)
    agents: list[subprocess.Popen] = []
    try:
        wait_for(out / "join-token")
        agents = [start_agent(out, port, "--rejoin-s", "120") for _ in range(2)]
        wait_step(out, 7, coord)
        coord.send_signal(signal.SIGKILL)
        coord.wait(timeout=30)
        killed_at = time.monotonic()
        saved = [e["step"] for e in run_events(out) if e["event"] == "checkpoint"]
        time.sleep(1.0)
        coord = start_coordinator(out, port, *job)
        stdout, stderr = coord.communicate(timeout=200)
        resumed_s = time.monotonic() - killed_at
        codes = [a.wait(timeout=30) for a in agents]
    finally:
        stop([coord])
        for a in agents:
            kill_machine(a)
    assert coord.returncode == 0, stderr
    summary = json.loads(stdout)
    # The newest whole checkpoint when it was killed: the last one it reported, or the next
    # one if the kill fell between its rename and its event (how far the run got by the
    # kill depends on the machine's speed).
    assert saved and max(saved) >= 3 and summary["resumed_from_step"] in (max(saved),
                                                                         max(saved) + 3)
    assert_failure_free(summary, nodes=2, stages=2, steps=16)
    assert codes == [0, 0]
    assert resumed_s < 150
    again = subprocess.run(BAMBOO + ["coordinator", "--bind", f"127.0.0.1:{port}", "--out",
                                     str(out), "--quiet", *job],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "already completed 16 steps" in again.stderr
    other = subprocess.run(BAMBOO + ["coordinator", "--bind", f"127.0.0.1:{port}", "--out",
                                     str(out), "--quiet", *job, "--seed", "3"],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert other.returncode == 2 and "was made with seed 0, this job has 3" in other.stderr, \
        other.stderr


@pytest.mark.timeout(200)
def test_an_agent_gives_up_after_rejoin_s_and_leaves_no_worker(tmp_path: Path) -> None:
    out, port = tmp_path / "run", free_port()
    coord = start_coordinator(out, port, "--nodes", "2", "--stages", "2", "--pipelines", "1",
                         "--steps", "500", "--lease", "3")
    agent = None
    try:
        wait_for(out / "join-token")
        health = free_port()
        agent = start_agent(out, port, "--workers", "2", "--rejoin-s", "2", "--http",
                       f"127.0.0.1:{health}")
        wait_step(out, 2, coord)
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=10) as r:
            assert r.status == 200 and json.loads(r.read())["workers"] == 2
        coord.send_signal(signal.SIGKILL)
        gone_at = time.monotonic()
        code = agent.wait(timeout=60)
        waited = time.monotonic() - gone_at
        _, stderr = agent.communicate(timeout=10)
        deadline = time.monotonic() + 10  # the fork server follows its agent out
        while (leftovers := session_processes(agent.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if leftovers:
            leftovers = subprocess.run(["ps", "-o", "pid=,args=", "-p",
                                        ",".join(map(str, leftovers))],
                                       capture_output=True, text=True).stdout.splitlines()
    finally:
        stop([coord])
        if agent is not None:
            kill_machine(agent)
    assert code == 1, stderr
    assert "giving up" in stderr.strip().splitlines()[-1]
    assert leftovers == []
    assert 2 <= waited < 40


def test_a_coordinator_short_of_agents_gives_up_after_join_timeout(tmp_path: Path) -> None:
    result = subprocess.run(BAMBOO + ["coordinator", "--bind", f"127.0.0.1:{free_port()}",
                                      "--nodes", "2", "--stages", "2", "--join-timeout", "2",
                                      "--out", str(tmp_path / "r"), "--quiet"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "0/2 workers joined within --join-timeout 2 s" in result.stderr, result.stderr


@pytest.mark.timeout(60)
def test_the_join_token_appears_only_once_the_join_port_listens(tmp_path: Path) -> None:
    """A script that waits for the token file and then connects is never refused."""
    port, out = free_port(), tmp_path / "run"
    coord = subprocess.Popen(BAMBOO + ["coordinator", "--bind", f"127.0.0.1:{port}", "--nodes", "1",
                                       "--stages", "1", "--steps", "1", "--join-timeout", "5",
                                       "--out", str(out), "--quiet"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (out / "join-token").exists():
            assert time.monotonic() < deadline and coord.poll() is None, "no token file"
            time.sleep(0.001)
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        assert len((out / "join-token").read_text().strip()) >= 16
    finally:
        coord.kill()
        coord.wait(10)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin two workers")
@pytest.mark.timeout(180)
def test_an_agents_workers_are_pinned_to_cores_of_their_own(tmp_path: Path) -> None:
    """`--pin-cpus auto` on a coordinator: an agent running two workers gives each its own
    share of the machine's cores, as local workers get."""
    out, port = tmp_path / "run", free_port()
    coord = start(["coordinator", "--bind", f"127.0.0.1:{port}", "--nodes", "2", "--stages",
                    "2", "--steps", "3", "--micro-batches", "2", "--pin-cpus", "auto",
                    "--out", str(out), "--json", "--quiet", "--no-report"])
    agent = None
    try:
        wait_for(out / "join-token")
        agent = start(["agent", "--join", f"127.0.0.1:{port}", "--token-file",
                        str(out / "join-token"), "--workers", "2"])
        stdout, stderr = coord.communicate(timeout=150)
    finally:
        stop([coord, *([agent] if agent else [])])
    assert coord.returncode == 0, stderr
    assert_failure_free(json.loads(stdout), nodes=2, stages=2, steps=3, micro_batches=2)
    cpus = {e["node"]: e["cpus"] for e in run_events(out) if e["event"] == "pinned"}
    assert set(cpus) == {"n0", "n1"}, cpus
    shares = list(cpus.values())
    assert shares[0] and shares[1] and not set(shares[0]) & set(shares[1])
