"""`--redundancy reroute`: a lost stage's micro-batches served by its data-parallel peers,
in runs that kill real workers (every stage with D=2 and D=3, two kills in one step, a peer
that serves a re-route, a dense trace), each ending equal to the failure-free run,
bit-identical under `--exact`. The role maps and merged lists without processes:
tests/unit/plan/test_reroute_roles.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from bamboo.chaos.bits import bits_must_match, differs
from bamboo.config import JobConfig, parse_kill
from support.procs import run_events
from support.runs import assert_close, assert_equals_failure_free, run_in_process

# -- real workers -------------------------------------------------------------------------

def reroute_config(**flags) -> JobConfig:
    kills = [parse_kill(k) for k in flags.pop("kills", [])]
    flags.setdefault("redundancy", "reroute")
    return JobConfig.of(kills=kills, **flags).validate()


RUNS = {
    # name: flags, reroutes
    "D=2, stage 0": (dict(nodes=4, stages=2, steps=4, kills=["0:0@2"]), 1),
    "D=2, stage 1, tagged": (dict(nodes=4, stages=2, steps=4, kills=["0:1@1"], comm="tagged"), 1),
    "D=2, P=3, stage 2, zb-h1": (dict(nodes=6, stages=3, steps=4, kills=["1:2@2"],
                                      schedule="zb-h1"), 1),
    "D=3, stage 0, spread over two peers": (dict(nodes=6, stages=2, steps=4, kills=["1:0@2"]), 1),
    "D=3, stage 1, then the peer serving it": (
        dict(nodes=6, stages=2, steps=5, kills=["0:1@2", "1:1@3"]), 2),
    "two kills in one step, both pipelines": (
        dict(nodes=4, stages=2, steps=4, kills=["0:0@2", "1:1@2"]), 2),
}


@pytest.mark.procs
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", RUNS)
def test_reroute_ends_equal_to_failure_free(name: str, tmp_path: Path) -> None:
    flags, reroutes = RUNS[name]
    cfg = reroute_config(**flags)
    summary = run_in_process(cfg, tmp_path / "run", check_replicas=False)
    assert_equals_failure_free(summary, cfg)
    assert summary["reroutes"] == reroutes == summary["preemptions"]
    assert summary["failovers"] == summary["checkpoint_restores"] == 0
    assert summary["redone_steps"] == 0 and summary["reconfigurations"] == 0
    assert not bits_must_match(summary)  # fp32 sums of the re-routed stage in another order
    events = run_events(tmp_path / "run")
    lost = [e for e in events if e["event"] == "node_lost"]
    assert [e["handled_as"] for e in lost] == ["reroute"] * reroutes
    assert all(e["shadow"] for e in lost)  # the first peer serving it
    restarted = [n for e in events if e["event"] == "step_done" for n in e["nodes"]
                 if n["restarts"]]
    assert restarted, "a re-route starts the step again on the survivors"


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_reroute_is_bit_identical_under_exact_with_an_eval(tmp_path: Path) -> None:
    flags = dict(nodes=4, stages=2, steps=4, exact=True, eval_every=2, eval_batches=4)
    clean = run_in_process(reroute_config(**flags), tmp_path / "clean", check_replicas=False)
    cfg = reroute_config(**flags, kills=["1:0@2"])
    summary = run_in_process(cfg, tmp_path / "run", check_replicas=False)
    assert summary["status"] == "completed" and summary["reroutes"] == 1
    assert bits_must_match(summary, clean) and differs(clean, summary) == ""
    assert summary["param_sha256"] == clean["param_sha256"]
    assert summary["losses"] == clean["losses"] and summary["eval_losses"] == clean["eval_losses"]
    assert len(summary["eval_losses"]) == 2


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_reroute_until_a_standby_takes_the_slot(tmp_path: Path) -> None:
    cfg = reroute_config(nodes=5, stages=2, pipelines=2, steps=5, kills=["0:1@2"])
    summary = run_in_process(cfg, tmp_path / "run", check_replicas=False)
    assert_equals_failure_free(summary, cfg)
    assert summary["reroutes"] == 1 and summary["reconfigurations"] == 1
    plans = [e for e in run_events(tmp_path / "run") if e["event"] == "reconfigured"]
    assert "n4" in plans[0]["members"] and plans[0]["checkpoint"] is None


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_reroute_survives_a_dense_trace(tmp_path: Path) -> None:
    """Removes every 0.4 s, adds back after them: re-routes in flight, standbys taking
    slots at boundaries, and a stage lost in both pipelines (a restore point)."""
    rows = [(0, "add", n) for n in "abcd"]
    removes = ["a", "d", "b", "e", "c", "f"]
    for k, node in enumerate(removes):
        ms = 1_500_000 + k * 1_440_000
        rows += [(ms, "remove", node), (ms + 700_000, "add", chr(ord("e") + k))]
    trace = tmp_path / "t.csv"
    trace.write_text("".join(f"{ms:.0f},{kind},{node}\n" for ms, kind, node in rows))
    cfg = reroute_config(nodes=4, stages=2, pipelines=2, steps=16, trace=str(trace),
                         time_scale=3600.0, max_nodes=5)
    summary = run_in_process(cfg, tmp_path / "run", check_replicas=False)
    assert summary["status"] == "completed", summary["error"]
    from support.runs import reference
    losses, l2 = reference(cfg.training.steps, cfg.global_micro_batches,
                           cfg.layout.micro_batch_size)
    assert_close(summary["losses"], losses, rel=1e-4)  # a change of D reorders fp32 sums
    assert_close(summary["param_l2"], l2, rel=1e-4)
    kinds = ("failovers", "drains", "peer_restores", "checkpoint_restores", "standby_losses",
             "stopped", "reroutes")
    assert summary["preemptions"] == sum(summary[k] for k in kinds) >= 3
    assert summary["reroutes"] >= 1
    lost = [e for e in run_events(tmp_path / "run") if e["event"] == "node_lost"]
    assert len(lost) == summary["preemptions"]


# -- shadow or re-route, per loss ---------------------------------------------------------


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_lazy_with_three_pipelines_reroutes_a_loss_and_then_the_next(tmp_path: Path) -> None:
    cfg = reroute_config(nodes=6, stages=2, steps=5, redundancy="lazy",
                         kills=["0:1@2", "2:0@3"])
    summary = run_in_process(cfg, tmp_path / "run", check_replicas=True)
    assert_equals_failure_free(summary, cfg)
    assert summary["reroutes"] == 2 and summary["failovers"] == 0
    lost = [e for e in run_events(tmp_path / "run") if e["event"] == "node_lost"]
    assert [e["handled_as"] for e in lost] == ["reroute", "reroute"]


