"""Scalars of real runs: TensorBoard event files and the wandb stream, through kills."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from support.procs import run_events
from support.runs import config, run_in_process

pytestmark = pytest.mark.procs  # every test here starts processes


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tensorboard_holds_the_runs_scalars_through_a_kill(tmp_path: Path) -> None:
    board = tmp_path / "tb"
    cfg = config(dict(nodes=3, stages=3, micro_batches=2, steps=5, eval_every=2,
                      kills=["0:1@2"], tensorboard=str(board)))
    summary = run_in_process(cfg, tmp_path / "run")
    assert summary["status"] == "completed", summary["error"]
    tb = tensorboard_scalars(board)
    # One numbering: x = K is the step's number (from 0, as in step_done) for train/loss, and
    # the eval at x = K is of the parameters train/loss at x = K was taken with.
    assert [s for s, _ in tb["train/loss"]] == [0, 1, 2, 3, 4]
    assert [v for _, v in tb["train/loss"]] == pytest.approx(summary["losses"], rel=1e-6)
    assert [s for s, _ in tb["eval/loss"]] == [s for s, _ in summary["eval_losses"]] == [2, 4, 5]
    assert [v for _, v in tb["eval/loss"]] == pytest.approx([v for _, v in summary["eval_losses"]],
                                                            rel=1e-6)
    assert tb["preemptions/failover"] == [(2, 1.0)] and tb["preemptions/total"] == [(2, 1.0)]
    [(step, pause)] = tb["failover/pause_s"]
    [lost] = [e for e in run_events(tmp_path / "run") if e["event"] == "node_lost"]
    assert step == 2 and pause == pytest.approx(lost["pause_s"], abs=1e-4)
    # the loss's whole cost (summary.json) = its pause + its shares of reconfigurations
    shares = sum(v for _, v in tb.get("preemptions/reconfiguration_s", []))
    assert pause + shares == pytest.approx(summary["pause_s"][0], abs=2e-4)
    live = dict(tb["cluster/live_nodes"])
    assert live[0] == 3 and live[4] == 2  # the node killed in step 2 is gone after it
    assert tb["cluster/redundancy_mode"] == [(0, 1.0)]  # lazy, the default
    for tag in ("train/lr", "train/grad_norm", "perf/samples_per_s", "perf/step_s"):
        assert len(tb[tag]) == 5 and all(v > 0 for _, v in tb[tag])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_wandb_offline_logs_the_same_values(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="the test extra installs wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = config(dict(nodes=2, stages=2, steps=3, eval_every=2, wandb="bamboo-test"))
    summary = run_in_process(cfg, tmp_path / "run")
    assert summary["status"] == "completed", summary["error"]
    [log] = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    keys = (b"train/loss", b"eval/loss", b"train/lr", b"perf/samples_per_s")
    # W&B's records keep each key and value as JSON text; its service process may still be
    # writing them when finish() returns on a loaded machine, so give it a few seconds.
    deadline = time.monotonic() + 30
    while not all(key in (data := log.read_bytes()) for key in keys) and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    for key in keys:
        assert key in data
    for value in [summary["losses"][-1], *[x for _, x in summary["eval_losses"]]]:
        assert json.dumps(value).encode() in data
