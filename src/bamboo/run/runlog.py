"""The run directory: events.jsonl as things happen, summary.json and the model at the end.

Nothing here ever overwrites a finished run: a directory that already holds a run
is refused before any file is written, and files are written to a temporary name
and renamed, so a reader never sees half a file.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bamboo.config import ConfigError
from bamboo.run.interface import Interface
from bamboo.util import strict_json

__all__ = ["RunDir", "RunDirError", "EventLog", "EventLogError", "read_events", "write_atomic",
           "default_run_dir", "checkpoint_root"]

_RUN_FILES = ("summary.json", "events.jsonl")


def default_run_dir(root: str = "runs") -> Path:
    """runs/<timestamp>, with a suffix if that name is taken."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = Path(root) / stamp, 1
    while path.exists():
        n += 1
        path = Path(root) / f"{stamp}-{n}"
    return path


def checkpoint_root(run_dir: str | Path) -> Path:
    """Where a run keeps its checkpoints: `<run dir>/checkpoints` (or the folder itself,
    when it is a checkpoints folder)."""
    path = Path(run_dir)
    return path if (path / "LATEST").exists() or path.name == "checkpoints" else path / "checkpoints"


class RunDirError(OSError):
    """A file of the run directory could not be written; str() is one line that names the
    file and why, e.g. `could not write runs/x/model.pt: No space left on device`."""

    def __init__(self, path: str | Path, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause) or type(cause).__name__,
                         str(path))

    def __str__(self) -> str:
        return f"could not write {self.filename}: {self.strerror}"


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename; on any failure the
    temporary file is removed, `path` is as it was, and RunDirError says what failed."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:  # a full disk, an I/O error, or an interrupt mid-write
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise RunDirError(path, e) from e
        raise


class EventLog:
    """Appends one JSON object a line, flushed at once, with `t` since the run began."""

    def __init__(self, path: Path, t0: float) -> None:
        self._file = open(path, "a", buffering=1, encoding="utf-8")
        self._t0 = t0
        self.bytes_written = 0
        """Bytes appended by this process (the log's growth, for the run's summary)."""
        self.listeners: list[Callable[[dict], None]] = []
        """Called with every record once it is written (TensorBoard and W&B scalars)."""

    def write(self, event: str, **fields: Any) -> dict:
        record = {"t": round(time.monotonic() - self._t0, 4), "event": event, **fields}
        line = strict_json.dumps(record) + "\n"
        self._file.write(line)
        self.bytes_written += len(line)
        self._file.flush()
        for listener in self.listeners:
            listener(record)
        return record

    def close(self) -> None:
        self._file.close()


class EventLogError(ValueError):
    """A whole line of an events.jsonl that is not an event; str() names the file and line."""

    def __init__(self, path: str | Path, line: int, reason: str) -> None:
        super().__init__(f"{path} line {line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


def read_events(path: str | Path, *, check: Callable[[dict], None] | None = None,
                on_cut_short: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """The records of an events.jsonl, in file order: the one reader of what `EventLog`
    writes (reports, the timeline model, profiles, tests).

    A last line without its newline that does not parse is being written by a running
    coordinator, or was cut short by a killed one: it is left out (`on_cut_short(line)`
    is told). Any other line that is not a JSON object, or that `check` rejects with a
    ValueError, is an EventLogError naming the file and line. Blank lines are skipped."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
            if check is not None:
                check(record)
        except ValueError as e:
            if number == len(lines):  # no newline after it
                if on_cut_short is not None:
                    on_cut_short(number)
                break
            raise EventLogError(path, number, str(e)) from None
        records.append(record)
    return records


class RunDir:
    """A run's output folder."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.restarting = False
        """`--resume auto` before the first whole checkpoint: the run starts over in its own
        folder (a restarted coordinator), so an earlier attempt's files are no obstacle."""

    def check_usable(self, interface: Interface = Interface.CLI) -> None:
        """ConfigError if the folder already holds a run or is not a folder (in the words of
        the `interface` the run was started from)."""
        out = interface.out
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"{out}{self.path} exists and is not a directory: choose another "
                              f"path")
        taken = [name for name in _RUN_FILES if (self.path / name).exists()]
        if taken:
            raise ConfigError(f"{out}{self.path} already holds a run ({taken[0]}): "
                              f"{interface.add_resume()} to continue it (or to extend it with "
                              f"{interface.steps()}), or choose a new directory")

    def check_writable(self, flag: str = "--out") -> None:
        """ConfigError unless the folder can be created here and a file written in it (a
        read-only file system, /proc, a full quota...). Leaves nothing behind: the folders
        it had to create are removed again."""
        created: list[Path] = []
        where = self.path
        try:
            missing, p = [], self.path
            while not p.exists() and p != p.parent:
                missing.append(p)
                p = p.parent
            for d in reversed(missing):
                where = d
                d.mkdir()
                created.append(d)
            where = self.path / f".bamboo-write-test-{os.getpid()}"
            with open(where, "wb"):
                pass
            where.unlink()
        except OSError as e:
            raise ConfigError(f"{flag} {self.path}: cannot write {where} "
                              f"({e.strerror or type(e).__name__}): choose a directory you "
                              f"can write to") from None
        finally:
            for d in reversed(created):
                with contextlib.suppress(OSError):
                    d.rmdir()

    def create(self, resume: bool = False) -> None:
        if not resume and not self.restarting:  # a resumed run continues its own folder
            self.check_usable()
        self.path.mkdir(parents=True, exist_ok=True)

    def events(self, t0: float) -> EventLog:
        return EventLog(self.path / "events.jsonl", t0)

    def write_json(self, name: str, obj: Any) -> Path:
        path = self.path / name
        write_atomic(path, (strict_json.dumps(obj, indent=2) + "\n").encode())
        return path
