"""A user's own step, killed in flight: a tiny per-token classifier with dropout
(tests/support/user_data.py) on a user's map-style Dataset (`--dataset`, with a held-out
`--eval-dataset`), a label-smoothing loss (`--loss`) and an accuracy metric (`--metric`).
The shadow adopts the lost last stage from its eager FRC, whose loss and metric values are
the lost node's; the run ends with its failure-free run's bits, losses and metrics, and with
the single-process loop's on the same Dataset, loss and metric."""
from __future__ import annotations

from pathlib import Path

import pytest

from bamboo.chaos.bits import differs
from support.reference import train_reference
from support.runs import REL, assert_close, config, param_l2, run_in_process
from support.user_data import DATASET, EVAL_DATASET, IMAGE_MODEL, IMAGES, LOSS, METRIC, MODEL

pytestmark = [pytest.mark.procs, pytest.mark.slow]  # every test here starts processes

FLAGS = dict(model=MODEL, dataset=DATASET, eval_dataset=EVAL_DATASET, loss=LOSS,
             metrics=[METRIC], nodes=4, stages=2, micro_batches=2, micro_batch_size=4,
             steps=6, eval_every=3, eval_batches=2)


@pytest.mark.timeout(300)
def test_a_users_dataset_loss_and_metric_killed_in_flight_end_equal(tmp_path: Path) -> None:
    clean = run_in_process(config(FLAGS), tmp_path / "clean")
    # the last stage of pipeline 1, mid-epoch 1; the scalars to TensorBoard too
    cfg = config(FLAGS, kills=["1:1@3"], tensorboard=str(tmp_path / "tb"))
    killed = run_in_process(cfg, tmp_path / "killed")
    assert clean["status"] == killed["status"] == "completed", killed.get("error")
    assert killed["failovers"] == 1 == killed["preemptions"]
    assert differs(clean, killed) == ""
    assert killed["param_sha256"] == clean["param_sha256"]
    for key in ("losses", "eval_losses", "metrics", "eval_metrics", "data"):
        assert killed[key] == clean[key], key
    # 6 steps of 4 x 4 samples over 40: the third epoch, 16 samples in
    assert killed["data"] == {"dataset": DATASET, "epoch": 2, "position": 16, "samples": 96,
                              "dataset_size": 40}
    evals: list[list[float]] = []
    metrics: list[dict[str, float]] = []
    eval_metrics: list[list] = []
    losses, params = train_reference(cfg, evals, metrics, eval_metrics)
    assert_close(killed["losses"], losses, rel=REL)
    assert_close(killed["param_l2"], param_l2(params), rel=REL)
    assert [s for s, _ in killed["eval_losses"]] == [s for s, _ in evals] == [3, 6]
    assert_close([v for _, v in killed["eval_losses"]], [v for _, v in evals], rel=REL)
    assert [list(m) for m in killed["metrics"]] == [["accuracy"]] * 6
    assert_close([m["accuracy"] for m in killed["metrics"]],
                 [m["accuracy"] for m in metrics], rel=REL)
    assert_close([m["accuracy"] for _, m in killed["eval_metrics"]],
                 [m["accuracy"] for _, m in eval_metrics], rel=REL)
    assert killed["losses"][-1] < killed["losses"][0]  # it learns
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    board = EventAccumulator(str(tmp_path / "tb"))
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("train/accuracy")] == \
        [(step, pytest.approx(m["accuracy"])) for step, m in enumerate(killed["metrics"])]
    assert [(e.step, e.value) for e in board.Scalars("eval/accuracy")] == \
        [(step, pytest.approx(m["accuracy"])) for step, m in killed["eval_metrics"]]


@pytest.mark.timeout(300)
def test_an_image_classifier_without_a_context_killed_in_flight_ends_equal(
        tmp_path: Path) -> None:
    """An nn.Sequential CNN that declares only its inputs (no `context`, no vocabulary), on
    an image Dataset: killed in flight, the failure-free run's bits and the single-process
    loop's losses."""
    flags = dict(model=IMAGE_MODEL, dataset=IMAGES, nodes=4, stages=2, micro_batches=2,
                 micro_batch_size=4, steps=4)
    clean = run_in_process(config(flags), tmp_path / "clean")
    killed = run_in_process(config(flags, kills=["0:1@2"]), tmp_path / "killed")
    assert clean["status"] == killed["status"] == "completed", killed.get("error")
    assert killed["failovers"] == 1
    assert (killed["losses"], killed["param_sha256"]) == (clean["losses"], clean["param_sha256"])
    losses, params = train_reference(config(flags))
    assert_close(killed["losses"], losses, rel=REL)
    assert_close(killed["param_l2"], param_l2(params), rel=REL)
