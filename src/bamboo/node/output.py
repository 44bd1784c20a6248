"""Where a worker's own output goes: its node's log file, never its launcher's stdout.

A worker runs the user's model code, DeepSpeed and Hugging Face, which print and log to
stdout and stderr. Left alone, that text would reach the terminal of `bamboo train` and,
under `--json`, the summary a script parses. So each worker points its descriptors 1 and 2
at one file (appended, so a resumed run's worker of the same name adds to it):

    RUN/logs/n3.log               a local worker of the run in RUN
    ./bamboo-logs/n3.log          a worker of `bamboo agent` (its --log-dir), on its machine

Descriptors, not only `sys.stdout`: a C library's writes and a logger that kept the old
stream object land there too. The fork server that forks the local workers sends its own
stdout to stderr (`stdout_to_stderr`). Tracebacks still reach the coordinator through the
worker's pipe (`WorkerError`), and from there events.jsonl and the run's one-line error.
"""
from __future__ import annotations

import os
import sys
import time

__all__ = ["to_log", "stdout_to_stderr", "flush", "LOG_DIR", "AGENT_LOG_DIR"]

LOG_DIR = "logs"
"""The run directory's folder of local workers' logs (`n<id>.log`)."""
AGENT_LOG_DIR = "bamboo-logs"
"""Where `bamboo agent` keeps its workers' logs by default (beside it: its working folder)."""


def flush() -> None:
    """Write out what this process's Python streams hold (before `os._exit`, which does not)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its descriptor is gone
            pass


def stdout_to_stderr() -> None:
    """This process's stdout (descriptor 1) goes to its stderr from now on."""
    flush()
    os.dup2(2, 1)


def to_log(path: str | None, name: str) -> str | None:
    """Point this process's descriptors 1 and 2 at the log file `path` (its folder made,
    appended to, a header line naming `name` and this process first). When it cannot be
    opened (or `path` is None), stdout goes to stderr instead; the reason is returned, to
    be said on stderr."""
    flush()
    why = None
    if path is not None:
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            why = f"cannot write its log {path} ({e.strerror or e}): its output goes to stderr"
        else:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            os.write(fd, f"--- {name} (pid {os.getpid()}) started {stamp}\n".encode())
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            _line_buffered()
            return None
    os.dup2(2, 1)
    return why


def _line_buffered() -> None:
    """Each line reaches the file when it is written: a worker killed by SIGKILL keeps
    what it printed before."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a TextIO may lack reconfigure; the try below handles it
        except (AttributeError, ValueError, OSError):  # replaced by something else
            pass
