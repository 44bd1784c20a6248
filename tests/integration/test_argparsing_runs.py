"""The commands imported in a fresh interpreter: no library module imports bamboo.cli, and no
command module imports torch before it runs."""
from __future__ import annotations

import subprocess
import sys

import pytest

from support.procs import REPO

pytestmark = pytest.mark.procs  # every test here starts processes


@pytest.mark.timeout(60)
def test_the_commands_do_not_import_the_cli() -> None:
    """`bamboo profile` took its parser from bamboo.cli, which imports it back: a circle. The
    library behind each command imports nothing of bamboo.cli, and neither it nor the
    command's module imports torch before the command runs."""
    code = ("import sys, bamboo.sim.profile, bamboo.run.report, bamboo.run.export, "
            "bamboo.data.tokens, bamboo.chaos.soak, bamboo.chaos.lab.session; "
            "print(sorted(m for m in sys.modules if m.startswith('bamboo.cli') or m == 'torch'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    code = ("import sys, bamboo.cli.profile, bamboo.cli.report, bamboo.cli.simulate, "
            "bamboo.cli.export, bamboo.cli.data, bamboo.cli.soak, bamboo.cli.lab; "
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
