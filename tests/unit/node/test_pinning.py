"""`--pin-cpus auto`: each local worker on cores of its own, results unchanged.
Its tests that start processes: tests/integration/test_pinning_runs.py."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bamboo.node.pinning import cores_for


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
