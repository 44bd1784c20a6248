"""Schedules as data: complete, correctly ordered, deadlock-free, memory-bounded."""
from __future__ import annotations

import pytest

from bamboo.plan import schedule as S


@pytest.mark.parametrize("stages", range(1, 9))
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4, 7, 12])
@pytest.mark.parametrize("builder", [S.one_f_one_b, S.gpipe])
def test_schedules_complete_without_deadlock(builder, stages: int, micro_batches: int) -> None:
    schedules = [builder(s, stages, micro_batches) for s in range(stages)]
    order = S.simulate(schedules)
    for s, sched in enumerate(schedules):
        fwd = [i.mb for i in sched if isinstance(i, S.Forward)]
        bwd = [i.mb for i in sched if isinstance(i, S.Backward)]
        assert sorted(fwd) == list(range(micro_batches)) == sorted(bwd)
        assert isinstance(sched[-1], (S.Backward, S.SendGrad))  # the commit round follows
        assert all(i.stage == s for i in sched)
    assert len(order) == sum(len(s) for s in schedules)


@pytest.mark.parametrize("stages,micro_batches", [(4, 8), (3, 5), (8, 16)])
def test_one_f_one_b_bounds_micro_batches_in_flight(stages: int, micro_batches: int) -> None:
    for s in range(stages):
        in_flight = peak = 0
        for instr in S.one_f_one_b(s, stages, micro_batches):
            in_flight += isinstance(instr, S.Forward) - isinstance(instr, S.Backward)
            peak = max(peak, in_flight)
        assert peak == min(stages - s, micro_batches)


def test_simulate_detects_deadlock() -> None:
    # Stage 1 waits for a gradient before receiving the activation it depends on.
    stage0 = [S.Forward(0, 0), S.RecvGrad(0, 0), S.SendActivation(0, 0), S.Backward(0, 0)]
    stage1 = [S.RecvActivation(1, 0), S.Forward(1, 0), S.Backward(1, 0), S.SendGrad(1, 0)]
    with pytest.raises(S.ScheduleError, match="deadlock"):
        S.simulate([stage0, stage1])


def test_simulate_rejects_backward_before_forward() -> None:
    with pytest.raises(S.ScheduleError, match="before its forward"):
        S.simulate([[S.Backward(0, 0), S.Forward(0, 0)]])
