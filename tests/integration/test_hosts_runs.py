"""Lab hosts (network namespaces on a bridge) built for real: reachable over TCP but not over
loopback, cut and reconnected, capped, delayed, killed whole, and removed however the
owner ends. Skipped only where labs cannot be built (not root, or no `ip`)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from bamboo.chaos.lab import (
    Lab,
    LabError,
    NetemUnavailable,
    leftover_namespaces,
    unsupported_reason,
)

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]  # every test here starts processes

PORT = 29555


SERVER = textwrap.dedent("""
    import socket, sys
    addr, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(16)
    print("ready", flush=True)
    while True:
        c, _ = s.accept()
        with c:
            if mode == "echo":
                while data := c.recv(65536):
                    c.sendall(data)
            else:
                n = 0
                while data := c.recv(1 << 20):
                    n += len(data)
                c.sendall(str(n).encode())
""")


CLIENT = textwrap.dedent("""
    import socket, statistics, sys, time
    addr, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    timeout = float(sys.argv[5]) if len(sys.argv) > 5 else 5.0
    def connect():
        try:
            return socket.create_connection((addr, port), timeout=timeout)
        except OSError as e:
            print(f"connect failed: {type(e).__name__}: {e}", flush=True)
            sys.exit(3)
    if mode == "connect":
        times = []
        for _ in range(int(sys.argv[4])):
            t = time.perf_counter()
            connect().close()
            times.append(time.perf_counter() - t)
        print(statistics.median(times))
        sys.exit(0)
    c = connect()
    c.settimeout(60)
    if mode == "echo":
        c.sendall(b"hello lab")
        print(c.recv(100).decode())
    else:
        t = time.perf_counter()
        c.sendall(b"x" * int(sys.argv[4]))
        c.shutdown(socket.SHUT_WR)
        n = c.recv(100).decode()
        print(n, time.perf_counter() - t)
""")


def start_server(lab: Lab, host: str, addr: str = "0.0.0.0",
                 mode: str = "echo") -> subprocess.Popen:
    proc = lab.run(host, [sys.executable, "-c", SERVER, addr, str(PORT), mode],
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.strip() == "ready", (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc


def client(lab: Lab, host: str, addr: str, *args: str,
           timeout: float = 60) -> subprocess.CompletedProcess:
    return lab.call(host, [sys.executable, "-c", CLIENT, addr, str(PORT), *args], timeout=timeout)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()


def root_network() -> tuple[str, str]:
    """The root namespace's addresses and routes, which a lab must never change."""
    addrs = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True,
                           timeout=15).stdout
    routes = subprocess.run(["ip", "route", "show", "table", "all"], capture_output=True,
                            text=True, timeout=15).stdout
    return addrs, routes


def test_hosts_reach_each_other_over_tcp_but_not_over_loopback(lab_factory):
    before = root_network()
    lab = lab_factory(3)
    assert [h.name for h in lab.hosts] == ["coord", "a1", "a2"]
    assert len({h.address for h in lab.hosts}) == 3
    assert len({h.netns for h in lab.hosts}) == 3
    assert all(h.address.startswith("10.") and len(h.interface) <= 15 for h in lab.hosts)
    assert root_network() == before, "the lab changed the root namespace's addresses or routes"
    server = start_server(lab, "a1")
    try:
        for other in ("coord", "a2"):
            r = client(lab, other, lab["a1"].address, "echo")
            assert r.returncode == 0 and r.stdout.strip() == "hello lab", (r.stdout, r.stderr)
        # a1's own loopback reaches its server; another host's 127.0.0.1 is its own.
        r = client(lab, "a1", "127.0.0.1", "echo")
        assert r.returncode == 0 and r.stdout.strip() == "hello lab", (r.stdout, r.stderr)
        r = client(lab, "a2", "127.0.0.1", "echo")
        assert r.returncode == 3 and "ConnectionRefused" in r.stdout, (r.stdout, r.stderr)
    finally:
        stop(server)


def test_cut_host_is_unreachable_until_reconnected(lab_factory):
    lab = lab_factory(3)
    a1 = lab["a1"].address
    server = start_server(lab, "a1")
    try:
        assert client(lab, "a2", a1, "echo").returncode == 0
        lab.cut("a1")
        r = client(lab, "a2", a1, "echo", "-", "2")  # 2 s connect timeout
        assert r.returncode == 3, (r.stdout, r.stderr)
        r = client(lab, "a1", lab["a2"].address, "echo", "-", "2")  # nor can a1 reach out
        assert r.returncode == 3, (r.stdout, r.stderr)
        assert server.poll() is None, "a cut host's processes keep running"
        lab.reconnect("a1")
        r = client(lab, "a2", a1, "echo", "-", "10")
        assert r.returncode == 0 and r.stdout.strip() == "hello lab", (r.stdout, r.stderr)
    finally:
        stop(server)


def test_cap_installs_tbf_both_ways_and_limits_a_transfer(lab_factory):
    lab = lab_factory(2)
    size = 2 * 1024 * 1024
    server = start_server(lab, "a1", mode="sink")
    try:
        r = client(lab, "coord", lab["a1"].address, "send", str(size))
        assert r.returncode == 0 and int(r.stdout.split()[0]) == size, (r.stdout, r.stderr)
        lab.cap("a1", "8mbit")
        q = lab.qdiscs("a1")
        for side in ("egress", "ingress"):
            assert "tbf" in q[side] and "rate 8Mbit" in q[side], q
        r = client(lab, "coord", lab["a1"].address, "send", str(size))
        assert r.returncode == 0 and int(r.stdout.split()[0]) == size, (r.stdout, r.stderr)
        # 2 MiB at 1 MB/s takes about 2.1 s; a machine under load only makes it slower.
        assert float(r.stdout.split()[1]) > 1.0, r.stdout
        lab.uncap("a1")
        assert "tbf" not in "".join(lab.qdiscs("a1").values())
        with pytest.raises(ValueError, match="bad rate"):
            lab.cap("a1", "fast")
    finally:
        stop(server)


def test_delay_adds_latency_or_says_netem_is_unavailable(lab_factory):
    lab = lab_factory(2)
    # Probe netem directly with tc (not through Lab.delay), on a1's loopback.
    probe = lab.call("a1", ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"])
    if probe.returncode != 0:
        assert "unknown" in probe.stderr.lower() or "no such file" in probe.stderr.lower(), \
            probe.stderr
        before = lab.qdiscs("a1")
        with pytest.raises(NetemUnavailable, match="netem") as e:
            lab.delay("a1", 50)
        assert isinstance(e.value, LabError) and "tc" in e.value.command
        assert lab.qdiscs("a1") == before, "a failed delay changed nothing"
        return
    lab.call("a1", ["tc", "qdisc", "del", "dev", "lo", "root"])
    server = start_server(lab, "a1")
    try:
        r = client(lab, "coord", lab["a1"].address, "connect", "5")
        assert r.returncode == 0, r.stdout
        lab.delay("a1", 100)
        assert "netem" in lab.qdiscs("a1")["egress"]
        r = client(lab, "coord", lab["a1"].address, "connect", "5")
        assert r.returncode == 0 and float(r.stdout) >= 0.09, r.stdout  # a SYN-ACK round trip
        lab.delay("a1", 0)
        assert "netem" not in lab.qdiscs("a1")["egress"]
    finally:
        stop(server)


def test_close_removes_every_namespace_even_when_the_body_raised():
    if unsupported_reason() is not None:
        pytest.skip(unsupported_reason())
    with Lab(2) as lab:
        names = [lab.switch, *(h.netns for h in lab.hosts)]
        assert leftover_namespaces(lab.prefix) == sorted(names)
    assert leftover_namespaces(lab.prefix) == []
    lab.close()  # idempotent
    with pytest.raises(LabError, match="closed"):
        lab.run("a1", ["true"])

    with pytest.raises(RuntimeError, match="boom"):
        with Lab(3) as lab:
            sleeper = lab.run("a2", ["sleep", "60"])
            raise RuntimeError("boom")
    assert leftover_namespaces(lab.prefix) == []
    assert sleeper.poll() == -signal.SIGKILL, "close() kills the hosts' processes"


def test_sigterm_and_exit_of_the_owner_remove_its_labs(tmp_path):
    if unsupported_reason() is not None:
        pytest.skip(unsupported_reason())
    script = textwrap.dedent("""
        import sys, time
        from bamboo.chaos.lab import Lab
        lab = Lab(2)
        lab.run("a1", ["sleep", "60"])
        print(lab.prefix, flush=True)
        if sys.argv[1] == "wait":
            time.sleep(60)
    """)
    for how in ("wait", "exit"):  # killed by SIGTERM / returns without closing
        proc = subprocess.Popen([sys.executable, "-c", script, how], stdout=subprocess.PIPE,
                                text=True)
        prefix = proc.stdout.readline().strip()
        assert prefix.startswith("bb"), prefix
        if how == "wait":
            assert leftover_namespaces(prefix)
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == (-signal.SIGTERM if how == "wait" else 0)
        proc.stdout.close()
        assert leftover_namespaces(prefix) == [], how


def test_kill_host_kills_every_process_in_it(lab_factory):
    lab = lab_factory(3)
    # a process and a child of it in a1, and a bystander in a2
    victim = lab.run("a1", ["sh", "-c", "sleep 60 & sleep 60"])
    bystander = lab.run("a2", ["sleep", "60"])
    deadline = time.monotonic() + 10
    while len(lab.pids("a1")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(lab.pids("a1")) >= 2
    killed = lab.kill_host("a1")
    assert victim.pid in killed and len(killed) >= 2
    assert victim.wait(timeout=10) == -signal.SIGKILL
    assert lab.pids("a1") == []
    assert bystander.poll() is None and lab.pids("a2") == [bystander.pid]
    # the host itself stays: a new process can start there
    assert lab.call("a1", ["true"]).returncode == 0


def test_close_kills_a_process_that_has_not_yet_entered_its_namespace(tmp_path):
    """`ip netns exec` is outside the namespace until it has set it up, where `ip netns pids`
    cannot see it; close() must kill it all the same (an `ip` that is slow to start)."""
    if unsupported_reason() is not None:
        pytest.skip(unsupported_reason())
    slow_ip = tmp_path / "ip"
    slow_ip.write_text(f"#!/bin/sh\nsleep 2\nexec {shutil.which('ip')} \"$@\"\n")
    slow_ip.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    with Lab(2) as lab:
        late = lab.run("a1", ["sleep", "60"], env=env)
    assert late.wait(timeout=5) == -signal.SIGKILL, "close() kills the hosts' processes"
