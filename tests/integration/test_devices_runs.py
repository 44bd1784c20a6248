"""benchmarks/gpu_check.py as a user runs it, on a machine without a GPU."""
from __future__ import annotations

import json
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


@pytest.mark.timeout(180)
def test_gpu_overhead_measures_both_loops_on_the_cpu(tmp_path) -> None:
    """The harness on the CPU: both loops run the steps asked for and report their times."""
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_overhead.py", "--device", "cpu",
                           "--model", "gpt2-tiny", "--steps", "4", "--warmup", "1",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=170)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    assert figures["plain_s"] > 0 and figures["bamboo_s"] > 0
    assert figures["timers"]["compute_s"] > 0
    assert "x the plain loop" in proc.stdout


def test_gpu_overhead_without_a_gpu_says_so_and_exits_0() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_overhead.py"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpu_overhead: no CUDA device here")


@pytest.mark.timeout(120)
def test_gpu_overhead_says_in_one_line_why_the_bamboo_run_failed() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/gpu_overhead.py", "--device", "cpu",
                           "--model", "gpt2-tiny", "--steps", "2", "--warmup", "0",
                           "--bamboo-flags=--redundancy=bogus"], cwd=REPO, capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_overhead: bamboo train failed (exit 2)")
    assert "--redundancy" in lines[0], lines
