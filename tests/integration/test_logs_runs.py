"""A script's own process sees Bamboo's lines on stderr when it configured no logging, routes them
to a handler of its own, and silences them by the `bamboo` logger's level (docs/api.md,
"Output"); the job (tests/support/completed_run.py) starts no worker. In this process:
tests/unit/api/test_logs.py."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support.completed_run import completed_run, said_lines

REPO = Path(__file__).resolve().parents[2]


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
    trace, run = completed_run(tmp_path)
    path = tmp_path / "script.py"
    path.write_text(SCRIPT + textwrap.indent(textwrap.dedent(body), "    "))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(path), str(trace), str(run)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return (done.stdout.splitlines(), done.stderr.splitlines(),
            said_lines("bamboo.train", trace, run, "steps=", "out="))


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
