"""Elastic runs with real processes: drains on notice, joins, new layouts, peer and
checkpoint restores, trace replay and --resume.

Every run ends with the losses and parameters of the failure-free run (the plain
single-process loop) within 1e-4 relative (a new layout sums data-parallel gradients
in another grouping), and accounts for every lost node exactly once.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bamboo.chaos.bits import COUNTERS as KINDS  # every counter of a lost node
from bamboo.config import JobConfig
from bamboo.plan.faults import Fault
from support.procs import REPO, run_bamboo, run_events
from support.reference import train_reference
from support.runs import NEW_LAYOUT_REL as REL
from support.runs import assert_close, assert_equal_and_accounted, config, param_l2, run_in_process

pytestmark = pytest.mark.procs  # every test here starts processes


@pytest.mark.timeout(180)
def test_drain_to_a_standby(tmp_path: Path) -> None:
    """A noticed node hands its stage to the standby at the step boundary and leaves."""
    cfg = config(nodes=5, stages=4, steps=7, kills=["0:2@3+notice"], notice_s=60.0)
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equal_and_accounted(summary, cfg, lost=1)
    assert summary["drains"] == 1 and summary["failovers"] == 0
    assert summary["reconfigurations"] == 1
    moved = [e for e in run_events(tmp_path / "run") if e["event"] == "reconfigured"]
    assert moved[0]["members"][:4] == ["n0", "n1", "n4", "n3"]  # n4 took stage 2
    assert moved[0]["step"] == 4
    roles = [e for e in run_events(tmp_path / "run") if e["event"] == "role"]
    assert sorted((e["node"], e["pipeline"], e["stage"]) for e in roles) == [
        ("n2", None, None), ("n4", 0, 2)]  # n2 leaves its stage, n4 takes it


@pytest.mark.timeout(180)
def test_drain_without_a_standby_moves_to_fewer_stages(tmp_path: Path) -> None:
    cfg = config(nodes=4, stages=4, steps=7, kills=["0:1@2+notice"], notice_s=60.0)
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equal_and_accounted(summary, cfg, lost=1)
    assert summary["drains"] == 1
    plan = [e for e in run_events(tmp_path / "run") if e["event"] == "reconfigured"][0]
    assert (plan["pipelines"], plan["stages"]) == (1, 3) and "n1" not in plan["members"][:3]


@pytest.mark.timeout(180)
def test_short_notice_becomes_a_failover_or_a_drain_never_both(tmp_path: Path) -> None:
    cfg = config(nodes=4, stages=4, steps=6, kills=["0:2@2+notice"], notice_s=0.05)
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equal_and_accounted(summary, cfg, lost=1)
    assert summary["drains"] + summary["failovers"] == 1


@pytest.mark.timeout(180)
def test_failover_then_rebalance_restores_a_replica_for_every_stage(tmp_path: Path) -> None:
    """With one pipeline, a failover leaves the shadow's stages with one copy; the next
    boundary spreads the layers over the three survivors."""
    cfg = config(nodes=4, stages=4, steps=7, kills=["0:2@2"])
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equal_and_accounted(summary, cfg, lost=1)
    assert summary["failovers"] == 1 and summary["reconfigurations"] == 1
    plan = [e for e in run_events(tmp_path / "run") if e["event"] == "reconfigured"][0]
    assert (plan["pipelines"], plan["stages"], plan["step"]) == (1, 3, 3)


@pytest.mark.timeout(240)
def test_whole_pipeline_lost_continues_on_the_other(tmp_path: Path) -> None:
    cfg = config(nodes=8, stages=4, micro_batches=2, steps=6,
                 kills=["1:0@2", "1:1@2", "1:2@2", "1:3@2"])
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equal_and_accounted(summary, cfg)
    # The last kill may not fire: once pipeline 1 has no node left that can take the
    # stages over, its survivor is dropped to a standby before it reaches its kill point.
    assert summary["preemptions"] in (3, 4), summary
    assert summary["checkpoint_restores"] == 0 and summary["redone_steps"] == 0
    plan = [e for e in run_events(tmp_path / "run") if e["event"] == "reconfigured"][0]
    assert (plan["pipelines"], plan["stages"]) == (1, 4)


@pytest.mark.timeout(240)
def test_adjacent_kills_with_one_pipeline_restore_the_checkpoint(tmp_path: Path) -> None:
    """No live copy of stage 2 survives: the run restarts from its last checkpoint (step
    4) on the two survivors and redoes step 4; it still ends equal."""
    cfg = config(nodes=4, stages=4, steps=7, checkpoint_every=2, kills=["0:1@5", "0:2@5"])
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equal_and_accounted(summary, cfg, lost=2)
    assert summary["checkpoint_restores"] >= 1
    assert summary["redone_steps"] == 1
    restore = [e for e in run_events(tmp_path / "run") if e["event"] == "checkpoint_restore"]
    assert restore[0]["step"] == 4


@pytest.mark.timeout(240)
def test_shadow_lost_in_the_same_step_restores_the_checkpoint(tmp_path: Path) -> None:
    """The shadow (holding its own stage and the adopted one) dies in the commit round
    of the step it took over: nothing live holds those layers."""
    cfg = config(nodes=4, stages=4, steps=6, checkpoint_every=2)
    faults = {2: [Fault("kill", 3)], 1: [Fault("kill", 3, after=40)]}
    summary = run_in_process(cfg, tmp_path / "run", faults)
    assert_equal_and_accounted(summary, cfg, lost=2)
    assert summary["checkpoint_restores"] == 1 and summary["redone_steps"] == 1


@pytest.mark.timeout(120)
def test_adjacent_kills_without_a_checkpoint_restart_from_the_initial_state(tmp_path: Path) -> None:
    """No live copy and checkpoints off: the run goes back to its seeded start, redoing the
    three committed steps, and still ends equal to the failure-free run."""
    cfg = config(nodes=4, stages=4, steps=6, kills=["0:1@3", "0:2@3"], checkpoint_every=0)
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equal_and_accounted(summary, cfg, lost=2)
    assert summary["checkpoint_restores"] == 1 and summary["redone_steps"] == 3
    restores = [e for e in run_events(tmp_path / "run") if e["event"] == "checkpoint_restore"]
    assert [(e["checkpoint"], e["step"], e["redone_steps"]) for e in restores] == [(None, 0, 3)]


def _write_trace(path: Path, rows: list[tuple[float, str, str]]) -> Path:
    path.write_text("".join(f"{ms:.0f},{kind},{node}\n" for ms, kind, node in rows))
    return path


@pytest.mark.timeout(240)
def test_trace_replay_preempts_and_adds_nodes(tmp_path: Path) -> None:
    """A trace removes two nodes and adds two; with --time-scale 3600 one trace hour is a
    wall second."""
    trace = _write_trace(tmp_path / "t.csv", [
        (0, "add", "a"), (0, "add", "b"), (0, "add", "c"), (0, "add", "d"),
        (2_500_000, "remove", "b"), (4_000_000, "add", "e"), (4_000_000, "add", "f"),
        (9_000_000, "remove", "e"),
    ])
    # 24 steps outlast the trace's last event (2.5 wall s after the first step) on a quiet
    # machine too, so f is started in e's slot before the run ends.
    cfg = config(nodes=4, stages=4, steps=24, trace=str(trace), time_scale=3600.0,
                 max_nodes=4)
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equal_and_accounted(summary, cfg)
    ev = run_events(tmp_path / "run")
    ups = [e["node"] for e in ev if e["event"] == "node_up"]
    assert ups[:4] == ["n0", "n1", "n2", "n3"] and len(ups) >= 5
    # the trace is capacity: f waits while 4 are alive, and takes e's slot when e goes
    assert [e["trace_node"] for e in ev if e["event"] == "trace_waiting"] == ["f"]
    played = [e["trace_node"] for e in ev if e["event"] == "node_up"]
    assert played == ["a", "b", "c", "d", "e", "f"]
    assert summary["preemptions"] >= 1


@pytest.mark.timeout(240)
def test_standbys_joining_grow_the_layout(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "t.csv", [
        (0, "add", "a"), (0, "add", "b"), (1, "add", "c"), (1, "add", "d"),
        (1, "add", "e"), (1, "add", "f")])
    cfg = config(nodes=2, stages=2, micro_batches=4, steps=8, trace=str(trace),
                 time_scale=3600.0, max_nodes=4)
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equal_and_accounted(summary, cfg, lost=0)
    plans = [e for e in run_events(tmp_path / "run") if e["event"] == "reconfigured"]
    assert plans and (plans[-1]["pipelines"], plans[-1]["stages"]) == (2, 2)


@pytest.mark.timeout(300)
def test_resume_continues_a_run_to_the_failure_free_result(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = run_bamboo(["train", "--nodes", "2", "--stages", "2", "--steps", "4",
                        "--checkpoint-every", "2", "--json", "--quiet"], out)
    assert first.code == 0, first.stderr
    second = run_bamboo(["train", "--nodes", "2", "--stages", "2", "--steps", "7",
                         "--resume", str(out), "--json", "--quiet"], None)
    assert second.code == 0, second.stderr
    summary = json.loads(second.stdout)
    assert summary["resumed_from_step"] == 4  # the finished run's final state
    cfg = config(nodes=2, stages=2, steps=7)
    assert_equal_and_accounted(summary, cfg, lost=0)


@pytest.mark.timeout(300)
def test_resume_falls_back_past_a_corrupt_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = run_bamboo(["train", "--nodes", "2", "--stages", "2", "--steps", "5",
                        "--checkpoint-every", "2", "--quiet"], out)
    assert first.code == 0, first.stderr
    newest = sorted((out / "checkpoints").glob("step-*"))[-1]
    victim = next(newest.glob("layer-*/__0_0.distcp"))
    victim.write_bytes(victim.read_bytes()[:-7])  # truncated
    second = run_bamboo(["train", "--nodes", "2", "--stages", "2", "--steps", "6",
                         "--resume", str(out), "--json", "--quiet"], None)
    assert second.code == 0, second.stderr
    assert "truncated" in second.stderr and "step-00000004" in second.stderr
    summary = json.loads(second.stdout)
    assert summary["resumed_from_step"] == 4  # the final state (5) is the corrupt one
    assert_equal_and_accounted(summary, config(nodes=2, stages=2, steps=6), lost=0)


@pytest.mark.timeout(300)
def test_the_demo_job_survives_its_trace_and_writes_the_report(tmp_path: Path) -> None:
    """`make demo`'s job file, shortened: the real p3 trace preempts and adds nodes while
    8 workers train; the run ends equal to the failure-free run, with its report."""
    from bamboo.data.tokens import prepare
    data = tmp_path / "demo-data"  # what `make demo` prepares, from the same files
    prepare([str(REPO / "README.md"), *map(str, sorted((REPO / "docs").glob("*.md")))], data,
            "bpe:1024")
    out = tmp_path / "demo"
    result = run_bamboo(["train", "--config", "examples/demo.yaml", "--steps", "20",
                         "--data", str(data), "--time-scale", "700", "--json", "--quiet"],
                        out, timeout=280)
    assert result.code == 0, result.stderr
    summary = json.loads(result.stdout)
    cfg = config(nodes=8, stages=4, steps=20, data=str(data), eval_every=10)
    evals: list[list[float]] = []
    losses, params = train_reference(JobConfig.of(
        nodes=1, stages=1, steps=20, micro_batches=cfg.global_micro_batches, data=str(data),
        eval_every=10).validate(), evals)
    assert summary["status"] == "completed", summary["error"]
    assert_close(summary["losses"], losses, rel=REL)
    assert_close([x for _, x in summary["eval_losses"]], [x for _, x in evals], rel=REL)
    assert_close(summary["param_l2"], param_l2(params), rel=REL)
    assert sum(summary[k] for k in KINDS) == summary["preemptions"] >= 3
    assert [s for s, _ in summary["eval_losses"]] == [10, 20]  # the last at the last step
    assert summary["eval_losses"][-1][1] < summary["eval_losses"][0][1]
    for name in ("report.txt", "loss.png", "throughput.png", "nodes.png", "cost.png",
                 "pauses.png"):
        assert (out / name).stat().st_size > 1000 or name == "report.txt"
    assert "preemption" in (out / "report.txt").read_text()


@pytest.mark.timeout(240)
def test_checkpoint_restart_baseline_restarts_every_worker_and_ends_equal(tmp_path: Path) -> None:
    cfg = config(nodes=4, stages=4, steps=7, redundancy="off", recovery="checkpoint-restart",
                 checkpoint_every=2, kills=["0:2@5"])
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equal_and_accounted(summary, cfg, lost=1)
    assert (summary["checkpoint_restores"], summary["redone_steps"]) == (1, 1)
    ev = run_events(tmp_path / "run")
    restart = [e for e in ev if e["event"] == "restart_all"]
    assert restart and restart[0]["workers"] == 3
    assert sum(e["event"] == "node_up" for e in ev) == 4 + 3  # three fresh processes


@pytest.mark.timeout(240)
def test_redundancy_auto_chooses_per_generation_and_ends_equal(tmp_path: Path) -> None:
    """`--redundancy auto` with two losses: each generation records its mode (the best of
    its own expectations) and the run ends equal to the failure-free run."""
    cfg = config(nodes=5, stages=4, steps=8, redundancy="auto", kills=["0:1@3", "0:2@6"])
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equal_and_accounted(summary, cfg, lost=2)
    ev = run_events(tmp_path / "run")
    modes = [e for e in ev if e["event"] == "redundancy_mode"]
    assert [e["gen"] for e in modes] == list(range(summary["reconfigurations"] + 1))
    for e in modes:
        assert e["mode"] in ("eager", "lazy", "off") and not e["trial"]  # too short to afford
        assert e["expected"][e["mode"]] == max(e["expected"].values()), e
    planned = [e["redundancy"] for e in ev if e["event"] == "reconfigured"]
    assert planned == [e["mode"] for e in modes[1:]]
    from bamboo.run.report import load_run, report_text
    assert "redundancy over time:" in report_text(load_run(tmp_path / "run"))


@pytest.mark.timeout(240)
def test_four_nodes_of_two_pipelines_in_one_step_restore_and_end_equal(tmp_path: Path) -> None:
    """Two adjacent nodes of each pipeline in the same step: no in-flight copy of stage 2
    survives anywhere, so the run goes back to its checkpoint (a node asked to serve a
    restore while it still waits for its own state is never chosen)."""
    cfg = config(nodes=8, stages=4, steps=6, checkpoint_every=2,
                 kills=["0:1@3", "0:2@3", "1:1@3", "1:2@3"])
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equal_and_accounted(summary, cfg)
    assert 2 <= summary["preemptions"] <= 4
    assert summary["checkpoint_restores"] + summary["peer_restores"] >= 1
