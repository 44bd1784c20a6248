"""Bamboo's warnings and notes are `logging` records of `bamboo.*` loggers (docs/api.md,
"Output"): in this process they reach the root's handlers, and the command prints the same
lines as before and leaves no handler behind. The job (tests/support/completed_run.py) starts
no worker. A script's own process: tests/integration/test_logs_runs.py."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

import bamboo
from bamboo.cli import main
from support.completed_run import completed_run, said_lines


def test_bamboo_trains_warning_and_note_are_records_of_its_module_logger(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Under pytest the root logger has handlers (the script's, as far as Bamboo can tell):
    the records go there, and Bamboo adds no handler of its own."""
    trace, run = completed_run(tmp_path)
    caplog.set_level(logging.INFO, logger="bamboo")
    job = bamboo.Job(nodes=2, stages=2, steps=2, trace=str(trace), resume="auto")
    assert bamboo.train(job, out=run).losses == [5.0, 4.0]
    said = [(r.name, r.levelno, getattr(r, "prog", None), r.getMessage())
            for r in caplog.records if r.name.startswith("bamboo")]
    warning, note = said_lines("bamboo.train", trace, run, "steps=", "out=")
    assert said == [("bamboo.api.start", logging.WARNING, "bamboo.train",
                     warning.removeprefix("bamboo.train: warning: ")),
                    ("bamboo.api.start", logging.INFO, "bamboo.train",
                     note.removeprefix("bamboo.train: "))]
    assert [type(h) for h in logging.getLogger("bamboo").handlers] == [logging.NullHandler]


def test_the_command_prints_the_same_lines_once_and_keeps_no_handler(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Once: not again through a handler on the root logger (one of a user's module, here
    one printing on stderr too)."""
    trace, run = completed_run(tmp_path)
    bamboo_logger, root = logging.getLogger("bamboo"), logging.getLogger()
    before = list(bamboo_logger.handlers), bamboo_logger.level, bamboo_logger.propagate
    users = logging.StreamHandler(sys.stderr)
    root.addHandler(users)
    try:
        assert main(["train", "--nodes", "2", "--stages", "2", "--steps", "2", "--trace",
                     str(trace), "--resume", "auto", "--out", str(run), "--quiet"]) == 0
    finally:
        root.removeHandler(users)
    assert capsys.readouterr().err.splitlines() == said_lines("bamboo train", trace, run,
                                                          "--steps", "--out")
    assert (bamboo_logger.handlers, bamboo_logger.level, bamboo_logger.propagate) == before










def test_a_runs_warning_reaches_the_logger_when_the_display_is_off(
        caplog: pytest.LogCaptureFixture) -> None:
    """`quiet=True` turns the display off, not the run's warnings: they are records a script
    sees (in its call's words); the display's other lines are not."""
    from bamboo.run.progress import ProgressDisplay
    display = ProgressDisplay(3, enabled=False, prog="bamboo.train")
    with caplog.at_level(logging.INFO, logger="bamboo"):
        display.message("warning: --kill 0:9@1 names no node")
        display.message("lost n1 in step 2: failover")
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == \
        [("bamboo.run.progress", "WARNING", "--kill 0:9@1 names no node")]
    assert caplog.records[0].prog == "bamboo.train"
