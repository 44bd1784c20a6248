"""`Lab`: N hosts (network namespaces) on one bridge, with faults applied through `ip` and `tc`.

Layout of a lab whose prefix is P (``bb`` + 4 digits of the pid + a 2-digit counter, so two
labs, or two test processes, never share a name; every interface name stays <= 15 chars):

    namespace P-sw        bridge Pbr, ports Pp0, Pp1, ...     (the "switch")
    namespace P-coord     Ph0  10.X.Y.1/24   + its own lo     (host 0)
    namespace P-a1        Ph1  10.X.Y.2/24   + its own lo     (host 1) ...

X is drawn from 200..250 and Y from 0..255; the /24 exists only inside these namespaces
(no address or route of the machine's own namespace is created or changed: the veth pairs
are created directly inside the switch and host namespaces). Every call to `ip`/`tc` has a
timeout, and a failure is a `LabError` naming the command and its stderr.

`close()` kills every process in the lab's namespaces and deletes them (which deletes the
veths and the bridge). It is idempotent, runs from `__exit__` also when the body raised,
and, as a best effort, at interpreter exit and on SIGTERM; a SIGKILLed owner leaves its
namespaces behind (`leftover_namespaces(prefix)` finds them, `ip netns del` removes them).
"""
from __future__ import annotations

import atexit
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from bamboo.chaos.lab.commands import (
    LabError,
    NetemUnavailable,
    del_root_qdisc,
    lab_prefix,
    leftover_namespaces,
    namespaces,
    parse_rate,
    run_command,
    tbf_args,
    unsupported_reason,
)

__all__ = ["Host", "Lab", "LabError", "NetemUnavailable", "lab_prefix", "leftover_namespaces",
           "unsupported_reason"]

KILL_TIMEOUT_S = 10.0
"""Seconds `kill_host` keeps killing until the namespace holds no process."""

MAX_HOSTS = 250


@dataclass(frozen=True)
class Host:
    """One host of a lab: its namespace, its address on the lab's /24 and its interface."""

    name: str
    netns: str
    address: str
    interface: str
    """The host's end of its veth pair, inside `netns` (e.g. for GLOO_SOCKET_IFNAME)."""
    port: str
    """The bridge's end of the veth pair, inside the switch namespace."""
    index: int

    def __str__(self) -> str:
        return self.name


# Labs not closed yet, closed at interpreter exit and on SIGTERM (best effort).
_OPEN: dict[int, Lab] = {}
_OPEN_LOCK = threading.Lock()
_HOOKS_INSTALLED = False
_COUNTER = 0


def _close_all() -> None:
    with _OPEN_LOCK:
        labs = list(_OPEN.values())
    for lab in labs:
        if lab._owner_pid == os.getpid():  # never from a forked child
            try:
                lab.close()
            except Exception:  # noqa: BLE001 (best effort: the others still get closed)
                pass


def _install_hooks() -> None:
    """atexit, and a SIGTERM handler that closes the open labs and then does what the
    previous handler did (the default: die of SIGTERM). Installed once, main thread only."""
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    atexit.register(_close_all)
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_IGN, None):
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        _close_all()
        if callable(previous):
            previous(signum, frame)
        else:  # SIG_DFL: die of the signal, as without a lab
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


class Lab:
    """N hosts (network namespaces) on one Linux bridge; a context manager.

    `hosts` is a count (names "coord", "a1", "a2", ...) or a list of names (lowercase
    letters and digits, at most 8 chars). The namespaces exist as soon as the constructor
    returns; `close()` (or leaving the `with`) removes them. Methods take a `Host` or a
    host's name.
    """

    def __init__(self, hosts: int | Sequence[str] = 2) -> None:
        reason = unsupported_reason()
        if reason is not None:
            raise LabError(f"cannot build a lab: {reason}")
        names = _host_names(hosts)
        self._owner_pid = os.getpid()
        self._closed = False
        self._lock = threading.RLock()
        self._procs: dict[str, list[subprocess.Popen]] = {n: [] for n in names}
        self._caps: dict[str, str] = {}
        self._delays: dict[str, float] = {}
        self.prefix = self._free_prefix()
        rng = random.SystemRandom()
        self.subnet = f"10.{rng.randint(200, 250)}.{rng.randint(0, 255)}"
        self.switch = f"{self.prefix}-sw"
        self.bridge = f"{self.prefix}br"
        self.hosts = [Host(name=n, netns=f"{self.prefix}-{n}", address=f"{self.subnet}.{i + 1}",
                           interface=f"{self.prefix}h{i}", port=f"{self.prefix}p{i}", index=i)
                      for i, n in enumerate(names)]
        self._made: list[str] = []  # namespaces created, deleted by close()
        with _OPEN_LOCK:
            _OPEN[id(self)] = self
        _install_hooks()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- building -------------------------------------------------------------------------

    @staticmethod
    def _free_prefix() -> str:
        """`lab_prefix()` + a 2-digit counter that no existing namespace uses."""
        global _COUNTER
        taken = {n.split("-")[0] for n in leftover_namespaces(lab_prefix())}
        with _OPEN_LOCK:
            for _ in range(100):
                prefix = f"{lab_prefix()}{_COUNTER % 100:02d}"
                _COUNTER += 1
                if prefix not in taken:
                    return prefix
        raise LabError(f"100 labs of this process ({lab_prefix()}*) already exist: close some")

    def _add_netns(self, name: str) -> None:
        run_command(["ip", "netns", "add", name])
        self._made.append(name)
        run_command(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        self._add_netns(self.switch)
        run_command(["ip", "-n", self.switch, "link", "add", self.bridge, "type", "bridge"])
        run_command(["ip", "-n", self.switch, "link", "set", self.bridge, "up"])
        for h in self.hosts:
            self._add_netns(h.netns)
            # Both ends are born in their namespaces: nothing passes through the root one.
            run_command(["ip", "-n", self.switch, "link", "add", h.port, "type", "veth",
                  "peer", "name", h.interface, "netns", h.netns])
            run_command(["ip", "-n", self.switch, "link", "set", h.port, "master", self.bridge])
            run_command(["ip", "-n", self.switch, "link", "set", h.port, "up"])
            run_command(["ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", h.interface])
            run_command(["ip", "-n", h.netns, "link", "set", h.interface, "up"])

    # -- lookup ---------------------------------------------------------------------------

    def host(self, host: Host | str) -> Host:
        """The `Host` named `host` (a `Host` is returned as is, if it is one of this lab's)."""
        name = host.name if isinstance(host, Host) else host
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host '{name}' in this lab: {', '.join(h.name for h in self.hosts)}")

    def __getitem__(self, name: str) -> Host:
        return self.host(name)

    def _check_open(self) -> None:
        if self._closed:
            raise LabError(f"lab {self.prefix} is closed")

    # -- processes ------------------------------------------------------------------------

    def run(self, host: Host | str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Start `argv` in `host` (`ip netns exec NS argv...`) in a new session, so the
        process and its children are one process group. Keyword arguments go to Popen."""
        self._check_open()
        h = self.host(host)
        popen_kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", h.netns, *argv], **popen_kwargs)
        with self._lock:
            self._procs[h.name].append(proc)
        return proc

    def call(self, host: Host | str, argv: Sequence[str], timeout: float = 30.0,
             **run_kwargs: Any) -> subprocess.CompletedProcess:
        """Run `argv` in `host` to completion (output captured as text unless told otherwise);
        its exit status is not checked."""
        self._check_open()
        h = self.host(host)
        run_kwargs.setdefault("capture_output", True)
        run_kwargs.setdefault("text", True)
        return subprocess.run(["ip", "netns", "exec", h.netns, *argv], timeout=timeout,
                              **run_kwargs)

    def pids(self, host: Host | str) -> list[int]:
        """Every process in `host`'s namespace (`ip netns pids`)."""
        return self._netns_pids(self.host(host).netns)

    @staticmethod
    def _netns_pids(netns: str) -> list[int]:
        out = run_command(["ip", "netns", "pids", netns]).stdout
        return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]

    def kill_host(self, host: Host | str, timeout: float = KILL_TIMEOUT_S) -> list[int]:
        """SIGKILL every process in `host` (as a reclaimed spot instance), until none is
        left; returns the pids killed. The host's network stays as it was."""
        h = self.host(host)
        return self._kill_netns(h.netns, self._procs.get(h.name, []), timeout)

    def _kill_netns(self, netns: str, procs: list[subprocess.Popen], timeout: float) -> list[int]:
        killed: list[int] = []
        deadline = time.monotonic() + timeout
        while True:
            pids = self._netns_pids(netns)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            # Our own children too, by process group: one started a moment ago may still be
            # `ip netns exec` outside the namespace, where `ip netns pids` cannot see it.
            killed += _kill_own(procs)
            for p in procs:  # reap our own children, which would otherwise stay zombies
                p.poll()
            if not pids and all(p.poll() is not None for p in procs):
                break
            if time.monotonic() > deadline:
                raise LabError(f"processes {pids} of {netns} survive SIGKILL after {timeout:g} s")
            time.sleep(0.02)
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return sorted(set(killed))

    # -- faults ---------------------------------------------------------------------------

    def cut(self, host: Host | str) -> None:
        """Take `host`'s link down: it reaches no one and no one reaches it, until
        `reconnect`; its processes keep running."""
        self._check_open()
        h = self.host(host)
        run_command(["ip", "-n", h.netns, "link", "set", h.interface, "down"])

    def reconnect(self, host: Host | str) -> None:
        """Bring `host`'s link back up (its address and route come back with it)."""
        self._check_open()
        h = self.host(host)
        run_command(["ip", "-n", h.netns, "link", "set", h.interface, "up"])

    def cap(self, host: Host | str, rate: str = "8mbit") -> None:
        """Limit `host`'s bandwidth to `rate` (tc syntax, e.g. "8mbit") in both directions:
        a tbf on its veth (egress) and on the bridge's end of it (its ingress)."""
        self._check_open()
        h = self.host(host)
        parse_rate(rate)  # a bad rate is a ValueError before anything changes
        self._need_tc()
        old = self._caps.get(h.name)
        self._caps[h.name] = rate
        try:
            self._shape_egress(h)
            run_command(["ip", "netns", "exec", self.switch, "tc", "qdisc", "replace", "dev", h.port,
                  "root", *tbf_args(rate)])
        except LabError:
            if old is None:
                self._caps.pop(h.name, None)
            else:
                self._caps[h.name] = old
            raise

    def uncap(self, host: Host | str) -> None:
        """Undo `cap` (a `delay` stays)."""
        self._check_open()
        h = self.host(host)
        if self._caps.pop(h.name, None) is None:
            return
        self._shape_egress(h)
        del_root_qdisc(self.switch, h.port)

    def delay(self, host: Host | str, ms: float) -> None:
        """Add `ms` milliseconds to every packet `host` sends (tc netem on its veth), so
        each round trip to it grows by `ms`; 0 removes the delay. `NetemUnavailable` when
        the kernel has no netem (nothing is changed then)."""
        self._check_open()
        h = self.host(host)
        if ms < 0:
            raise ValueError(f"delay must be >= 0 ms, not {ms}")
        self._need_tc()
        old = self._delays.get(h.name)
        if ms:
            self._delays[h.name] = float(ms)
        else:
            self._delays.pop(h.name, None)
        try:
            self._shape_egress(h)
        except LabError:
            if old is None:
                self._delays.pop(h.name, None)
            else:
                self._delays[h.name] = old
            raise

    def qdiscs(self, host: Host | str) -> dict[str, str]:
        """`tc qdisc show` of `host`'s veth and of the bridge's end of it."""
        h = self.host(host)
        self._need_tc()
        return {
            "egress": run_command(["ip", "netns", "exec", h.netns, "tc", "qdisc", "show", "dev",
                            h.interface]).stdout.strip(),
            "ingress": run_command(["ip", "netns", "exec", self.switch, "tc", "qdisc", "show", "dev",
                             h.port]).stdout.strip(),
        }

    def _need_tc(self) -> None:
        if shutil.which("tc") is None:
            raise LabError("the `tc` command (iproute2) is not installed: no cap or delay")

    def _shape_egress(self, h: Host) -> None:
        """The root qdisc of `h`'s own veth from its cap and delay: netem (with the cap as
        netem's rate) when delayed, else tbf when capped, else none."""
        ms, rate = self._delays.get(h.name), self._caps.get(h.name)
        base = ["ip", "netns", "exec", h.netns, "tc", "qdisc", "replace", "dev", h.interface,
                "root"]
        if ms:
            argv = [*base, "netem", "delay", f"{ms:g}ms", "limit", "10000"]
            if rate:
                argv += ["rate", rate]
            try:
                run_command(argv)
            except LabError as e:
                text = e.stderr.lower()
                if any(s in text for s in ("unknown qdisc", "qdisc kind is unknown",
                                           "no such file or directory")):
                    raise NetemUnavailable("this kernel has no netem qdisc (sch_netem), so "
                                           "no delay can be added", argv, e.stderr) from None
                raise
        elif rate:
            run_command([*base, *tbf_args(rate)])
        else:
            del_root_qdisc(h.netns, h.interface)

    # -- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process in the lab's namespaces, then delete them (the veths and the
        bridge go with them). Idempotent; a `LabError` if a namespace could not be deleted
        (after trying all of them)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        errors: list[str] = []
        try:  # one deleted from outside meanwhile is simply gone
            existing = set(namespaces())
            self._made = [n for n in self._made if n in existing]
        except LabError:
            pass
        made = list(self._made)
        hosts = {h.netns: h.name for h in self.hosts}
        for netns in reversed(made):  # hosts first, so the switch stays until the end
            try:
                self._kill_netns(netns, self._procs.get(hosts.get(netns, ""), []), KILL_TIMEOUT_S)
            except LabError as e:
                errors.append(str(e))
        for netns in reversed(made):
            try:
                run_command(["ip", "netns", "del", netns])
                self._made.remove(netns)
            except LabError as e:
                if netns in namespaces():
                    errors.append(str(e))
                else:
                    self._made.remove(netns)
        with _OPEN_LOCK:
            _OPEN.pop(id(self), None)
        if errors:
            raise LabError(f"lab {self.prefix} not fully removed: " + "; ".join(errors))

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.close()
        except LabError:
            if exc is None:
                raise
            # The body's exception is the one to see; the teardown error is attached to it.

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        hosts = ", ".join(f"{h.name}={h.address}" for h in self.hosts)
        return f"<Lab {self.prefix} {state}: {hosts}>"


def _host_names(hosts: int | Sequence[str]) -> list[str]:
    if isinstance(hosts, int):
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"a lab has 1 to {MAX_HOSTS} hosts, not {hosts}")
        return ["coord", *(f"a{i}" for i in range(1, hosts))]
    names = list(hosts)
    if not 1 <= len(names) <= MAX_HOSTS:
        raise ValueError(f"a lab has 1 to {MAX_HOSTS} hosts, not {len(names)}")
    for n in names:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", n):
            raise ValueError(f"bad host name '{n}': lowercase letters and digits, at most 8, "
                             f"starting with a letter")
    if len(set(names)) != len(names):
        raise ValueError(f"host names repeat: {names}")
    return names


def _kill_own(procs: list[subprocess.Popen]) -> list[int]:
    """SIGKILL each of `procs` still running, with its process group where it leads one."""
    killed: list[int] = []
    for p in procs:
        if p.poll() is not None:
            continue
        try:
            if os.getpgid(p.pid) == p.pid:
                os.killpg(p.pid, signal.SIGKILL)
            else:
                os.kill(p.pid, signal.SIGKILL)
            killed.append(p.pid)
        except ProcessLookupError:
            pass
    return killed
