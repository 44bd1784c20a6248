"""fp16's dynamic loss scale (bamboo.plan.loss_scale): GradScaler's rules, step by step and
in one go from the steps skipped, and the point where it collapses."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bamboo.plan.loss_scale import GROWTH_INTERVAL, INIT_SCALE, MIN_SCALE, LossScale, scale_at


def test_an_overflow_halves_the_scale_and_a_clean_interval_doubles_it() -> None:
    state = LossScale()
    assert state.after(True) == LossScale(INIT_SCALE / 2, 0)
    for _ in range(GROWTH_INTERVAL - 1):
        state = state.after(False)
    assert state == LossScale(INIT_SCALE, GROWTH_INTERVAL - 1)
    assert state.after(False) == LossScale(INIT_SCALE * 2, 0)
    assert state.after(True) == LossScale(INIT_SCALE / 2, 0)  # the tracker starts again


@given(st.sets(st.integers(0, 5000), max_size=20), st.integers(0, 5000), st.integers(0, 300))
def test_the_scale_at_a_step_is_the_steps_one_by_one(skipped: set[int], step: int,
                                                     start_step: int) -> None:
    start = LossScale(2.0 ** 10, 1990)
    state = start
    for k in range(start_step, step):
        state = state.after(k in skipped)
    assert scale_at(step, skipped, start, start_step) == state


def test_24_overflows_in_a_row_from_the_start_collapse_the_scale() -> None:
    assert not scale_at(24, range(24)).collapsed
    assert scale_at(24, range(24)).scale == MIN_SCALE
    assert scale_at(25, range(25)).collapsed


def test_its_json_reads_back() -> None:
    state = LossScale(256.0, 17)
    assert LossScale.from_json(state.to_json()) == state
    assert LossScale.from_json(None) == LossScale()
