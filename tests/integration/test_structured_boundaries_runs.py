"""A model whose layers hand on a dict of tensors (tests/support/structured_model.py: a
float hidden state, a float gate the last layer leaves unused, a bool mask), killed in
flight: the shadow adopts the lost stage with its eager FRC results, its successor gets
the structured activations again, and the run ends with its failure-free run's bits and
with the single-process loop's losses and parameters (held-out losses too)."""
from __future__ import annotations

from pathlib import Path

import pytest

from bamboo.chaos.bits import differs
from support.reference import train_reference
from support.runs import REL, assert_close, config, param_l2, run_in_process
from support.structured_model import NAME

pytestmark = [pytest.mark.procs]


@pytest.mark.timeout(300)
def test_a_structured_boundary_model_killed_in_flight_ends_equal(tmp_path: Path) -> None:
    flags = dict(model=NAME, nodes=4, stages=4, steps=4, micro_batches=2, micro_batch_size=2,
                 eval_every=2, eval_batches=2)
    clean = run_in_process(config(flags), tmp_path / "clean")
    cfg = config(flags, kills=["0:2@2"])
    killed = run_in_process(cfg, tmp_path / "killed")
    assert clean["status"] == killed["status"] == "completed", killed.get("error")
    assert killed["failovers"] == 1 == killed["preemptions"]
    assert killed["checkpoint_restores"] == killed["redone_steps"] == 0
    assert differs(clean, killed) == ""
    assert killed["param_sha256"] == clean["param_sha256"]
    assert killed["losses"] == clean["losses"]
    assert killed["eval_losses"] == clean["eval_losses"]
    evals: list[list[float]] = []
    losses, params = train_reference(cfg, evals)
    assert_close(killed["losses"], losses, rel=REL)
    assert_close(killed["param_l2"], param_l2(params), rel=REL)
    assert_close([v for _, v in killed["eval_losses"]], [v for _, v in evals], rel=REL)
