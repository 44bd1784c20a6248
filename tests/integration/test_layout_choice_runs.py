"""`bamboo train --stages auto --global-batch-size S` as a user runs it: the planner's choice
on stderr and in summary.json's config, and a kill at the chosen layout ending equal to the
failure-free run of the same global batch. (The planner and the options without processes:
tests/unit/plan/test_layout_choice.py, tests/unit/config/test_global_batch.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from support.procs import run_bamboo
from support.runs import config, reference

pytestmark = pytest.mark.procs  # starts a coordinator and its workers


@pytest.mark.timeout(240)
def test_the_chosen_layout_survives_a_kill_bit_equal_to_the_failure_free_run(
        tmp_path: Path) -> None:
    """gpt2-tiny fits one node's 64 MiB: one stage, four pipelines of one micro-batch each
    (32 samples a step). The node of pipeline 1 is killed in step 2; at --stages 1 no node
    keeps a replica, so its micro-batches are re-routed to the peer pipelines in flight (no
    failover, no restore, no step redone; the survivors keep what they finished of the step
    and then train on 3 pipelines), and under --exact every loss and the parameters equal
    the single-process loop's bit for bit."""
    done = run_bamboo(["train", "--nodes", "4", "--stages", "auto", "--global-batch-size", "32",
                       "--memory-per-node", "64MiB", "--steps", "5", "--kill", "1:0@2",
                       "--exact", "--no-report", "--quiet"], tmp_path / "run")
    assert done.code == 0, done.stderr
    [line] = [x for x in done.stderr.splitlines() if "--stages auto" in x]
    assert line.startswith("bamboo train: --stages auto: 1 stage x 4 pipelines, 1 micro-batch "
                           "of 8 (gpt2-tiny's "), line
    assert "fit --memory-per-node 64MiB at P=1" in line
    summary = done.summary
    chosen = {k: summary["config"][k] for k in ("stages", "pipelines", "micro_batches",
                                                "global_batch_size", "stages_auto")}
    assert chosen == {"stages": 1, "pipelines": 4, "micro_batches": 1, "global_batch_size": 32,
                      "stages_auto": True}
    assert summary["status"] == "completed"
    assert (summary["preemptions"], summary["reroutes"], summary["peer_restores"],
            summary["failovers"], summary["checkpoint_restores"],
            summary["redone_steps"]) == (1, 1, 0, 0, 0, 0)
    assert summary["reconfigurations"] >= 1  # onto the survivors' 3 x 1 after the step
    cfg = config(nodes=4, stages=1, global_batch_size=32, steps=5)
    losses, l2 = reference(cfg.training.steps, cfg.global_micro_batches, 8)
    assert cfg.global_micro_batches == 4 and summary["samples"] == 5 * 32
    assert summary["losses"] == losses and summary["param_l2"] == l2
