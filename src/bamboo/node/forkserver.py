"""The fork server that hands out ready workers.

Importing torch costs seconds per process, and the first optimizer built in a
process pulls in torch's compiler stack (seconds more). The fork server pays both
once, in `bamboo.node.preload`, and forks every worker from that warm state:
the initial workers, and later replacements and joins. `start()` is cheap and
torch-free, so the coordinator can start the server before importing torch itself
and the two imports overlap.

Lifetimes: the fork server dies (SIGKILL) with the process that started it, and every
worker dies (SIGKILL) with the fork server, both by the parent-death signal, so nothing
outlives the coordinator or agent, whatever state a worker is in (SIGKILL also ends a
stopped process). Python's own rule (the server exits when every holder of its "alive"
pipe has closed it) is not enough: each forked worker inherits that pipe, so one stopped
or hung worker kept the server and, through it, every worker alive. The resource tracker
ends by itself once the last of them has gone.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from multiprocessing import forkserver, process, util
from multiprocessing.context import BaseContext

__all__ = ["context", "start", "die_with_parent", "mark_server", "server_pid", "server_death",
           "in_server_child", "LOST_SERVER_EXIT"]

_PRELOAD = ["bamboo.node.preload"]
_PR_SET_PDEATHSIG = 1

_SERVER_PID: int | None = None
"""Set in the fork server (by the preload), so every process it forks knows its parent."""


def context() -> BaseContext:
    """The forkserver context, with the preload set."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def start() -> None:
    """Start the fork server now (it imports torch in the background). Call it from the
    main thread: the parent-death signal follows the thread that started the server."""
    context()
    _fit_socket_path()
    forkserver.ensure_running()


_SUN_PATH_MAX = 107
"""The longest path of a Unix socket Linux accepts (108 bytes with the NUL)."""
_SOCKET_NAME = "/pymp-xxxxxxxx/listener-xxxxxxxx"
"""What Python 3.11 adds to the temp directory for the fork server's socket."""


def _fit_socket_path() -> None:
    """Give multiprocessing a temp directory short enough for the fork server's Unix
    socket. Under a long TMPDIR Python 3.11 fails with "AF_UNIX path too long" (3.12 falls
    back by itself); /tmp is used then, and removed at exit as Python removes its own."""
    config = process.current_process()._config  # type: ignore[attr-defined]  # multiprocessing's private per-process config
    if config.get("tempdir") is not None:
        return
    if len(os.fsencode(tempfile.gettempdir() + _SOCKET_NAME)) <= _SUN_PATH_MAX:
        return
    short = tempfile.mkdtemp(prefix="pymp-", dir="/tmp")
    util.Finalize(None, shutil.rmtree, args=(short, True), exitpriority=-100)
    config["tempdir"] = short


def die_with_parent() -> None:
    """SIGKILL this process when its parent (the thread that forked it) dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def mark_server() -> None:
    """In the fork server, at preload: die with the coordinator (or agent) that started it
    (had that one already died, no worker holds the alive pipe yet: the server exits on
    its EOF), in a process group of its own."""
    global _SERVER_PID
    die_with_parent()
    _SERVER_PID = os.getpid()
    # A process group of its own, which its workers inherit: a terminal's Ctrl-C or
    # `timeout`'s SIGTERM, sent to the launcher's group, is the user stopping the run and
    # reaches the launcher alone (bamboo.control.user_stop), never the workers
    # as if each had a preemption notice.
    os.setpgid(0, 0)


def in_server_child() -> bool:
    """In a worker forked by the fork server: False when the server has died already (the
    worker's parent-death signal was set too late to fire), so the worker must exit now."""
    return _SERVER_PID is None or os.getppid() == _SERVER_PID


def server_pid() -> int | None:
    """The pid of the fork server this process started (None: none started)."""
    return forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]  # multiprocessing's private fork-server state


LOST_SERVER_EXIT = 255
"""The exit code `multiprocessing` gives a worker whose fork server it can no longer ask."""


def server_death(wait_s: float = 0.0, pid: int | None = None) -> str | None:
    """How the fork server this process started (or the earlier one `pid`) has ended ("was
    killed by SIGKILL", "exited with code 1"), None while it runs (or when none was
    started); waits up to `wait_s` for it to be seen ended (its sockets close before it
    does). It is not reaped here: `multiprocessing` reaps it when it restarts one."""
    pid = server_pid() if pid is None else pid
    deadline = time.monotonic() + wait_s
    while (how := _ended(pid)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return how


def _ended(pid: int | None) -> str | None:
    if pid is None:
        return None
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return "has ended"
    if info is None or info.si_pid == 0:
        return None
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return f"was killed by {signal.Signals(info.si_status).name}"
    return f"exited with code {info.si_status}"
