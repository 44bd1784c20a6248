"""Redundant computation and in-flight failover with real processes and real SIGKILLs.

Every scenario ends with the losses and parameters of the failure-free run (the plain
single-process loop), or, where no copy of a stage survives, stops with the
documented message.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bamboo.config import JobConfig
from bamboo.plan import schedule as S
from bamboo.plan.faults import Fault
from bamboo.plan.program import COMMIT_POINTS
from bamboo.run.bits import COUNTERS
from bamboo.run.runlog import RunDir
from support.procs import run_events
from support.runs import (
    NEW_LAYOUT_REL,
    REL,
    assert_close,
    assert_equals_failure_free,
    config,
    reference,
    run_in_process,
)

# -- the acceptance scenarios, as data -----------------------------------------------------

SCENARIOS = {
    # name: (flags, failovers, peer_restores)
    "kill stage 2": (dict(steps=12, kills=["0:2@5"]), 1, 0),
    "kill stage 0 (shadow is the last stage)": (dict(steps=8, kills=["0:0@5"]), 1, 0),
    "kill the last stage": (dict(steps=8, kills=["0:3@5"]), 1, 0),
    "two pipelines": (dict(steps=8, nodes=8, micro_batches=2, kills=["0:2@5"]), 1, 0),
    "two kills in one run": (dict(steps=8, kills=["0:1@3", "0:2@7"]), 2, 0),
    "two non-adjacent kills in one step": (dict(steps=6, kills=["0:0@3", "0:2@3"]), 2, 0),
    "adjacent kills, restored from the peer pipeline": (
        dict(steps=8, nodes=8, micro_batches=2, kills=["0:1@4", "0:2@4"]), 1, 1),
    "lazy redundancy": (dict(steps=8, redundancy="lazy", kills=["0:2@3"]), 1, 0),
    "eager FRC kept in CPU memory": (dict(steps=6, frc_offload=True, kills=["0:2@3"]), 1, 0),
    "two-stage pipeline": (dict(steps=6, nodes=2, stages=2, kills=["0:0@3"]), 1, 0),
    # stage 0's shadow then holds stages 0 and 2: both its boundaries are with node 1, and
    # under strict rules only the gradient lane keeps the two kinds of message apart
    "three stages, stage 0 killed": (dict(steps=6, nodes=3, stages=3, kills=["0:0@3"]), 1, 0),
    "the shadow is lost later (its two stages)": (
        dict(steps=8, nodes=8, micro_batches=2, kills=["1:2@2", "1:1@5"]), 1, 1),
}


@pytest.mark.procs
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", SCENARIOS)
def test_failover_ends_equal_to_failure_free(name: str, tmp_path: Path) -> None:
    flags, failovers, peer_restores = SCENARIOS[name]
    cfg = config({"redundancy": "eager", **flags})  # the shadows' FRC, unless a scenario says
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equals_failure_free(summary, cfg)
    assert summary["failovers"] == failovers and summary["peer_restores"] == peer_restores
    assert summary["checkpoint_restores"] == 0 and summary["redone_steps"] == 0
    assert summary["preemptions"] == len(cfg.cluster.kills) == len(summary["pause_s"])
    # one a replica promoted: every failover's, and a lost shadow's own replica (its other
    # stage restored from a peer) too
    assert failovers <= len(summary["promotion_s"]) <= failovers + peer_restores
    assert all(0 <= x < 5 for x in summary["promotion_s"]), summary["promotion_s"]
    if cfg.redundancy.mode == "lazy":  # its replica in host memory, stepped on a thread
        assert summary["replica_host_bytes"] > 0
    events = RunDir(tmp_path / "run")
    lost = [e for e in run_events(tmp_path / "run") if e["event"] == "node_lost"]
    assert len(lost) == len(cfg.cluster.kills)
    for e in lost:
        assert e["handled_as"] in ("failover", "peer_restore")
        assert e["brc"] >= cfg.layout.micro_batches  # every backward of the lost stage, redone
        if cfg.redundancy.mode == "lazy":
            assert e["frc_reused"] == 0
    # strict (the default): every survivor dropped the group and formed the survivors' one
    rebuilt = [n for e in run_events(tmp_path / "run") if e["event"] == "step_done"
               for n in e["nodes"] if n["rebuilds"]]
    assert {n["node"] for n in rebuilt} >= {e["shadow"] for e in lost if e["shadow"]}
    checked = [e for e in run_events(tmp_path / "run") if e["event"] == "replicas_checked"]
    assert len(checked) == cfg.training.steps and any(e["replicas"] > 0 for e in checked)
    assert events.path.exists()


@pytest.mark.procs
@pytest.mark.timeout(180)
@pytest.mark.parametrize("redundancy,nodes", [("lazy", 2), ("off", 4)])
def test_a_writer_lost_after_the_last_commit_is_replaced_by_a_copy(
        redundancy: str, nodes: int, tmp_path: Path) -> None:
    """Stage 0's first holder dies after the last step's commit, before it writes its
    layers' final parameters: another live copy (its replica holder; with no redundancy, the
    stage's holder in the other pipeline) writes them, and the run ends equal."""
    cfg = JobConfig.of(nodes=nodes, stages=2, micro_batches=3, micro_batch_size=2, steps=3,
                       redundancy=redundancy).validate()
    after_commit = victim_schedule_length(cfg, 0, 0) - 1  # the index after the optimizer step
    summary = run_in_process(cfg, tmp_path / "run", {0: [Fault("kill", 2, after_commit)]})
    assert_equals_failure_free(summary, cfg)
    [lost] = [e for e in run_events(tmp_path / "run") if e["event"] == "node_lost"]
    assert (lost["node"], lost["phase"]) == ("n0", "after the last step")
    [rewrite] = [e for e in run_events(tmp_path / "run") if e["event"] == "final_rewrite"]
    assert rewrite["node"] == ("n1" if redundancy == "lazy" else "n2")
    assert rewrite["layers"] == [0, 1, 2, 3]  # gpt2-tiny's first stage of two


@pytest.mark.procs
@pytest.mark.timeout(240)
@pytest.mark.parametrize("redundancy,victims", [("off", (0,)), ("lazy", (0, 1))])
def test_every_copy_of_a_stage_lost_after_the_last_commit_is_restored_and_redone(
        redundancy: str, victims: tuple[int, ...], tmp_path: Path) -> None:
    """One pipeline of two stages and a standby; after the last step's commit, before they
    write their layers, the only copies of a stage die (with no redundancy its holder; with
    lazy both nodes, holders and replicas at once). The survivors and the standby restore
    the newest whole checkpoint (step 2's, or the initial state when the victims' writer
    threads had not finished it), redo the steps after it, and the run ends equal to the
    failure-free run."""
    cfg = JobConfig.of(nodes=3, pipelines=1, stages=2, micro_batches=3, micro_batch_size=2,
                       steps=3, checkpoint_every=2, redundancy=redundancy).validate()
    faults = {v: [Fault("kill", 2, victim_schedule_length(cfg, 0, v) - 1)] for v in victims}
    summary = run_in_process(cfg, tmp_path / "run", faults)
    assert_equals_failure_free(summary, cfg)
    assert summary["preemptions"] == len(victims) and summary["checkpoint_restores"] >= 1
    assert sum(summary[k] for k in COUNTERS) == summary["preemptions"]
    events = run_events(tmp_path / "run")
    lost = [e for e in events if e["event"] == "node_lost"]
    assert {e["node"] for e in lost} == {f"n{v}" for v in victims}
    assert all(e["phase"] == "after the last step" for e in lost)
    assert "checkpoint_restore" in {e["handled_as"] for e in lost}
    [restore] = [e for e in events if e["event"] == "checkpoint_restore"]
    assert restore["step"] in (0, 2) and restore["redone_steps"] == 3 - restore["step"]
    assert summary["redone_steps"] == restore["redone_steps"]


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_a_worker_frozen_as_it_starts_is_fenced_within_seconds(tmp_path: Path) -> None:
    """SIGSTOP the moment a worker's `node_up` appears, before it ever beats: it is fenced
    after the local start grace plus `--lease`, not after a minute, and the standby covers."""
    import signal
    import threading
    import time
    cfg = config(dict(steps=4, nodes=3, stages=2, lease_s=2.0))
    out = tmp_path / "run"

    def freeze_n0_at_once() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            up = [e for e in run_events(out) if e["event"] == "node_up" and e["node"] == "n0"]
            if up:
                os.kill(up[0]["pid"], signal.SIGSTOP)
                return
            time.sleep(0.002)

    threading.Thread(target=freeze_n0_at_once, daemon=True).start()
    summary = run_in_process(cfg, out)
    assert_equals_failure_free(summary, cfg)
    events = run_events(out)
    up = next(e["t"] for e in events if e["event"] == "node_up" and e["node"] == "n0")
    fenced = [e for e in events if e["event"] == "fenced"]
    assert [e["node"] for e in fenced] == ["n0"]
    assert fenced[0]["t"] - up < 20.0, fenced


TAGGED = ("kill stage 2", "two non-adjacent kills in one step",
          "adjacent kills, restored from the peer pipeline")


@pytest.mark.procs
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", TAGGED)
def test_tagged_comm_fails_over_equal_to_failure_free(name: str, tmp_path: Path) -> None:
    """--comm tagged (gloo only): the group outlives the lost peer, nothing is rebuilt."""
    flags, failovers, peer_restores = SCENARIOS[name]
    cfg = config(dict(flags, comm="tagged"))
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equals_failure_free(summary, cfg)
    assert (summary["failovers"], summary["peer_restores"]) == (failovers, peer_restores)
    steps = [e for e in run_events(tmp_path / "run") if e["event"] == "step_done"]
    assert all(n["rebuilds"] == 0 for e in steps for n in e["nodes"])


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_adjacent_kills_without_a_peer_pipeline_restart_from_the_initial_state(
        tmp_path: Path) -> None:
    """No copy of stage 2 survives and checkpoints are off: the run goes back to the
    seeded start on the survivors, never stops."""
    cfg = config(dict(steps=6, kills=["0:1@3", "0:2@3"], checkpoint_every=0))
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equals_failure_free(summary, cfg, rel=NEW_LAYOUT_REL)
    assert summary["checkpoint_restores"] == 1 and summary["redone_steps"] == 3


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_redundancy_off_never_fails_over(tmp_path: Path) -> None:
    cfg = config(dict(steps=4, redundancy="off", kills=["0:2@1"]))
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equals_failure_free(summary, cfg, rel=NEW_LAYOUT_REL)
    assert summary["failovers"] == 0 and summary["checkpoint_restores"] == 1
    assert summary["redone_steps"] == 1
    lost = [e for e in run_events(tmp_path / "run") if e["event"] == "fault_detected"]
    assert "--redundancy off keeps no in-flight copy" in lost[0]["error"]


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_replica_sync_ships_only_the_reduced_gradient(tmp_path: Path) -> None:
    cfg = config(dict(steps=2))
    run_in_process(cfg, tmp_path / "run")
    step = [e for e in run_events(tmp_path / "run") if e["event"] == "step_done"][-1]
    from bamboo.config.presets import preset
    from bamboo.model import layer_param_counts
    from bamboo.plan.partition import partition
    counts = layer_param_counts(preset("gpt2-tiny"))
    parts = partition(counts, 4)
    for node in step["nodes"]:
        [stage] = node["stages"]
        numel = sum(counts[i] for i in parts[stage])
        # float32 gradient plus a status word; parameters + two AdamW moments would be 12 B.
        assert node["bytes_replica"] == 4 * (numel + 1)
        # the wait for the go and commit answers is part of the step, and every node waits
        # for at least the coordinator's two answers
        assert 0 < node["vote_s"] < node["step_s"]


# -- lazy's replica, stepped on a thread of its own: its primary killed around that step -----

@pytest.mark.procs
@pytest.mark.timeout(180)
@pytest.mark.parametrize("point", ["micro-batches done", "round done", "applied"])
def test_lazy_kill_around_the_replicas_step_ends_equal(point: str, tmp_path: Path) -> None:
    """Stage 1's node killed in step 2 before its reduced gradient leaves for the replica's
    holder, after it left, and after the commit (the holder's replica step may still be
    running on its thread when the failover promotes the replica)."""
    cfg = config(nodes=2, stages=2, steps=5, redundancy="lazy")
    index = [p.name for p in COMMIT_POINTS].index(point)
    after = victim_schedule_length(cfg, 0, 1) - len(COMMIT_POINTS) + index
    summary = run_in_process(cfg, tmp_path / "run", {1: [Fault("kill", 2, after)]})
    assert_equals_failure_free(summary, cfg)
    assert summary["failovers"] == 1 and len(summary["promotion_s"]) == 1, summary
    assert summary["replica_host_bytes"] > 0


# -- the property test: a random node killed at a random instruction of a random step -------

CASES = int(os.environ.get("BAMBOO_FAILOVER_CASES", "30"))


def victim_schedule_length(cfg: JobConfig, pipeline: int, stage: int) -> int:
    """The fault points of one step on that node: its instructions, then the commit round's."""
    frc = (stage + 1) % cfg.layout.stages if cfg.redundancy.mode == "eager" else None
    return len(S.node_schedule([stage], cfg.layout.stages, cfg.layout.micro_batches, frc_stage=frc,
                               schedule=cfg.layout.schedule)) + len(COMMIT_POINTS)


@st.composite
def kill_cases(draw) -> tuple[JobConfig, dict[int, list[Fault]]]:
    stages = draw(st.integers(2, 4))
    pipelines = draw(st.integers(1, 2))
    micro_batches = draw(st.integers(1, 3))
    cfg = JobConfig.of(nodes=stages * pipelines, stages=stages, micro_batches=micro_batches,
                    micro_batch_size=2, steps=3,
                    redundancy=draw(st.sampled_from(["eager", "lazy"])),
                    schedule=draw(st.sampled_from(sorted(S.SCHEDULES)))).validate()
    faults: dict[int, list[Fault]] = {}
    for _ in range(draw(st.integers(1, 2))):
        d, s = draw(st.integers(0, pipelines - 1)), draw(st.integers(0, stages - 1))
        step = draw(st.integers(0, cfg.training.steps - 1))
        after = draw(st.integers(0, victim_schedule_length(cfg, d, s) - 1))
        faults[d * stages + s] = [Fault("kill", step, after)]
    return cfg, faults


@pytest.mark.procs
@pytest.mark.timeout(60 * 30)
@settings(max_examples=CASES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=kill_cases())
def test_random_kills_end_equal_to_the_failure_free_run(case, tmp_path_factory) -> None:
    """Whatever is killed, the run ends equal (in flight, or from a restore point), unless
    no node is left at all."""
    cfg, faults = case
    out = tmp_path_factory.mktemp("case") / "run"
    summary = run_in_process(cfg, out, faults)
    if summary["status"] == "failed":  # only when every node was killed
        assert summary["exit_code"] == 3, summary["error"]
        assert "no live node is left" in summary["error"], summary["error"]
        assert len(faults) == cfg.layout.nodes
        return
    assert_equals_failure_free(summary, cfg, rel=NEW_LAYOUT_REL if summary["reconfigurations"]
                               else REL)
    lost = summary["failovers"] + summary["peer_restores"] + summary["checkpoint_restores"]
    assert summary["preemptions"] == lost
    assert 0 < lost <= len(faults) or all(f.step >= cfg.training.steps for fs in faults.values() for f in fs)


@pytest.mark.timeout(180)
def test_the_acceptance_command_line(bamboo) -> None:
    """`bamboo train --nodes 4 --stages 4 --steps 12 --kill 0:2@5`, as a user types it: equal
    to the failure-free run (the single-process loop every clean run equals)."""
    args = ["--nodes", "4", "--stages", "4", "--steps", "12", "--json", "--quiet"]
    killed = bamboo([*args, "--kill", "0:2@5"], "killed")
    assert killed.code == 0, killed.stderr
    k = killed.summary
    cfg = config(nodes=4, stages=4, steps=12)
    losses, l2 = reference(cfg.training.steps, cfg.global_micro_batches, cfg.layout.micro_batch_size)
    assert (k["failovers"], k["checkpoint_restores"], k["redone_steps"]) == (1, 0, 0)
    assert_close(k["losses"], losses, rel=1e-4)
    assert_close(k["param_l2"], l2, rel=1e-4)
    [lost] = [e for e in killed.events() if e["event"] == "node_lost"]
    assert (lost["node"], lost["step"], lost["handled_as"], lost["shadow"]) == ("n2", 5, "failover", "n1")


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_a_frozen_node_is_fenced_then_failed_over(tmp_path: Path) -> None:
    """SIGSTOP (a frozen VM) is invisible to gloo: the lease notices, the coordinator fences."""
    import signal
    import threading
    import time
    cfg = config(dict(steps=8, lease_s=2.0))
    out = tmp_path / "run"

    def freeze_n2_after_step_2() -> None:
        while True:
            events = run_events(out)
            done = [e for e in events if e["event"] == "step_done"]
            if len(done) >= 2:
                pid = next(e["pid"] for e in events
                           if e["event"] == "node_up" and e["node"] == "n2")
                os.kill(pid, signal.SIGSTOP)
                return
            time.sleep(0.05)

    threading.Thread(target=freeze_n2_after_step_2, daemon=True).start()
    summary = run_in_process(cfg, out)
    assert_equals_failure_free(summary, cfg)
    assert summary["failovers"] == 1
    events = run_events(out)
    assert [e["node"] for e in events if e["event"] == "fenced"] == ["n2"]
    lost = next(e for e in events if e["event"] == "fault_detected")
    fenced_t = next(e["t"] for e in events if e["event"] == "fenced")
    assert lost["node"] == "n2" and lost["t"] - fenced_t < 2.0
