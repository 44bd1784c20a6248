"""`--layer-costs` in a real run: stages cut by measured seconds per layer, and a kill still
ending equal to the failure-free run. (The file and its refusals:
tests/unit/engine/test_layer_costs.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from support.costs import write_layer_costs
from support.procs import run_events
from support.runs import assert_equals_failure_free, config, run_in_process


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_stages_follow_the_measured_costs_and_a_kill_ends_equal(tmp_path: Path) -> None:
    """Costs that make the last three layers dear give them a stage each (parameter counts
    would cut 2/2/2/2); the math does not change: a kill still ends equal to the
    failure-free run."""
    costs = write_layer_costs(tmp_path / "c.json", layer_s=[1.0] * 5 + [5.0] * 3)
    cfg = config(dict(steps=6, kills=["0:2@3"], layer_costs=str(costs)))
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equals_failure_free(summary, cfg)
    events = run_events(tmp_path / "run")
    ready = next(e for e in events if e["event"] == "generation_ready")
    assert ready["parts"] == [[0, 5], [5, 6], [6, 7], [7, 8]]
    assert summary["failovers"] == 1
