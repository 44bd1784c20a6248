"""The `ip` and `tc` commands a lab runs: each with a timeout, a failure a `LabError`
naming the command and its stderr; which namespaces exist; tc rates and tbf settings."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence

__all__ = ["LabError", "NetemUnavailable", "COMMAND_TIMEOUT_S", "unsupported_reason",
           "lab_prefix", "run_command", "namespaces", "leftover_namespaces", "parse_rate", "tbf_args",
           "del_root_qdisc"]

COMMAND_TIMEOUT_S = 15.0
"""Seconds any single `ip`/`tc` call may take before it is a `LabError`."""


class LabError(RuntimeError):
    """An `ip`/`tc` command failed (or timed out, or is missing): the command and its stderr."""

    def __init__(self, message: str, command: Sequence[str] = (), stderr: str = "") -> None:
        self.command = list(command)
        self.stderr = stderr
        text = message
        if command:
            text += f": `{' '.join(self.command)}`"
        if stderr.strip():
            text += f": {stderr.strip()}"
        super().__init__(text)


class NetemUnavailable(LabError):
    """This kernel has no netem qdisc (sch_netem), so `Lab.delay` cannot add latency."""


def unsupported_reason() -> str | None:
    """Why a lab cannot be built on this machine (not root, no `ip`), or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root: run as root (or with sudo)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


def lab_prefix(pid: int | None = None) -> str:
    """The prefix of every namespace made by labs of process `pid` (default: this one)."""
    return f"bb{(os.getpid() if pid is None else pid) % 10000:04d}"


def run_command(argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run one `ip`/`tc` command; a nonzero exit is a `LabError` with its stderr."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise LabError(f"`{argv[0]}` is not installed", argv) from None
    except subprocess.TimeoutExpired:
        raise LabError(f"timed out after {timeout:g} s", argv) from None
    if proc.returncode != 0:
        raise LabError(f"exit status {proc.returncode}", argv, proc.stderr)
    return proc


def namespaces() -> list[str]:
    """Every named network namespace (`ip netns list`); [] when `ip` is missing."""
    try:
        out = run_command(["ip", "netns", "list"]).stdout
    except LabError:
        if shutil.which("ip") is None:
            return []
        raise
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def leftover_namespaces(prefix: str) -> list[str]:
    """The named network namespaces whose name starts with `prefix` (e.g. `lab_prefix()` for
    every lab of this process, or `lab.prefix` for one lab), sorted."""
    return sorted(n for n in namespaces() if n.startswith(prefix))


_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


def parse_rate(rate: str) -> float:
    """Bits per second of a tc rate such as "8mbit", "500kbit" or "1mbps" (bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(rate))
    if m is None or m.group(2).lower() not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"bad rate '{rate}': use a number and one of "
                         f"{', '.join(_RATE_UNITS)} (e.g. 8mbit)")
    return float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]


def tbf_args(rate: str) -> list[str]:
    """tbf arguments for `rate`: a bucket of 10 ms of traffic (at least 32 KiB, so a
    full-size segment always fits) and at most 100 ms of queue."""
    burst = max(32 * 1024, int(parse_rate(rate) / 8 / 100))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]


def del_root_qdisc(netns: str, dev: str) -> None:
    """Remove `dev`'s root qdisc, if it has one of its own."""
    try:
        run_command(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root"])
    except LabError as e:
        text = e.stderr.lower()
        if not any(s in text for s in ("no such file", "cannot delete qdisc with handle of zero",
                                       "cannot find specified qdisc")):
            raise
