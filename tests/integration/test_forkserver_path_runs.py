"""The fork server starts under a TMPDIR too long for a Unix socket's path (Python 3.11
fails there with "AF_UNIX path too long"): multiprocessing gets a short directory in /tmp,
which is gone once the process exits."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from support.procs import REPO

pytestmark = [pytest.mark.procs]

_PROBE = """
import multiprocessing.util as util
from bamboo.node import forkserver
forkserver.start()
pid = forkserver.server_pid()
print(util.get_temp_dir(), pid is not None and forkserver.server_death() is None)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("long", [False, True])
def test_the_fork_server_starts_under_a_short_and_a_long_tmpdir(tmp_path: Path,
                                                                 long: bool) -> None:
    base = tmp_path if long else Path(tempfile.mkdtemp(prefix="t-", dir="/tmp"))
    tmpdir = base.joinpath(*["a-directory-with-a-long-name"] * (4 if long else 1))
    tmpdir.mkdir(parents=True)
    try:
        _check_the_server_starts(tmpdir)
    finally:
        if not long:
            shutil.rmtree(base)


def _check_the_server_starts(tmpdir: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True,
                          text=True, timeout=50, env=dict(os.environ, TMPDIR=str(tmpdir)))
    assert done.returncode == 0, done.stderr
    used, running = done.stdout.split()
    assert running == "True"
    if len(str(tmpdir)) > 75:
        assert Path(used).parent == Path("/tmp") and not Path(used).exists()
    else:
        assert Path(used).parent == tmpdir
