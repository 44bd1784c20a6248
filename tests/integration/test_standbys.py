"""Standbys and nodes that are coming, with real processes and a real trace replay.

A trace that removes every trained node while its replacements start: the replacements are
coming, so the run restores its checkpoint onto them and goes on (it once stopped with "no
live node is left to train on and none is coming"). A standby that is up fills a hole of
the layout at the next step boundary, whatever the other holes. Each run ends with the
losses and parameters of the failure-free run.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from bamboo.config import JobConfig, parse_kill
from support.procs import run_events
from support.runs import assert_close, reference, run_in_process

NEW_LAYOUT_REL = 1e-5
"""A restore onto another layout sums fp32 gradients in another order (the contract's
tolerance for a change of D)."""


def _trace(path: Path, rows: list[tuple[int, str, str]]) -> str:
    path.write_text("".join(f"{ms},{kind},{node}\n" for ms, kind, node in rows))
    return str(path)


def assert_equals_failure_free(summary: dict, cfg: JobConfig, rel: float) -> None:
    losses, l2 = reference(cfg.training.steps, cfg.global_micro_batches,
                           cfg.layout.micro_batch_size)
    assert summary["status"] == "completed", summary.get("error")
    assert_close(summary["losses"], losses, rel=rel)
    assert_close(summary["param_l2"], l2, rel=rel)


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_replacements_that_start_as_the_last_nodes_go_restore_the_checkpoint(
        tmp_path: Path) -> None:
    rows = [(0, "add", f"a{i}") for i in range(1, 5)] + \
        [(500, "add", f"b{i}") for i in range(1, 5)] + \
        [(4000, "remove", f"a{i}") for i in range(1, 5)]
    # 60 steps: the run must still be training when the trace removes the first nodes at 4 s
    # (20 steps once took 3.4 s on a quiet machine, and the run ended before any removal)
    cfg = JobConfig.of(nodes=4, stages=2, micro_batches=4, steps=60, max_nodes=4,
                       time_scale=1.0, boot_s=1.0, checkpoint_every=2,
                       trace=_trace(tmp_path / "t.csv", rows)).validate()
    summary = run_in_process(cfg, tmp_path / "run", check_replicas=False)
    assert_equals_failure_free(summary, cfg, NEW_LAYOUT_REL)
    events = run_events(tmp_path / "run")
    # the replacements boot at once and say hello in any order
    assert sorted(e["trace_node"] for e in events if e["event"] == "node_up")[4:] == \
        ["b1", "b2", "b3", "b4"]
    restores = [e for e in events if e["event"] == "checkpoint_restore"]
    assert restores, events
    # the newest checkpoint saved before the loss, or the initial state where a loaded
    # machine had not finished two steps when the trace removed the first nodes
    saved = [e["step"] for e in events
             if e["event"] == "checkpoint" and e["t"] <= restores[0]["t"]]
    assert restores[0]["step"] == max(saved, default=0), (restores[0], saved)
    assert (restores[0]["checkpoint"] is None) == (not saved), restores[0]
    assert summary["preemptions"] == 4 and summary["stopped"] == 0
    assert summary["checkpoint_restores"] >= 1


@pytest.mark.procs
@pytest.mark.timeout(400)
def test_a_standby_fills_one_of_two_rerouted_slots_and_keeps_the_bits_under_exact(
        tmp_path: Path) -> None:
    """`--redundancy reroute`, 2 x 2: two nodes of different stages and pipelines removed at
    once (both re-routed), one trace node waiting for a slot takes one `--boot-s` later. At
    the next boundary it fills one of the two holes (the other stays re-routed); a later
    loss of stage 0's other holder is then re-routed to it instead of restarting the run."""
    rows = [(0, "add", f"a{i}") for i in range(1, 5)] + [(0, "add", "s1")] + \
        [(40_000, "remove", "a2"), (40_000, "remove", "a3")]
    flags = dict(nodes=4, stages=2, micro_batches=4, steps=36, redundancy="reroute",
                 exact=True, checkpoint_every=0)
    clean = run_in_process(JobConfig.of(**flags).validate(), tmp_path / "clean",
                           check_replicas=False)
    cfg = JobConfig.of(**flags, max_nodes=4, time_scale=20.0, boot_s=20.0,
                       trace=_trace(tmp_path / "t.csv", rows),
                       kills=[parse_kill("0:0@30")]).validate()
    summary = run_in_process(cfg, tmp_path / "run", check_replicas=False)
    assert summary["status"] == "completed", summary.get("error")
    assert summary["param_sha256"] == clean["param_sha256"]
    assert summary["losses"] == clean["losses"]
    events = run_events(tmp_path / "run")
    # the --kill frees a slot its trace node (still live in the trace) takes again: that
    # worker may fill the new hole before the last step, as the first standby did
    plans = [e for e in events if e["event"] == "reconfigured"]
    assert all("fill a hole" in e["reason"] and e["checkpoint"] is None for e in plans), plans
    fill = plans[0]
    assert fill["step"] < 30, fill
    assert (fill["pipelines"], fill["stages"], len(fill["members"])) == (2, 2, 3)
    assert fill["checkpoint"] is None and "n4" in fill["members"]
    lost = [e for e in events if e["event"] == "node_lost"]
    assert [e["handled_as"] for e in lost] == ["reroute"] * 3, lost
    assert lost[-1]["node"] == "n0" and lost[-1]["shadow"] == "n4"
    assert summary["redone_steps"] == 0 and summary["checkpoint_restores"] == 0
