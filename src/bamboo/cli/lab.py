"""`bamboo lab`: a whole multi-host job on this machine, each host a network namespace
(`bamboo.chaos.lab` builds the hosts and runs the session; this module reads the flags).

    bamboo lab --hosts 3 -- --nodes 2 --stages 2 --steps 6 --quiet
    bamboo lab --hosts 5 --workers 2 --cap a1:100mbit --cut a2@20+10 --kill-host a3@40 \\
        --out runs/lab1 -- --stages 4 --steps 100

Flags after `--` go to `bamboo coordinator`; the lab sets --bind, --token-file, --out and
--resume itself.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bamboo.chaos.lab.session import HostFault
from bamboo.cli.parsing import EXIT_USAGE, UsageParser
from bamboo.config import JOIN_PORT

__all__ = ["main", "lab_parser", "HostFault", "fault_schedule", "job_flags"]

PROG = "bamboo lab"

# Flags of `bamboo coordinator` that the lab sets itself.
_OWN_FLAGS = ("--bind", "--token-file", "--out", "--resume", "--advertise", "--store-port")


class _UsageError(ValueError):
    pass


def lab_parser() -> argparse.ArgumentParser:
    """The lab's own flags (those before `--`)."""
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


def fault_schedule(cuts: list[str], kills: list[str], hosts: list[str]) -> list[HostFault]:
    """The faults of `--cut` and `--kill-host` in time order (a cut with +D also reconnects);
    _UsageError names a malformed spec or an unknown host."""
    out: list[HostFault] = []
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
                out.append(HostFault(at, "cut", host))
                if plus:
                    out.append(HostFault(at + _seconds(length, flag, spec), "reconnect", host))
            else:
                out.append(HostFault(_seconds(when, flag, spec), "kill", host))
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


def job_flags(job: list[str], nodes: int) -> list[str]:
    """The job's flags after --, with --nodes added from the hosts unless given; _UsageError
    for a flag the lab sets itself."""
    for flag in job:
        name = flag.split("=", 1)[0]
        if name in _OWN_FLAGS:
            hint = " (give `bamboo lab --out DIR` before --)" if name == "--out" else ""
            raise _UsageError(f"{name} is set by {PROG}, not a job flag{hint}")
    given = {f.split("=", 1)[0] for f in job}
    if "--nodes" not in given and "--config" not in given:
        job = [*job, "--nodes", str(nodes)]
    return job


def _checked(args: argparse.Namespace, job: list[str]) -> tuple[
        list[str], list[HostFault], list[tuple[str, str]], list[tuple[str, str]]]:
    """The job's flags, the faults, caps and delays, once every flag checks out."""
    if not 2 <= args.hosts <= 250:
        raise _UsageError(f"--hosts {args.hosts}: need 2 to 250 (a coordinator and agents)")
    if args.workers < 1:
        raise _UsageError(f"--workers {args.workers}: need at least 1")
    if not 1 <= args.port <= 65534:
        raise _UsageError(f"--port {args.port}: need 1 to 65534")
    hosts = ["coord", *(f"a{i}" for i in range(1, args.hosts))]
    faults = fault_schedule(args.cut, args.kill_host, hosts)
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
    job = job_flags(job, (args.hosts - 1) * args.workers)
    reason = unsupported_reason()
    if reason is not None:
        raise _UsageError(reason)
    return job, faults, caps, delays


def main(argv: Sequence[str] | None = None) -> int:
    """`bamboo lab`: the coordinator's exit status, 2 (one line on stderr) for bad flags."""
    ours, job = _split(sys.argv[1:] if argv is None else argv)
    args = lab_parser().parse_args(ours)
    try:
        job, faults, caps, delays = _checked(args, job)
    except _UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    from bamboo.chaos.lab.session import LabSession, run_lab, token_file
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bamboo-lab-"))
    try:
        out.mkdir(parents=True, exist_ok=True)
        token = token_file(out)
    except OSError as e:
        print(f"{PROG}: error: --out {out}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return run_lab(LabSession(hosts=args.hosts, workers=args.workers, port=args.port,
                                  job=job, out=out.resolve(), token=token.resolve(),
                                  faults=faults, caps=caps, delays=delays))
    finally:
        if not args.out and {p.name for p in out.iterdir()} <= {"join-token"}:
            shutil.rmtree(out, ignore_errors=True)  # a temporary directory nothing ran in
