"""A command whose reader leaves early (`bamboo ... | head -1`) ends quietly: no error line,
the status a pipe's writer gets (128 + SIGPIPE), as cat or grep give."""
from __future__ import annotations

import signal
import subprocess

import pytest

from support.procs import BAMBOO, REPO

pytestmark = pytest.mark.procs


@pytest.mark.timeout(120)
def test_a_reader_that_leaves_early_gets_no_error_line() -> None:
    writer = subprocess.Popen([*BAMBOO, "timeline", "--stages", "4", "--micro-batches", "8",
                               "--forward", "10", "--backward", "20", "--pipelines", "2"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert writer.stdout is not None
    first = writer.stdout.readline()
    writer.stdout.close()  # the reader leaves after one line, before the writer is done
    _, err = writer.communicate(timeout=60)
    assert first.strip(), "the command printed nothing"
    assert err.decode() == ""
    assert writer.returncode in (0, 128 + signal.SIGPIPE)
