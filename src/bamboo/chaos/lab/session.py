"""One lab session: a whole multi-host job on this machine, each host a network namespace
(`run_lab`, behind `bamboo lab`, whose flags `bamboo.cli.lab` reads).

Host "coord" runs `bamboo coordinator --bind ADDR:PORT --token-file F --out DIR
--resume auto JOB_FLAGS`; hosts a1 .. a(N-1) each run `bamboo agent --join ADDR:PORT
--token-file F --workers K`. All of them share DIR (the same file system). The
coordinator's output comes through, its stderr prefixed "[coord]", the agents' output
prefixed by their host; the faults happen at the given seconds after the coordinator
starts. When the coordinator exits, everything is torn down (also on Ctrl-C) and its exit
status is the session's.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from bamboo.chaos.lab.hosts import Host, Lab, LabError, NetemUnavailable

__all__ = ["HostFault", "LabSession", "run_lab", "token_file", "EXIT_BAD_SETUP"]

LISTEN_TIMEOUT_S = 180.0
"""Seconds to wait for the coordinator to listen before the agents are started anyway."""

AGENT_GRACE_S = 5.0
"""Seconds the agents get to exit by themselves after the coordinator did."""

EXIT_BAD_SETUP = 2
"""Exit status when the machine cannot do what was asked (no netem for a delay): a user error."""


@dataclass(frozen=True)
class HostFault:
    """What the lab does to a host `at_s` seconds after the coordinator starts: cut its link,
    reconnect it, or kill every process in it (a job's own fault plan is another thing:
    `bamboo.plan.faults.Fault`)."""

    at_s: float
    action: str  # "cut", "reconnect", "kill"
    host: str

    def __str__(self) -> str:
        return f"{self.action} {self.host}"


@dataclass
class LabSession:
    """What one `bamboo lab` runs: `hosts` hosts (coord, a1 ..), `workers` per agent, the
    coordinator's join `port`, its `job` flags, the shared run directory `out` and join-token
    file `token`, and the faults, bandwidth caps and delays, by host."""
    hosts: int
    workers: int
    port: int
    job: list[str]
    out: Path
    token: Path
    faults: list[HostFault] = field(default_factory=list)
    caps: list[tuple[str, str]] = field(default_factory=list)
    delays: list[tuple[str, str]] = field(default_factory=list)


def token_file(out: Path) -> Path:
    """The job's join token, shared by the coordinator and the agents: kept if the run
    directory has one (a rerun with the same --out resumes), else written (0600)."""
    path = out / "join-token"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16) + "\n")
    return path


class _Printer:
    """Lines from several processes to our stderr, each prefixed by its host, whole: the
    console of `bamboo lab` (its hosts' output interleaved with its own lines), a display
    like the progress panel, so written, not logged."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def say(self, prefix: str, line: str) -> None:
        with self.lock:
            sys.stderr.write(f"[{prefix}] {line.rstrip()}\n")
            sys.stderr.flush()

    def follow(self, prefix: str, stream: IO[str]) -> threading.Thread:
        def pump() -> None:
            try:
                for line in stream:
                    self.say(prefix, line)
            except (OSError, ValueError):
                pass
        t = threading.Thread(target=pump, name=f"lab-{prefix}", daemon=True)
        t.start()
        return t


def _listening(pid: int, netns: str, port: int) -> bool:
    """Whether process `pid`, once inside namespace `netns`, has a TCP socket there
    listening on `port` (read from /proc, so that nothing connects to the join port)."""
    try:
        if os.stat(f"/proc/{pid}/ns/net").st_ino != os.stat(f"/var/run/netns/{netns}").st_ino:
            return False
    except OSError:
        return False
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A" and \
                    int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


class _Terminated(Exception):
    """SIGTERM reached `bamboo lab`."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _env() -> dict[str, str]:
    # No GLOO_SOCKET_IFNAME: the lab runs what a user's machines run, where bamboo
    # finds the interface itself (a user's own setting passes through).
    return dict(os.environ, PYTHONUNBUFFERED="1")


class _Run:
    """The processes of one session on its lab: the coordinator, then the agents."""

    def __init__(self, session: LabSession, lab: Lab, printer: _Printer) -> None:
        self.session, self.lab, self.printer = session, lab, printer
        self.procs: dict[str, subprocess.Popen] = {}
        self.threads: list[threading.Thread] = []
        self.join = f"{lab['coord'].address}:{session.port}"

    def start_coordinator(self) -> subprocess.Popen:
        s = self.session
        command = [sys.executable, "-m", "bamboo", "coordinator", "--bind", self.join,
                   "--token-file", str(s.token), "--out", str(s.out), "--resume", "auto", *s.job]
        coordinator = self.lab.run("coord", command, stdin=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, env=_env())
        self.procs["coord"] = coordinator
        self.threads.append(self.printer.follow("coord", coordinator.stderr))
        return coordinator

    def start_agents(self, coordinator: subprocess.Popen, started: float) -> None:
        """Once the coordinator listens (or LISTEN_TIMEOUT_S passed), an agent per host."""
        coord: Host = self.lab["coord"]
        deadline = started + LISTEN_TIMEOUT_S
        while coordinator.poll() is None and time.monotonic() < deadline and \
                not _listening(coordinator.pid, coord.netns, self.session.port):
            time.sleep(0.05)
        if coordinator.poll() is not None:
            return
        agent = [sys.executable, "-m", "bamboo", "agent", "--join", self.join, "--token-file",
                 str(self.session.token), "--workers", str(self.session.workers)]
        if "--quiet" in self.session.job:
            agent.append("--quiet")
        for h in self.lab.hosts[1:]:  # each host's workers log in the run directory
            logs = ["--log-dir", str(self.session.out / "logs" / h.name)]
            self.procs[h.name] = self.lab.run(h, agent + logs, stdin=subprocess.DEVNULL,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True, env=_env())
            self.threads.append(self.printer.follow(h.name, self.procs[h.name].stdout))

    def inject_until_exit(self, coordinator: subprocess.Popen, started: float) -> int:
        """Each fault at its second until the coordinator exits; its exit status."""
        pending = list(self.session.faults)
        while coordinator.poll() is None:
            now = time.monotonic() - started
            while pending and pending[0].at_s <= now:
                fault = pending.pop(0)
                self.printer.say("lab", f"t={now:.1f}s {fault}")
                if fault.action == "cut":
                    self.lab.cut(fault.host)
                elif fault.action == "reconnect":
                    self.lab.reconnect(fault.host)
                else:
                    self.lab.kill_host(fault.host)
            wait = 0.2 if not pending else min(0.2, max(0.01, pending[0].at_s - now))
            try:
                coordinator.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        return _exit_code(coordinator.returncode)

    def let_agents_exit(self) -> None:
        self.threads[0].join(timeout=5)  # the coordinator's last lines
        grace = time.monotonic() + AGENT_GRACE_S
        for name, p in self.procs.items():
            if name != "coord":
                try:
                    p.wait(timeout=max(0.0, grace - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass

    def close_streams(self) -> None:
        for t in self.threads:
            t.join(timeout=2)
        for p in self.procs.values():
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()


def _session(session: LabSession, lab: Lab, printer: _Printer, run: list[_Run]) -> int:
    hosts = ", ".join(f"{h.name}={h.address}" for h in lab.hosts)
    printer.say("lab", f"{len(lab.hosts)} hosts on {lab.subnet}.0/24: {hosts}; "
                f"run directory {session.out}")
    for host, rate in session.caps:
        lab.cap(host, rate)
    for host, ms in session.delays:
        lab.delay(host, float(ms))
    run.append(_Run(session, lab, printer))
    coordinator = run[0].start_coordinator()
    started = time.monotonic()
    run[0].start_agents(coordinator, started)
    code = run[0].inject_until_exit(coordinator, started)
    run[0].let_agents_exit()
    printer.say("lab", f"coordinator exited with {code}; run directory {session.out}")
    return code


def run_lab(session: LabSession) -> int:
    """Build the lab, run the session on it, tear everything down; the coordinator's exit
    status (130 on Ctrl-C, 143 on SIGTERM, EXIT_BAD_SETUP without netem for a delay, 1 when
    the lab itself fails)."""
    printer = _Printer()
    lab: Lab | None = None
    run: list[_Run] = []
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)  # torn down as on Ctrl-C
    try:
        lab = Lab(session.hosts)
        return _session(session, lab, printer, run)
    except KeyboardInterrupt:
        printer.say("lab", "interrupted: tearing down")
        return 130
    except _Terminated:
        printer.say("lab", "terminated: tearing down")
        return 128 + signal.SIGTERM
    except NetemUnavailable as e:
        printer.say("lab", f"error: --delay: {e}")
        return EXIT_BAD_SETUP
    except LabError as e:
        printer.say("lab", f"error: {e}")
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if lab is not None:
            try:
                lab.close()
            except LabError as e:
                printer.say("lab", f"teardown: {e}")
        for r in run:
            r.close_streams()
