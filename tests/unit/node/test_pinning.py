"""`--pin-cpus auto`: each local worker on cores of its own, results unchanged."""
from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bamboo.node.pinning import cores_for
from support.runs import assert_close


def test_an_equal_disjoint_share_each() -> None:
    assert [cores_for(s, 2, [0, 1]) for s in range(2)] == [[0], [1]]
    assert [cores_for(s, 2, [0, 1, 2, 3, 4]) for s in range(2)] == [[0, 1], [2, 3]]
    assert cores_for(0, 3, [0, 1]) is None  # fewer cores than workers: no pinning at all
    assert cores_for(2, 2, [0, 1]) is None  # a slot past the share (a worker still ending)
    assert cores_for(None, 1, [0]) is None


@given(st.integers(1, 16), st.lists(st.integers(0, 255), min_size=1, max_size=64, unique=True))
def test_shares_never_overlap_and_never_run_short(workers: int, cores: list[int]) -> None:
    shares = [cores_for(s, workers, cores) for s in range(workers)]
    if len(cores) < workers:
        assert shares == [None] * workers
        return
    flat = [c for share in shares for c in share]
    assert len(flat) == len(set(flat)) and set(flat) <= set(cores)
    assert all(len(share) == len(cores) // workers for share in shares)


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
