"""Running the real `bamboo` command in a subprocess and reading its run directory; free
loopback ports; a real tmpfs for full or read-only disks."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bamboo.run.runlog import read_events
from support.strict import strict_loads

REPO = Path(__file__).resolve().parents[2]
BAMBOO = [sys.executable, "-m", "bamboo"]


@dataclass
class Result:
    """What a finished `bamboo` command left: its exit code, its output and its run
    directory."""
    code: int
    stdout: str
    stderr: str
    out: Path

    @property
    def summary(self) -> dict:
        path = self.out / "summary.json"
        return strict_loads(path.read_text(), str(path))

    def events(self) -> list[dict]:
        return run_events(self.out)


def run_events(out: Path) -> list[dict]:
    """The events of the run directory `out`: whole lines only (its coordinator may be
    writing the last one right now); [] before the file exists."""
    path = out / "events.jsonl"
    return read_events(path) if path.exists() else []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, and so was the one after it (a
    coordinator's store takes its --bind port + 1 by default)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            try:
                with socket.socket() as t:
                    t.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two free TCP ports in a row on 127.0.0.1")


def run_bamboo(args: list[str], out: Path | None, timeout: float = 240) -> Result:
    """Run `bamboo ARGS [--out OUT]` to completion (killed after `timeout`); a `--json`
    output on stdout must be strict JSON."""
    cmd = BAMBOO + args + (["--out", str(out)] if out is not None else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if "--json" in args and proc.returncode == 0:
        strict_loads(proc.stdout, f"`bamboo {' '.join(args)}` stdout")
    return Result(proc.returncode, proc.stdout, proc.stderr, out or Path("/nonexistent"))


@contextlib.contextmanager
def mounted_tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A real tmpfs at `path` (e.g. options "size=64k" for a disk that fills up, "ro" for a
    read-only one), unmounted on exit; the test is skipped where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                              capture_output=True, text=True, timeout=30)
    except OSError as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(path)], check=True, timeout=30)
