"""The simulator's prediction of a peers run (benchmarks/peers/predict.py): the costs read from
each system's own logs, the kills as the simulator's trace, and the prediction of a run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.peers import predict as P
from benchmarks.peers.job import Job
from benchmarks.peers.report import Kill, assign_workers

from bamboo.sim.core import SimConfig


def write_lines(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_bamboo_costs_come_from_its_events(tmp_path: Path) -> None:
    step = lambda t, wall: {"t": t, "event": "step_done", "wall_s": wall, "attempts": 1}  # noqa: E731 (a one-line record maker)
    write_lines(tmp_path / "r" / "run" / "events.jsonl", [
        step(1.0, 0.2), step(1.2, 0.2),
        {"t": 1.3, "event": "fault_detected", "handled_as": "failover"},
        step(1.8, 0.3), step(2.1, 0.3),
        {"t": 2.2, "event": "reconfigured"},
        {"t": 2.5, "event": "loss_cost", "handled_as": "failover", "pause_s": 0.4, "added_s": 0.25},
        step(2.7, 0.2),
        {"t": 3.0, "event": "fault_detected", "handled_as": "reconfiguration"},
        {"t": 4.5, "event": "generation_ready"},
        {"t": 5.0, "event": "checkpoint_interval", "every": 50, "write_s": 0.1},
    ])
    costs = P.bamboo_costs([tmp_path / "r"])
    assert costs["failover_pause_s"] == 0.4 and costs["rebalance_s"] == 0.25
    assert costs["restart_s"] == pytest.approx(1.5)  # the fault to the next generation
    assert costs["shadow_slowdown"] == pytest.approx(1.5)  # 0.3 s against 0.2 s
    assert costs["checkpoint_every"] == 50 and costs["ckpt_save_s"] == 0.1


def test_torchrun_restart_is_from_the_kill_before_each_attempt_less_the_boot(tmp_path: Path) -> None:
    write_lines(tmp_path / "attempts.jsonl", [{"from_step": 0, "t": 100.0},
                                              {"from_step": 10, "t": 115.0},
                                              {"from_step": 20, "t": 140.0}])
    kills = [Kill(5.0, "s", 1), Kill(30.0, "s", 2), Kill(90.0, "s", 3)]
    # kills at 105 and 130 (the third was never sent); restarts 10 s each, less 3 s of boot
    assert P.torchrun_costs([(tmp_path, kills, 2)], boot_s=3.0) == {"ckpt_restart_s": 7.0}


def test_torchft_quorum_and_heal_from_replica_zeros_commits(tmp_path: Path) -> None:
    # 1 s steps, 4 groups on 4 processors; a kill at 10.5 (first commit at 1.0: step 0 began
    # at 0); the next commit with 3 groups at 12.0, every group back at 20.0
    commits = [{"t": float(t), "participants": 4} for t in range(1, 11)]
    commits += [{"t": 12.0 + i, "participants": 3} for i in range(8)] + [{"t": 20.0, "participants": 4}]
    write_lines(tmp_path / "steps.0.jsonl", commits)
    costs = P.torchft_costs([(tmp_path, [Kill(10.5, "s", 1)], 1)], boot_s=3.0, step_s=1.0,
                            workers=4, cores=4)
    assert costs == {"quorum_s": pytest.approx(0.5), "heal_s": pytest.approx(6.5)}


def test_torchft_heal_leaves_out_a_kill_whose_heal_a_later_kill_overtook(tmp_path: Path) -> None:
    # as above, but a second kill at 15.5 s, before every group was back (at 25.0): the first
    # kill's whole commit comes after the second kill, so only the second gives a heal time
    # (25.0 - 15.5 - 3 s of boot; counting the first too would give the median of 11.5 and 6.5)
    commits = [{"t": float(t), "participants": 4} for t in range(1, 11)]
    commits += [{"t": 12.0 + i, "participants": 3} for i in range(13)] + [{"t": 25.0, "participants": 4}]
    write_lines(tmp_path / "steps.0.jsonl", commits)
    costs = P.torchft_costs([(tmp_path, [Kill(10.5, "s", 1), Kill(15.5, "s", 2)], 2)],
                            boot_s=3.0, step_s=1.0, workers=4, cores=4)
    assert costs["heal_s"] == pytest.approx(6.5)


def test_the_simulated_trace_removes_each_kills_worker_and_adds_its_replacement() -> None:
    kills = assign_workers([Kill(2.0, "s"), Kill(2.0, "s")], 3, 1.0)
    assert P.sim_trace(kills, 3, offset=10.0).splitlines() == [
        "0,add,n0", "0,add,n1", "0,add,n2", "12000,remove,n1", "12000,add,n3",
        "12000,remove,n2", "12000,add,n4"]


def test_a_prediction_counts_the_samples_done_in_the_runs_window() -> None:
    job = Job(model="gpt2-tiny", steps=100, seed=0, micro_batches=4, micro_batch_size=4, workers=2)
    model, used = P.model_for("torchrun", job, 1, 0.5, {"ckpt_restart_s": 4.0})
    config = SimConfig(alloc_delay_s=1.0, checkpoint_every_steps=10, torchrun_min_nodes=2)
    assert used == 2
    assert P.predict("torchrun", model, config, used, [], 50.0) == pytest.approx(16 / 0.5)
    # a kill at 10.2 s: steps 20 (checkpoint) .. 20.4 lost, 1 s boot + 4 s restart, 5.2 s lost
    # and the 0.2 s of the step in flight: 100 - 10.4 = 89.6 s of steps in the window's 50 s
    killed = P.predict("torchrun", model, config, used, [Kill(10.2, "s", 1)], 50.0)
    assert killed == pytest.approx(16 * int((50.0 - 10.2 - 5.0) / 0.5 + 20) / 50.0)


def test_a_runs_own_pace_is_taken_where_no_kill_touched_it(tmp_path: Path) -> None:
    # Bamboo: steps 0.25 s apart until its first preemption at 10 s
    rows = [{"t": 1.0 + 0.25 * i, "event": "step_done"} for i in range(30)]
    write_lines(tmp_path / "b" / "run" / "events.jsonl", rows + [{"t": 10.0, "event": "preempt"}]
                + [{"t": 10.5 + i, "event": "step_done"} for i in range(5)])
    assert P.pace("bamboo", tmp_path / "b", [Kill(9.0, "s", 1)], 1, 100) == pytest.approx(0.25)
    # torchrun: after its last restart (from step 60 at t=50) to its end (t=70): 20 s, 40 steps
    write_lines(tmp_path / "r" / "attempts.jsonl", [{"from_step": 0, "t": 0.0},
                                                   {"from_step": 60, "t": 50.0}])
    (tmp_path / "r" / "result.json").write_text(json.dumps({"t_end": 70.0}))
    assert P.pace("torchrun", tmp_path / "r", [], 0, 100) == pytest.approx(0.5)
    assert P.kills_sent({"preemptions": 3}, [Kill(1.0, "s")] * 5) == 3
    assert P.kills_sent({"kills_sent": 2, "preemptions": 9}, []) == 2
    assert [P.run_tag("bamboo", None, 0), P.run_tag("torchft", "every:60", 1),
            P.run_tag("torchrun", "@15,@32", 0)] == ["bamboo-free-0", "torchft-kills-every60-1",
                                                     "torchrun-kills-@15_@32-0"]


def test_calibrating_on_a_schedule_the_run_lacks_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert P.main(["--calibrate-on", "p3-dense", "--kills", "every:60", "--systems", "bamboo,torchrun",
                   "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["--calibrate-on p3-dense: not one of the run's --kills"]


def test_torchft_pipelines_record_is_the_lineage_that_finished() -> None:
    from benchmarks.peers.ft_pipelines import lineage

    # two groups commit steps 0-2; both lost at once, training starts again at step 0
    first = [{"step": k, "t": float(k), "g": g} for k in range(3) for g in (0, 1)]
    again = [{"step": k, "t": 10.0 + k, "g": 0} for k in range(4)]
    ordered, restarts = lineage(first + again, 4)
    assert [c["t"] for c in ordered] == [10.0, 11.0, 12.0, 13.0] and restarts == 1
    # a group healing in keeps the lineage: the same step committed by both is no restart
    ordered, restarts = lineage(first + [{"step": 3, "t": 3.5, "g": 1}], 4)
    assert [c["step"] for c in ordered] == [0, 1, 2, 3] and restarts == 0
    assert lineage(first, 4) == (None, 0)  # step 3 never committed


def test_a_folder_without_a_run_is_one_line_and_exit_2(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    assert P.main(["--kills", "every:60", "--systems", "bamboo", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"no results.json in {tmp_path}: run benchmarks.peers.run with this --out first"]
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_pinned_workers_make_fewer_pipelines_slower_for_bamboo_only() -> None:
    shared, _ = P.model_for("bamboo", Job(workers=4), 1, 0.1, {})
    assert shared.step_s == {d: 0.1 for d in range(1, 5)}
    pinned, used = P.model_for("bamboo", Job(workers=4, pin=True), 1, 0.1, {})
    assert used == 4
    assert pinned.step_s == pytest.approx({4: 0.1, 3: 0.4 / 3, 2: 0.2, 1: 0.4})
    ft, _ = P.model_for("torchft", Job(workers=4, pin=True), 1, 0.1, {})
    assert ft.step_s == {d: 0.1 for d in range(1, 5)}
