"""Workers pinned to cores of their own (`--pin-cpus auto`), in a real run."""
from __future__ import annotations

import os

import pytest

from support.runs import assert_close

pytestmark = pytest.mark.procs  # every test here starts processes


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin two workers")
def test_two_workers_on_two_cores_are_pinned_and_train_the_same(bamboo) -> None:
    flags = ["--nodes", "2", "--stages", "2", "--steps", "3", "--micro-batches", "2"]
    pinned = bamboo(flags + ["--pin-cpus", "auto"], "pinned")
    plain = bamboo(flags, "plain")
    assert pinned.code == 0 and plain.code == 0, pinned.stderr + plain.stderr
    cpus = {e["node"]: e["cpus"] for e in pinned.events() if e["event"] == "pinned"}
    assert set(cpus) == {"n0", "n1"}
    assert sorted(c for share in cpus.values() for c in share) == \
        sorted(os.sched_getaffinity(0))[:2 * (len(os.sched_getaffinity(0)) // 2)]
    assert not [e for e in plain.events() if e["event"] == "pinned"]
    assert_close(pinned.summary["losses"], plain.summary["losses"], rel=1e-6)
    assert pinned.summary["config"]["pin_cpus"] == "auto"
