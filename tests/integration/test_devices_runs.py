"""benchmarks/gpu_check.py as a user runs it, on a machine without a GPU."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.procs import REPO

pytestmark = pytest.mark.procs  # every test here starts processes


def test_gpu_check_without_a_gpu_says_so_and_exits_0() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU even where there is one
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith("gpu_check: no GPU present (")
    assert "--device cuda" in lines[0] and "--kill 0:2@6" in lines[0]
