"""`benchmarks/peers`'s --pin in a real child process: a worker on the cores of its slot, an
unpinned job's worker left where it was. The job's other rules: tests/unit/benchmarks_peers/test_peers_job.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.procs
def test_pin_puts_a_worker_on_the_cores_of_its_slot() -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    code = ("from benchmarks.peers.job import Job; import os; "
            "Job(workers=2, pin=True).pin_worker(1); print(sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    share = len(cores) // 2
    assert out.stdout.strip() == str(cores[share:2 * share]), out.stderr


@pytest.mark.procs
def test_an_unpinned_job_leaves_the_worker_where_it_was() -> None:
    code = ("from benchmarks.peers.job import Job; import os; "
            "Job(workers=2).pin_worker(1); print(sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == str(sorted(os.sched_getaffinity(0))), out.stderr
