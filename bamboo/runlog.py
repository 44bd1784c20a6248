"""The run directory: events.jsonl as things happen, summary.json and the model at the end.

Nothing here ever overwrites a finished run: a directory that already holds a run
is refused before any file is written, and files are written to a temporary name
and renamed, so a reader never sees half a file.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from bamboo.config import ConfigError

__all__ = ["RunDir", "EventLog", "write_atomic", "default_run_dir"]

_RUN_FILES = ("summary.json", "events.jsonl")


def default_run_dir(root: str = "runs") -> Path:
    """runs/<timestamp>, with a suffix if that name is taken."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = Path(root) / stamp, 1
    while path.exists():
        n += 1
        path = Path(root) / f"{stamp}-{n}"
    return path


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class EventLog:
    """Appends one JSON object a line, flushed at once, with `t` since the run began."""

    def __init__(self, path: Path, t0: float) -> None:
        self._file = open(path, "a", buffering=1, encoding="utf-8")
        self._t0 = t0

    def write(self, event: str, **fields: Any) -> dict:
        record = {"t": round(time.monotonic() - self._t0, 4), "event": event, **fields}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        return record

    def close(self) -> None:
        self._file.close()


class RunDir:
    """A run's output folder."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def check_usable(self) -> None:
        """ConfigError if the folder already holds a run or is not a folder."""
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"--out {self.path} exists and is not a directory: choose another path")
        taken = [name for name in _RUN_FILES if (self.path / name).exists()]
        if taken:
            raise ConfigError(f"--out {self.path} already holds a run ({taken[0]}): choose a new "
                              f"directory or remove the old run")

    def create(self, resume: bool = False) -> None:
        if not resume:  # a resumed run continues its own folder
            self.check_usable()
        self.path.mkdir(parents=True, exist_ok=True)

    def events(self, t0: float) -> EventLog:
        return EventLog(self.path / "events.jsonl", t0)

    def write_json(self, name: str, obj: Any) -> Path:
        path = self.path / name
        write_atomic(path, (json.dumps(obj, indent=2) + "\n").encode())
        return path
