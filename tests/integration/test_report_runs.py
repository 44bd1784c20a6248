"""`bamboo report` as a command: its exit codes, and --debug for the traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bamboo.cli.report import main
from bamboo.run.report import ReportError
from support.procs import REPO

pytestmark = pytest.mark.procs  # every test here starts processes


def test_command_line_exit_code_and_debug(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    cmd = [sys.executable, "-m", "bamboo.cli.report", str(missing)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr == (f"bamboo report: error: run directory '{missing}' does not exist: "
                           f"give a directory written by bamboo train --out\n")
    with pytest.raises(ReportError):
        main([str(missing), "--debug"])
    assert main(["--spot-price", "-1", str(missing)]) == 2
