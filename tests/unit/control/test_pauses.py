"""What a loss costs: its step's extra time and the reconfiguration it caused, one entry per
lost node, in the summary, the events, the report's text, its pauses chart and its cost chart.

The coordinator's part runs on the scripted cluster (`coordinator_sim.py`, no processes);
the report's part on a hand-made run directory.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bamboo.config import JobConfig
from bamboo.run.report import Prices, load_run, report_text
from bamboo.run.report_cost import cost
from bamboo.run.report_data import failures_of, pauses_of
from coordinator_sim import SimCluster

JOIN_S = 5.0
"""How long the standby's generation takes to form (the step after the boundary holds it)."""


def _holder(sim: SimCluster, pipeline: int, stage: int) -> int:
    return sim.core.gens.member(sim.ctx.roles.holders[pipeline][stage]).node


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loss", ["failover", "drain"])
def test_a_reconfiguration_s_cost_belongs_to_the_loss_that_caused_it(tmp_path: Path,
                                                                     loss: str) -> None:
    """2 x 2 and two standbys: a failover in step 3 (or a notice: a drain at the boundary),
    a standby takes the slot at the boundary and its generation takes JOIN_S; the other
    standby lost later costs nothing. pause_s: one entry per lost node, in node_lost order,
    the first holding the join."""
    cfg = JobConfig.of(nodes=6, stages=2, pipelines=2, steps=8, micro_batches=2).validate()
    sim = SimCluster(cfg, tmp_path / "run")
    for _ in range(3):
        sim.step()
    if loss == "failover":
        sim.step(before_round=lambda: sim.kill(_holder(sim, 0, 1)))  # step 3
    else:
        sim.notice(_holder(sim, 0, 1))
        sim.step()
    sim.settle()  # the boundary after step 3: a standby takes the slot (2 x 2 again)
    sim._pass_time(JOIN_S)
    sim.step()  # step 4, the new generation's first: its wall time holds the join
    spare = next(w.node.node for w in sim.workers.values()
                 if w.node.rank is None and not w.node.exited)
    sim.kill(spare)  # a standby lost: no pause
    sim.finish()
    assert sim.stopped is None, sim.stopped
    summary = sim.core.final_summary()
    lost = sim.lost_events()
    assert [e["handled_as"] for e in lost] == [loss, "standby"]
    assert len(summary["pause_s"]) == summary["preemptions"] == 2
    first, standby = summary["pause_s"]
    assert first >= JOIN_S - 0.5 and standby == 0.0, summary["pause_s"]
    costs = sim.events.of("loss_cost")
    assert [(c["node"], c["at_step"]) for c in costs] == [(lost[0]["node"], 4)]
    assert costs[0]["pause_s"] == pytest.approx(first, abs=1e-3)
    assert lost[0]["pause_s"] < 1.0  # the event written at once: its own step only
    assert sim.core.failures.losses[0].pause_s < 1.0  # what --redundancy auto reads


def _run_dir(path: Path, with_summary: bool) -> Path:
    """6 steps of 0.5 s on 2 x 2 and a standby; n1 fails over in step 2, the standby joins
    and step 3 takes 5.5 s; a second standby is lost in step 4."""
    config = {"nodes": 6, "stages": 2, "pipelines": 2, "micro_batches": 2, "micro_batch_size": 4}
    events: list[dict] = [{"t": 0.0, "event": "run_start", "config": config}]
    events += [{"t": 1.0, "event": "node_up", "node": f"n{i}", "pid": 100 + i,
                "pipeline": i // 2 if i < 4 else None, "stage": i % 2 if i < 4 else None}
               for i in range(6)]
    t = 1.0
    for step in range(6):
        wall = 5.5 if step == 3 else 0.5
        t += wall
        events.append({"t": t, "event": "step_done", "step": step, "loss": 5.0 - step / 10,
                       "wall_s": wall})
        if step == 2:
            events.append({"t": t, "event": "node_lost", "node": "n1", "step": 2,
                           "phase": "forward", "handled_as": "failover", "shadow": "n0",
                           "pause_s": 0.0})
        if step == 3:
            events.append({"t": t, "event": "loss_cost", "node": "n1", "step": 2,
                           "handled_as": "failover", "at_step": 3, "added_s": 5.0,
                           "pause_s": 5.0})
        if step == 4:
            events.append({"t": t, "event": "node_lost", "node": "n5", "step": 5,
                           "phase": "standby", "handled_as": "standby", "pause_s": 0.0})
    events.append({"t": t + 0.1, "event": "run_done", "steps": 6, "wall_s": t})
    path.mkdir(parents=True)
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if with_summary:
        summary = {"status": "completed", "steps_completed": 6, "losses": [5.0 - k / 10 for k in
                                                                              range(6)],
                   "preemptions": 2, "failovers": 1, "standby_losses": 1,
                   "pause_s": [5.0, 0.0], "wall_s": t, "config": config}
        (path / "summary.json").write_text(json.dumps(summary))
    return path


@pytest.mark.parametrize("with_summary", [True, False], ids=["summary", "events only"])
def test_the_report_charges_the_join_to_the_loss(tmp_path: Path, with_summary: bool) -> None:
    run = load_run(_run_dir(tmp_path / "run", with_summary))
    failures = failures_of(run)
    assert [f.node for f in failures] == ["n1", "n5"]
    assert pauses_of(run, failures) == [5.0, 0.0]
    text = report_text(run)
    assert "n1 lost in step 2 (forward): failover, shadow n0, pause 5.00 s (5.00 s of it the " \
           "reconfiguration before step 3)" in text, text
    assert "pause per failure: 5.00, 0.00 s" in text
    # on-demand pays each step at the failure-free pace: no jump at the join
    c = cost(run, failures, Prices())
    rises = [b - a for a, b in zip(c.on_demand[1:], c.on_demand[2:])]
    assert max(rises) <= 1.5 * min(rises), rises
