"""Eager FRC where a node would wait (`--frc-at waits`, the default) or at its fixed slot
(`--frc-at slot`): every micro-batch's redundant forward runs either way, the results are the
failure-free run's, and only waits place them in the node's waits. (A failover reusing them
is `tests/test_failover.py`'s scenarios, which run the default.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from bamboo.config import JobConfig
from support.procs import run_events
from support.runs import assert_equals_failure_free, run_in_process

STEPS, M = 4, 4


def _frc_per_step(run: Path) -> list[tuple[int, int]]:
    """(FRC forwards, of them run in a wait) summed over the nodes, per step."""
    return [(sum(n["frc_forwards"] for n in e["nodes"]), sum(n["frc_in_waits"] for n in e["nodes"]))
            for e in run_events(run) if e["event"] == "step_done"]


@pytest.mark.procs
@pytest.mark.timeout(180)
@pytest.mark.parametrize("place", ["waits", "slot"])
def test_every_redundant_forward_runs_and_results_are_equal(place: str, tmp_path: Path) -> None:
    cfg = JobConfig.of(nodes=2, stages=2, micro_batches=M, steps=STEPS, redundancy="eager",
                       frc_at=place).validate()
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equals_failure_free(summary, cfg)
    per_step = _frc_per_step(tmp_path / "run")
    assert [total for total, _ in per_step] == [2 * M] * STEPS  # each node: its replica, every mb
    in_waits = sum(w for _, w in per_step)
    if place == "slot":
        assert in_waits == 0
    else:
        # Stage 0 sends micro-batch 0 and must wait for its gradient (a forward and a
        # backward of stage 1 away): every step has that wait to fill.
        assert in_waits >= STEPS, per_step
