"""The lab of real hosts (bamboo.chaos.lab): network namespaces on a bridge, and its faults.

Needs root and `ip` (skipped otherwise, by the `lab_factory` fixture); timing is used only
as one-sided lower bounds that a slow machine cannot break (a capped transfer cannot be
faster than its cap allows, a delayed round trip cannot be shorter than its delay).

Its tests that start processes: tests/integration/test_hosts_runs.py."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


# A TCP server: "echo" sends back what it reads; "sink" reads to EOF and answers the
# byte count. It prints "ready" once listening.

# A TCP client: "echo" sends a line and prints the answer; "send N" sends N bytes and
# prints the count the server read and the seconds from connect to the answer; "connect
# N" prints the median connect time of N connections. A failure to connect is exit 3.


# -- `bamboo lab`: its usage errors (the multi-host run itself needs the coordinator) -----


@pytest.mark.parametrize("argv, message", [
    (["--hosts", "1"], "--hosts 1: need 2 to 250"),
    (["--workers", "0"], "--workers 0: need at least 1"),
    (["--cut", "a9@3"], "--cut: no host 'a9': the hosts are coord, a1, a2"),
    (["--cut", "a1"], "--cut 'a1': expected HOST@S[+D]"),
    (["--cut", "a1@soon"], "is not a number of seconds"),
    (["--kill-host", "a1@-1"], "is not a number of seconds"),
    (["--cap", "a1:fast"], "bad rate 'fast'"),
    (["--cap", "a1"], "expected HOST:VALUE"),
    (["--", "--out", "x"], "--out is set by bamboo lab"),
    (["--", "--bind=0.0.0.0:1"], "--bind is set by bamboo lab"),
])
def test_lab_command_usage_errors_are_one_line(argv, message, capsys):
    from bamboo.cli import main
    assert main(["lab", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bamboo lab: error: ") and message in err and err.count("\n") == 1, err


def test_lab_command_faults_and_job_flags():
    from bamboo.cli.lab import HostFault, fault_schedule, job_flags
    hosts = ["coord", "a1", "a2"]
    assert fault_schedule(["a1@10+5", "a2@1"], ["a1@20"], hosts) == [
        HostFault(1.0, "cut", "a2"), HostFault(10.0, "cut", "a1"),
        HostFault(15.0, "reconnect", "a1"), HostFault(20.0, "kill", "a1")]
    assert job_flags(["--steps", "6"], 4) == ["--steps", "6", "--nodes", "4"]
    assert job_flags(["--nodes=2"], 4) == ["--nodes=2"]
