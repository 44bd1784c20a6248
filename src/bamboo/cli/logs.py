"""What the `bamboo` command prints of the library's log: its warnings and notes on stderr.

The library logs (`bamboo.util.logs`); the command decides how that is printed. For the run of
one command `bamboo.cli.main` puts a `StderrLines` handler on the `bamboo` logger at INFO
(DEBUG under `--debug`), so each record is the line the command has always printed
(`bamboo train: warning: ...`, `bamboo train: note: ...`), and stdout (`--json`, a report, a
table) stays the command's own.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from bamboo.util.logs import ROOT, StderrLines

__all__ = ["to_stderr"]


@contextmanager
def to_stderr(debug: bool = False) -> Iterator[None]:
    """Print the `bamboo` logger's records, INFO and up (DEBUG and up with `debug`), on
    stderr while the block runs, and only there: not also through a root handler that code
    the command imports may have set up (a user's model module calling
    `logging.basicConfig()`). The logger is as it was afterwards (a test that runs commands
    in its own process keeps no handler behind)."""
    logger = logging.getLogger(ROOT)
    shown = logging.DEBUG if debug else logging.INFO
    handler, level, propagate = StderrLines(shown), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(shown)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
