"""Watching and stopping processes from outside, as a user or the machine would: is a pid
alive, a process's children, a launcher's fork server, a `bamboo train` left running."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from support.procs import BAMBOO, REPO, run_events


def alive(pid: int) -> bool:
    """`pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after waiting up to `timeout` for all of them to end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def kill_all(pids: list[int]) -> None:
    """SIGKILL to each pid that still exists."""
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def children(pid: int) -> list[int]:
    """The children of `pid` (those of each of its threads)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, children first."""
    out: list[int] = []
    for child in children(pid):
        out += [child, *descendants(child)]
    return out


def command(pid: int) -> str:
    """The command line of `pid` ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def fork_server(pid: int) -> int:
    """The multiprocessing fork server started by `pid` (a launcher or an agent)."""
    return next(c for c in children(pid) if "multiprocessing.forkserver" in command(c))


def session_processes(sid: int) -> list[int]:
    """Every process of the session `sid`."""
    out = subprocess.run(["ps", "-eo", "sid=,pid="], capture_output=True, text=True).stdout
    return [int(p) for s, p in (line.split() for line in out.splitlines()) if int(s) == sid]


def start_training(out: Path, *extra: str) -> subprocess.Popen:
    """`bamboo train --steps 500` in the background: long enough to be stopped mid-run."""
    return subprocess.Popen([*BAMBOO, "train", "--steps", "500", "--quiet", "--out", str(out),
                             *extra],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_steps(out: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until the run in `out` has done its first step (fails if `proc` ended before)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e["event"] == "step_done" for e in run_events(out)):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError("training never reached its first step")
