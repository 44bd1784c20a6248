"""`--precision fp16` in real processes: the first steps of a model whose gradients overflow
at the initial loss scale are skipped on every node and replica (the replicas' digests are
checked after every step), a node killed in a skipped step and one killed later change
nothing, the scaler's state survives a restore from a checkpoint, and a model whose
gradients are NaN at any scale stops clearly before any weight turns NaN."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bamboo.chaos.bits import differs
from support.half_precision import COLLAPSING_MODEL, DATASET, MODEL
from support.runs import config, run_in_process

pytestmark = [pytest.mark.procs, pytest.mark.slow]  # every test here starts processes

FLAGS = dict(model=MODEL, dataset=DATASET, loss="torch.nn.functional:cross_entropy",
             nodes=3, stages=3, micro_batches=2, micro_batch_size=8, steps=8,
             precision="fp16", checkpoint_every=2)


@pytest.mark.timeout(300)
def test_overflowing_steps_are_skipped_alike_and_kills_change_nothing(tmp_path: Path) -> None:
    clean = run_in_process(config(FLAGS), tmp_path / "clean")
    assert clean["status"] == "completed", clean.get("error")
    assert clean["skipped_steps"] == [0, 1] and clean["loss_scale"] == 2.0 ** 14, clean
    steps = [json.loads(line) for line in (tmp_path / "clean" / "events.jsonl").open()
             if '"step_done"' in line]
    assert [(e["loss_scale"], e["skipped"]) for e in steps[:3]] == \
        [(2.0 ** 16, True), (2.0 ** 15, True), (2.0 ** 14, False)]
    assert all(math.isfinite(x) for x in clean["losses"])
    for kills in (["0:1@1"], ["0:2@4"]):  # in a skipped step; in a step applied
        killed = run_in_process(config(FLAGS, kills=kills), tmp_path / kills[0].replace(":", "-"))
        assert killed["failovers"] == 1, killed
        assert differs(clean, killed) == "" and killed["param_sha256"] == clean["param_sha256"]
        assert killed["skipped_steps"] == clean["skipped_steps"]
    params = torch.load(tmp_path / "clean" / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in params.values())


@pytest.mark.timeout(300)
def test_the_loss_scale_survives_a_restore_from_a_checkpoint(tmp_path: Path) -> None:
    """Stages 0 and 1 of the one pipeline lost together in step 5: no live copy of stage 1,
    so the run restores the checkpoint of step 4 on the standbys, with the scale it had
    there, and ends with the failure-free run's losses and bits."""
    flags = FLAGS | {"nodes": 5}
    clean = run_in_process(config(flags), tmp_path / "clean")
    killed = run_in_process(config(flags, kills=["0:0@5", "0:1@5"]), tmp_path / "killed")
    assert killed["checkpoint_restores"] >= 1, killed
    assert differs(clean, killed) == "", differs(clean, killed)
    assert (killed["skipped_steps"], killed["loss_scale"]) == \
        (clean["skipped_steps"], clean["loss_scale"])


@pytest.mark.timeout(300)
def test_a_model_whose_gradients_overflow_at_any_scale_stops_clearly(tmp_path: Path) -> None:
    summary = run_in_process(config(FLAGS, model=COLLAPSING_MODEL, steps=40), tmp_path / "run")
    assert summary["status"] == "failed" and summary["exit_code"] != 0
    error = summary["error"]
    assert error.startswith("fp16: the gradients of step 24 overflowed again (25 steps in a "
                            "row skipped): the loss scale fell to 0.00195312"), error
    assert "bf16 or fp32" in error
    assert summary["steps_completed"] == 24 and summary["skipped_steps"] == list(range(24))
