"""Bamboo's messages as `logging` records, and the handler that prints them as lines.

Every module logs through its own logger (`logging.getLogger(__name__)`: `bamboo.api.start`,
`bamboo.run.checkpoint`, ...); the library never prints a message itself and never touches
the root logger (`bamboo/__init__.py` gives the `bamboo` logger a `NullHandler`). A record
said in the words of an interface carries its name: `log.warning(text, extra=by(prog))`,
`prog` being `bamboo train`, `bamboo.train`, ... Who prints the records:

- the command line (`bamboo.cli.logs`): INFO and up on stderr, for the command's run;
- the Python API (`fallback_output`, called by `bamboo.train` and `bamboo.Trainer`): the
  same lines, when the script has configured no logging of its own (docs/api.md, "Output");
- a worker process (`worker_output`): the same lines on its stderr, which is its log file
  (`bamboo.node.output`).

The command and a worker print the records only through their handler (the `bamboo` logger
does not propagate then); the Python API leaves propagation to the script.

Each line is the one the command line has always printed: `PROG: warning: TEXT`, `PROG: TEXT`
for a note, and `TEXT` alone for a record that names no interface.
"""
from __future__ import annotations

import logging
import sys
from typing import TextIO

__all__ = ["ROOT", "by", "Lines", "StderrLines", "fallback_output", "worker_output"]

ROOT = "bamboo"
"""The logger every module's logger is a child of: the one a script silences or routes."""

_PROG = "prog"
"""The record attribute naming the interface that speaks (`extra=by(prog)`)."""


def by(prog: str) -> dict[str, str]:
    """`extra=` for a record said in the words of `prog` (`bamboo train`, `bamboo.train`):
    its line begins with `prog: `."""
    return {_PROG: prog}


def _word(level: int) -> str:
    """What follows `PROG: ` for a record of `level`: the level's name for a warning or an
    error, nothing for a note."""
    if level >= logging.ERROR:
        return "error: "
    return "warning: " if level >= logging.WARNING else ""


class Lines(logging.Formatter):
    """A record as its line: `PROG: warning: TEXT` (WARNING), `PROG: error: TEXT` (ERROR and
    up), `PROG: TEXT` (below), and `TEXT` alone for a record without `prog`."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        prog = getattr(record, _PROG, None)
        return f"{prog}: {_word(record.levelno)}{text}" if prog else text


class StderrLines(logging.StreamHandler[TextIO]):
    """Writes each record as its `Lines` line on the `sys.stderr` of the moment (a test's
    capture, a worker's log file), not on the one there was when it was made.

    `fallback=True`: the Python API's handler, which steps aside (prints nothing) for a record
    that another handler will take, one the script added to `bamboo` or to the root logger
    since, so that nothing is printed twice."""

    def __init__(self, level: int = logging.INFO, *, fallback: bool = False) -> None:
        logging.Handler.__init__(self, level)  # StreamHandler's would pin today's stream
        self.fallback = fallback
        self.setFormatter(Lines())

    @property  # type: ignore[override]  # read-only: always the stream of the moment
    def stream(self) -> TextIO:
        return sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        if self.fallback and _handled_elsewhere(self, record):
            return
        super().emit(record)


def _handled_elsewhere(me: logging.Handler, record: logging.LogRecord) -> bool:
    """Whether a handler other than `me` (and other than a NullHandler) sits on the way of
    `record` up to the root logger, as `logging` counts handlers for its last resort."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None:
        if any(h is not me and not isinstance(h, logging.NullHandler) for h in logger.handlers):
            return True
        if not logger.propagate:
            return False
        logger = logger.parent
    return False


def _configured(logger: logging.Logger) -> bool:
    """Whether a handler of the script's (other than a NullHandler) is on `logger` or on
    the root logger."""
    return any(not isinstance(h, logging.NullHandler)
               for h in [*logger.handlers, *logging.getLogger().handlers])


def fallback_output() -> None:
    """The Python API's output when the script has configured no logging (no handler on the
    `bamboo` logger nor on the root logger): a `StderrLines` on `bamboo` that prints its
    warnings and notes as the command line does, the logger set to INFO unless the script
    set its level. With a handler of the script's, nothing is added: the records go there.
    Called on every `bamboo.train` and `bamboo.Trainer`; adds at most one handler."""
    logger = logging.getLogger(ROOT)
    if _configured(logger):
        return
    logger.addHandler(StderrLines(fallback=True))
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def worker_output() -> None:
    """A worker process's output: its records, INFO and up, as lines on its stderr (its log
    file by then), and only there: a root handler the user's code set up in the worker
    writes to the same file, which would have each line twice. Adds at most one handler."""
    logger = logging.getLogger(ROOT)
    if not any(isinstance(h, StderrLines) for h in logger.handlers):
        logger.addHandler(StderrLines())
    logger.setLevel(logging.INFO)
    logger.propagate = False
