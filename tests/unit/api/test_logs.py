"""Bamboo's warnings and notes are `logging` records of `bamboo.*` loggers: a script sees the
command line's lines on stderr when it configured no logging, silences them by the `bamboo`
logger's level and routes them with a handler of its own (docs/api.md, "Output"); the
command prints the same lines as before, and leaves no handler behind.

The job of every test is one `bamboo.train` that starts no worker: its trace has a row out of
time order (a warning) and `resume="auto"` finds its run already complete (a note)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import bamboo
from bamboo.cli import main

REPO = Path(__file__).resolve().parents[3]

TRACE = "0,add,n0\n0,add,n1\n60,remove,n1\n30,add,n2\n"
"""Two adds for `nodes=2`, and one row (the last) out of time order."""


def _completed_run(where: Path) -> tuple[Path, Path]:
    """The trace, and a run directory whose 2-step run already completed."""
    trace, run = where / "trace.csv", where / "run"
    trace.write_text(TRACE)
    run.mkdir()
    (run / "summary.json").write_text('{"status": "completed", "steps_completed": 2, '
                                      '"losses": [5.0, 4.0], "config": {}}')
    return trace, run


def _lines(prog: str, trace: Path, run: Path, steps: str, out: str) -> list[str]:
    """What the call or command `prog` says of that job, in its own words."""
    return [f"{prog}: warning: {trace}: 1 row(s) out of time order were sorted",
            f"{prog}: the run in {run} already completed 2 steps; nothing to do (pass more "
            f"{steps}, or another {out} for a new run)"]


def test_bamboo_trains_warning_and_note_are_records_of_its_module_logger(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Under pytest the root logger has handlers (the script's, as far as Bamboo can tell):
    the records go there, and Bamboo adds no handler of its own."""
    trace, run = _completed_run(tmp_path)
    caplog.set_level(logging.INFO, logger="bamboo")
    job = bamboo.Job(nodes=2, stages=2, steps=2, trace=str(trace), resume="auto")
    assert bamboo.train(job, out=run).losses == [5.0, 4.0]
    said = [(r.name, r.levelno, getattr(r, "prog", None), r.getMessage())
            for r in caplog.records if r.name.startswith("bamboo")]
    warning, note = _lines("bamboo.train", trace, run, "steps=", "out=")
    assert said == [("bamboo.api.start", logging.WARNING, "bamboo.train",
                     warning.removeprefix("bamboo.train: warning: ")),
                    ("bamboo.api.start", logging.INFO, "bamboo.train",
                     note.removeprefix("bamboo.train: "))]
    assert [type(h) for h in logging.getLogger("bamboo").handlers] == [logging.NullHandler]


def test_the_command_prints_the_same_lines_once_and_keeps_no_handler(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Once: not again through a handler on the root logger (one of a user's module, here
    one printing on stderr too)."""
    trace, run = _completed_run(tmp_path)
    bamboo_logger, root = logging.getLogger("bamboo"), logging.getLogger()
    before = list(bamboo_logger.handlers), bamboo_logger.level, bamboo_logger.propagate
    users = logging.StreamHandler(sys.stderr)
    root.addHandler(users)
    try:
        assert main(["train", "--nodes", "2", "--stages", "2", "--steps", "2", "--trace",
                     str(trace), "--resume", "auto", "--out", str(run), "--quiet"]) == 0
    finally:
        root.removeHandler(users)
    assert capsys.readouterr().err.splitlines() == _lines("bamboo train", trace, run,
                                                          "--steps", "--out")
    assert (bamboo_logger.handlers, bamboo_logger.level, bamboo_logger.propagate) == before


SCRIPT = """\
import logging, sys
import bamboo

def train(marker):
    print(marker, file=sys.stderr, flush=True)
    job = bamboo.Job(nodes=2, stages=2, steps=2, trace=sys.argv[1], resume="auto")
    assert bamboo.train(job, out=sys.argv[2]).losses == [5.0, 4.0]

if __name__ == "__main__":
"""


def _script(tmp_path: Path, body: str) -> tuple[list[str], list[str], list[str]]:
    """Run SCRIPT with `body` under its `__main__` guard on the job; its stdout's and
    stderr's lines, and the lines the API says of the job."""
    trace, run = _completed_run(tmp_path)
    path = tmp_path / "script.py"
    path.write_text(SCRIPT + textwrap.indent(textwrap.dedent(body), "    "))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(path), str(trace), str(run)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return (done.stdout.splitlines(), done.stderr.splitlines(),
            _lines("bamboo.train", trace, run, "steps=", "out="))


@pytest.mark.procs
@pytest.mark.timeout(150)
def test_a_script_sees_the_lines_and_then_routes_them_to_its_own_handler(
        tmp_path: Path) -> None:
    """No logging configured: the command line's lines on stderr. Then a handler of the
    script's on the root logger (on stdout here): the records go there alone, once each."""
    out, err, lines = _script(tmp_path, """\
        train("default")
        logging.basicConfig(stream=sys.stdout, format="%(levelname)s %(name)s %(message)s")
        train("routed")
    """)
    assert err == ["default", *lines, "routed"]
    assert out == [lines[0].replace("bamboo.train: warning: ", "WARNING bamboo.api.start "),
                   lines[1].replace("bamboo.train: ", "INFO bamboo.api.start ")]


@pytest.mark.procs
@pytest.mark.timeout(150)
def test_a_script_silences_bamboo_by_its_loggers_level(tmp_path: Path) -> None:
    """Set before the first call, and between two calls."""
    out, err, lines = _script(tmp_path, """\
        logging.getLogger("bamboo").setLevel(logging.ERROR)
        train("silenced")
        logging.getLogger("bamboo").setLevel(logging.INFO)
        train("shown")
        logging.getLogger("bamboo").setLevel(logging.ERROR)
        train("silenced again")
    """)
    assert err == ["silenced", "shown", *lines, "silenced again"] and out == []


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
