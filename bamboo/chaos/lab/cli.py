"""`bamboo lab`: a whole multi-host job on this machine, each host a network namespace.

    bamboo lab --hosts 3 -- --nodes 2 --stages 2 --steps 6 --quiet
    bamboo lab --hosts 5 --workers 2 --cap a1:100mbit --cut a2@20+10 --kill-host a3@40 \\
        --out runs/lab1 -- --stages 4 --steps 100

Host "coord" runs `bamboo coordinator --bind ADDR:PORT --token-file F --out DIR
--resume auto JOB_FLAGS`; hosts a1 .. a(N-1) each run `bamboo agent --join ADDR:PORT
--token-file F --workers K`. All of them share DIR (the same file system). The
coordinator's output comes through, its stderr prefixed "[coord]", the agents' output
prefixed by their host; the faults happen at the given seconds after the coordinator
starts. When the coordinator exits, everything is torn down (also on Ctrl-C) and its exit
status is this command's.
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from bamboo.cli.parsing import EXIT_USAGE, UsageParser
from bamboo.config import JOIN_PORT

__all__ = ["main"]

PROG = "bamboo lab"

# Flags of `bamboo coordinator` that the lab sets itself.
_OWN_FLAGS = ("--bind", "--token-file", "--out", "--resume", "--advertise", "--store-port")

LISTEN_TIMEOUT_S = 180.0
"""Seconds to wait for the coordinator to listen before the agents are started anyway."""

AGENT_GRACE_S = 5.0
"""Seconds the agents get to exit by themselves after the coordinator did."""


@dataclass(frozen=True)
class Fault:
    at_s: float
    action: str  # "cut", "reconnect", "kill"
    host: str

    def __str__(self) -> str:
        return f"{self.action} {self.host}"


class _UsageError(ValueError):
    pass


def _parser() -> UsageParser:
    p = UsageParser(prog=PROG, description="Run a multi-host job on this machine: one network "
                    "namespace per host (needs root), a coordinator in host 'coord' and an "
                    "agent in each of a1 .. a(N-1); flags after -- go to `bamboo coordinator`.",
                    usage=f"{PROG} [--hosts N] [--workers K] [faults] [--out DIR] -- JOB_FLAGS")
    p.add_argument("--hosts", type=int, default=3, metavar="N",
                   help="hosts including the coordinator's (default 3: coord, a1, a2)")
    p.add_argument("--workers", type=int, default=1, metavar="K",
                   help="worker processes per agent (default 1); the job's --nodes defaults "
                   "to (N-1)*K")
    p.add_argument("--cut", action="append", default=[], metavar="HOST@S[+D]",
                   help="take HOST's link down S seconds after the coordinator starts (and "
                   "back up D seconds later); repeatable")
    p.add_argument("--kill-host", action="append", default=[], metavar="HOST@S",
                   help="SIGKILL every process of HOST at S seconds, as a reclaimed spot "
                   "instance; repeatable")
    p.add_argument("--cap", action="append", default=[], metavar="HOST:RATE",
                   help="limit HOST's bandwidth both ways from the start (tc rate, e.g. "
                   "100mbit); repeatable")
    p.add_argument("--delay", action="append", default=[], metavar="HOST:MS",
                   help="add MS milliseconds to every packet HOST sends (needs the kernel's "
                   "netem); repeatable")
    p.add_argument("--port", type=int, default=JOIN_PORT,
                   help=f"the coordinator's join port (default {JOIN_PORT})")
    p.add_argument("--out", metavar="DIR", help="the shared run directory (default: a new "
                   "temporary directory, kept)")
    return p


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def _seconds(text: str, flag: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise _UsageError(f"{flag} {spec}: '{text}' is not a number of seconds >= 0")
    return value


def _faults(cuts: list[str], kills: list[str], hosts: list[str]) -> list[Fault]:
    out: list[Fault] = []
    for flag, specs in (("--cut", cuts), ("--kill-host", kills)):
        for spec in specs:
            host, sep, when = spec.partition("@")
            if not sep or not host or not when:
                form = "HOST@S[+D]" if flag == "--cut" else "HOST@S"
                raise _UsageError(f"{flag} '{spec}': expected {form}, e.g. a1@10")
            _check_host(host, hosts, flag)
            if flag == "--cut":
                start, plus, length = when.partition("+")
                at = _seconds(start, flag, spec)
                out.append(Fault(at, "cut", host))
                if plus:
                    out.append(Fault(at + _seconds(length, flag, spec), "reconnect", host))
            else:
                out.append(Fault(_seconds(when, flag, spec), "kill", host))
    return sorted(out, key=lambda f: f.at_s)


def _pairs(specs: list[str], flag: str, hosts: list[str]) -> list[tuple[str, str]]:
    out = []
    for spec in specs:
        host, sep, value = spec.partition(":")
        if not sep or not value:
            raise _UsageError(f"{flag} '{spec}': expected HOST:VALUE, e.g. a1:"
                              f"{'100mbit' if flag == '--cap' else '20'}")
        _check_host(host, hosts, flag)
        out.append((host, value))
    return out


def _check_host(host: str, hosts: list[str], flag: str) -> None:
    if host not in hosts:
        raise _UsageError(f"{flag}: no host '{host}': the hosts are {', '.join(hosts)}")


def _job_flags(job: list[str], nodes: int) -> list[str]:
    for flag in job:
        name = flag.split("=", 1)[0]
        if name in _OWN_FLAGS:
            hint = " (give `bamboo lab --out DIR` before --)" if name == "--out" else ""
            raise _UsageError(f"{name} is set by {PROG}, not a job flag{hint}")
    given = {f.split("=", 1)[0] for f in job}
    if "--nodes" not in given and "--config" not in given:
        job = [*job, "--nodes", str(nodes)]
    return job


def _token_file(out: Path) -> Path:
    """The job's join token, shared by the coordinator and the agents: kept if the run
    directory has one (a rerun with the same --out resumes), else written (0600)."""
    path = out / "join-token"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16) + "\n")
    return path


class _Printer:
    """Lines from several processes to our stderr, each prefixed by its host, whole."""

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


def main(argv: Sequence[str] | None = None) -> int:
    ours, job = _split(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(ours)
    try:
        if not 2 <= args.hosts <= 250:
            raise _UsageError(f"--hosts {args.hosts}: need 2 to 250 (a coordinator and agents)")
        if args.workers < 1:
            raise _UsageError(f"--workers {args.workers}: need at least 1")
        if not 1 <= args.port <= 65534:
            raise _UsageError(f"--port {args.port}: need 1 to 65534")
        hosts = ["coord", *(f"a{i}" for i in range(1, args.hosts))]
        faults = _faults(args.cut, args.kill_host, hosts)
        caps = _pairs(args.cap, "--cap", hosts)
        delays = _pairs(args.delay, "--delay", hosts)
        from bamboo.chaos.lab.hosts import parse_rate, unsupported_reason
        for host, rate in caps:
            try:
                parse_rate(rate)
            except ValueError as e:
                raise _UsageError(f"--cap {host}:{rate}: {e}") from None
        for host, ms in delays:
            _seconds(ms, "--delay", f"{host}:{ms}")
        job = _job_flags(job, (args.hosts - 1) * args.workers)
        reason = unsupported_reason()
        if reason is not None:
            raise _UsageError(reason)
    except _UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bamboo-lab-"))
    try:
        out.mkdir(parents=True, exist_ok=True)
        token = _token_file(out)
    except OSError as e:
        print(f"{PROG}: error: --out {out}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _run_lab(args, job, out.resolve(), token.resolve(), faults, caps, delays)
    finally:
        if not args.out and {p.name for p in out.iterdir()} <= {"join-token"}:
            shutil.rmtree(out, ignore_errors=True)  # a temporary directory nothing ran in


def _run_lab(args: argparse.Namespace, job: list[str], out: Path, token: Path, faults: list[Fault],
             caps: list[tuple[str, str]], delays: list[tuple[str, str]]) -> int:
    from bamboo.chaos.lab.hosts import Lab, LabError, NetemUnavailable
    printer = _Printer()
    lab: Lab | None = None
    procs: dict[str, subprocess.Popen] = {}
    threads: list[threading.Thread] = []
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)  # torn down as on Ctrl-C
    try:
        lab = Lab(args.hosts)
        coord = lab["coord"]
        join = f"{coord.address}:{args.port}"
        hosts = ", ".join(f"{h.name}={h.address}" for h in lab.hosts)
        printer.say("lab", f"{len(lab.hosts)} hosts on {lab.subnet}.0/24: {hosts}; "
                    f"run directory {out}")
        for host, rate in caps:
            lab.cap(host, rate)
        for host, ms in delays:
            lab.delay(host, float(ms))

        def env(host: str) -> dict[str, str]:
            # No GLOO_SOCKET_IFNAME: the lab runs what a user's machines run, where bamboo
            # finds the interface itself (a user's own setting passes through).
            return dict(os.environ, PYTHONUNBUFFERED="1")

        bamboo = [sys.executable, "-m", "bamboo"]
        procs["coord"] = lab.run("coord", [*bamboo, "coordinator", "--bind", join, "--token-file",
                                           str(token), "--out", str(out), "--resume", "auto", *job],
                                 stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                 env=env("coord"))
        started = time.monotonic()
        threads.append(printer.follow("coord", procs["coord"].stderr))
        coordinator = procs["coord"]

        deadline = started + LISTEN_TIMEOUT_S
        while coordinator.poll() is None and time.monotonic() < deadline and \
                not _listening(coordinator.pid, coord.netns, args.port):
            time.sleep(0.05)
        if coordinator.poll() is None:
            agent = [*bamboo, "agent", "--join", join, "--token-file", str(token),
                     "--workers", str(args.workers)]
            if "--quiet" in job:
                agent.append("--quiet")
            for h in lab.hosts[1:]:
                procs[h.name] = lab.run(h, agent, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=env(h.name))
                threads.append(printer.follow(h.name, procs[h.name].stdout))

        pending = list(faults)
        while coordinator.poll() is None:
            now = time.monotonic() - started
            while pending and pending[0].at_s <= now:
                fault = pending.pop(0)
                printer.say("lab", f"t={now:.1f}s {fault}")
                if fault.action == "cut":
                    lab.cut(fault.host)
                elif fault.action == "reconnect":
                    lab.reconnect(fault.host)
                else:
                    lab.kill_host(fault.host)
            wait = 0.2 if not pending else min(0.2, max(0.01, pending[0].at_s - now))
            try:
                coordinator.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        code = _exit_code(coordinator.returncode)
        threads[0].join(timeout=5)  # the coordinator's last lines
        grace = time.monotonic() + AGENT_GRACE_S
        for name, p in procs.items():
            if name != "coord":
                try:
                    p.wait(timeout=max(0.0, grace - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        printer.say("lab", f"coordinator exited with {code}; run directory {out}")
        return code
    except KeyboardInterrupt:
        printer.say("lab", "interrupted: tearing down")
        return 130
    except _Terminated:
        printer.say("lab", "terminated: tearing down")
        return 128 + signal.SIGTERM
    except NetemUnavailable as e:
        printer.say("lab", f"error: --delay: {e}")
        return EXIT_USAGE
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
        for t in threads:
            t.join(timeout=2)
        for p in procs.values():
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()
