"""The timeline model: closed forms of 1F1B, FRC in bubbles, shared cores, costs from events."""
from __future__ import annotations

import json

import pytest

from bamboo.cli.timeline import main
from bamboo.plan import schedule as S
from bamboo.plan.reroute_timeline import reroute_assignment, rerouted_step
from bamboo.plan.timeline import Costs, compare, simulate_step
from bamboo.plan.timeline_text import render
from bamboo.run.measured import costs_from_events


@pytest.mark.parametrize("P,M", [(1, 1), (2, 3), (4, 4), (4, 8), (3, 2), (6, 12)])
def test_one_f_one_b_closed_form(P: int, M: int) -> None:
    f, b = 0.01, 0.02
    tl = simulate_step(P, M, "off", Costs.uniform(P, f, b))
    assert tl.step_s == pytest.approx((M + P - 1) * (f + b))
    for nt in tl.nodes:  # every node works M x (f + b); the rest is bubbles
        assert nt.busy() == pytest.approx(M * (f + b))
        assert nt.idle_s == pytest.approx((P - 1) * (f + b))


def test_latency_adds_per_hop() -> None:
    P, M, f, b, lat = 4, 1, 0.01, 0.02, 0.001
    tl = simulate_step(P, M, "off", Costs.uniform(P, f, b, latency=lat))
    # one micro-batch: forward chain, backward chain, 2 (P - 1) transfers
    assert tl.step_s == pytest.approx(P * (f + b) + 2 * (P - 1) * lat)


def test_eager_frc_hides_in_bubbles() -> None:
    # One micro-batch: node s waits (P - 1 - s) x (f + b) + ... for its gradient, and the
    # FRC forward (cost f) of its successor fits in that wait; the last node runs
    # stage 0's FRC while it waits (P - 1) f for its first activation.
    P, M = 4, 1
    cmp = compare(P, M, Costs.uniform(P, 0.01, 0.02))
    assert cmp.overhead("eager") == pytest.approx(0.0, abs=1e-12)
    assert cmp.overhead("lazy") == pytest.approx(0.0, abs=1e-12)
    for _node, work, hidden in cmp.frc_hidden():
        assert work == pytest.approx(0.01) and hidden == pytest.approx(work)
    # FRC really ran, inside what was idle time
    off, eager = cmp.timelines["off"], cmp.timelines["eager"]
    for n_off, n_eager in zip(off.nodes, eager.nodes):
        assert n_eager.idle_s == pytest.approx(n_off.idle_s - 0.01)


def test_eager_frc_shows_when_many_micro_batches() -> None:
    P, M, f, b = 4, 16, 0.01, 0.02
    cmp = compare(P, M, Costs.uniform(P, f, b))
    # steady state has no bubbles: most FRC work lengthens the step
    extra = cmp.timelines["eager"].step_s - cmp.timelines["off"].step_s
    assert extra > 0.5 * M * f
    assert cmp.overhead("eager") > 0.15
    assert cmp.overhead("eager") > compare(P, 2, Costs.uniform(P, f, b)).overhead("eager")


def test_lazy_replica_step_hides_in_the_nodes_idle_time() -> None:
    # The replica's step runs on a thread of its own after the commit: with one processor
    # per node it fills that node's bubbles ((P - 1)(f + b) = 90 ms each here), so a 4-ms
    # step costs nothing; eager steps its replica inline, after its own step.
    P, M = 4, 4
    costs = Costs.uniform(P, 0.01, 0.02, commit=0.003, optim=(0.004,) * P)
    cmp = compare(P, M, costs)
    off, lazy, eager = (cmp.timelines[m] for m in ("off", "lazy", "eager"))
    assert off.step_s == pytest.approx(7 * 0.03 + 0.003 + 0.004)
    assert lazy.step_s == pytest.approx(off.step_s)
    for nt in eager.nodes:
        assert nt.busy("O") == pytest.approx(0.008)  # its own step, then its replica's
    assert not any(nt.busy("P") for nt in lazy.nodes)


def test_lazy_replica_step_adds_what_does_not_fit() -> None:
    # P=2: each node idles (P - 1)(f + b) = 30 ms a step; a 50-ms replica step leaves 20 ms
    # that lengthen the step (drawn as 'P' after the node's own step).
    P, M, f, b = 2, 8, 0.01, 0.02
    costs = Costs.uniform(P, f, b, optim=(0.005,) * P, replica_optim=(0.05,) * P)
    off, lazy = (simulate_step(P, M, m, costs) for m in ("off", "lazy"))
    assert lazy.step_s - off.step_s == pytest.approx(0.05 - (P - 1) * (f + b))
    assert all(nt.busy("P") == pytest.approx(0.02) for nt in lazy.nodes)


def test_lazy_replica_step_on_one_shared_core_adds_all_of_it() -> None:
    # One core is never idle in the micro-batch phase: every replica step adds its whole
    # cost; 4 cores for 2 nodes idle 60% of their capacity, which hides it.
    P, M = 2, 4
    costs = Costs.uniform(P, 0.01, 0.02, optim=(0.004,) * P, replica_optim=(0.006,) * P)
    one = {m: simulate_step(P, M, m, costs, cores=1).step_s for m in ("off", "lazy")}
    assert one["off"] == pytest.approx(P * M * 0.03 + P * 0.004)
    assert one["lazy"] - one["off"] == pytest.approx(P * 0.006)
    four = {m: simulate_step(P, M, m, costs, cores=4).step_s for m in ("off", "lazy")}
    assert four["lazy"] == pytest.approx(four["off"])


def test_a_replica_step_is_one_thread_whatever_the_cores() -> None:
    # A 1-s replica step runs on one thread: idle cores beside it do not make it shorter,
    # so the step is never shorter than that step's excess over the micro-batch phase.
    P, M = 2, 1
    costs = Costs.uniform(P, 0.01, 0.01, optim=(0.001,) * P, replica_optim=(1.0,) * P)
    for cores in (None, 2, 3, 100):
        tl = simulate_step(P, M, "lazy", costs, cores=cores)
        assert tl.step_s >= 1.0 - tl.phase_a_s + 0.001, cores


def test_lazy_draws_nothing_for_a_replica_step_that_just_fits() -> None:
    # A replica step exactly as long as its node's bubbles adds nothing, not a zero-length
    # interval; on shared cores the rest is drawn only on nodes that keep a replica.
    P, f, b = 4, 0.01, 0.02
    costs = Costs.uniform(P, f, b, replica_optim=((P - 1) * (f + b),) * P)
    for M in (2, 3):
        lazy, off = simulate_step(P, M, "lazy", costs), simulate_step(P, M, "off", costs)
        assert lazy.step_s == off.step_s
        assert not any(i.kind == "P" for nt in lazy.nodes for i in nt.intervals)
    shadowed = simulate_step(3, 2, "lazy", Costs(
        forward=(0.01, 0.02, 0.03), backward=(0.02, 0.04, 0.06), optim=(0.001,) * 3,
        replica_optim=(0.05,) * 3), cores=1, held=[[0, 1], [2]])
    assert shadowed.nodes[0].busy("P") == 0 and shadowed.nodes[1].busy("P") > 0


def test_one_shared_core_is_the_sum_of_all_work() -> None:
    P, M = 4, 4
    fwd, bwd = (0.01, 0.012, 0.009, 0.015), (0.02, 0.025, 0.018, 0.03)
    costs = Costs(forward=fwd, backward=bwd)
    for mode, frc in (("off", 0.0), ("eager", M * sum(fwd))):
        tl = simulate_step(P, M, mode, costs, cores=1)
        assert tl.step_s == pytest.approx(M * (sum(fwd) + sum(bwd)) + frc)


def test_enough_shared_cores_equal_one_per_node() -> None:
    costs = Costs.uniform(4, 0.01, 0.02)
    for mode in ("off", "eager"):
        assert simulate_step(4, 4, mode, costs, cores=4).step_s == pytest.approx(
            simulate_step(4, 4, mode, costs).step_s)


def test_two_shared_cores_make_eager_pay_nearly_all_of_frc() -> None:
    P, M, f, b = 4, 4, 0.01, 0.02
    cmp = compare(P, M, Costs.uniform(P, f, b), cores=2)
    gpu = compare(P, M, Costs.uniform(P, f, b))
    extra = cmp.timelines["eager"].step_s - cmp.timelines["off"].step_s
    assert extra >= 0.8 * P * M * f / 2  # FRC work spread over 2 cores, little hidden
    assert cmp.overhead("eager") > gpu.overhead("eager")


def test_failover_layout_merged_node() -> None:
    # A shadow holding stages 1 and 2: the pipeline still completes, slower.
    P, M = 4, 4
    costs = Costs.uniform(P, 0.01, 0.02)
    merged = simulate_step(P, M, "off", costs, held=[[0], [1, 2], [3]])
    assert merged.step_s > simulate_step(P, M, "off", costs).step_s
    assert merged.nodes[1].busy() == pytest.approx(2 * M * 0.03)


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        simulate_step(4, 4, "sometimes", Costs.uniform(4, 1, 1))
    with pytest.raises(ValueError):
        simulate_step(4, 4, "off", Costs.uniform(3, 1, 1))


def _events(tmp_path, mode: str, replica_host_bytes: int = 0) -> str:
    P, M = 2, 2
    lines = [{"event": "run_start", "config": {"stages": P, "micro_batches": M, "nodes": 2,
                                               "redundancy": mode}}]
    for step in range(4):
        nodes = []
        for s in range(P):
            # forward 10 ms (stage 0) / 20 ms (stage 1), backward twice that
            f = 0.01 * (s + 1)
            frc = M * 0.01 * (((s + 1) % P) + 1) if mode == "eager" else 0.0
            nodes.append({"node": f"n{s}", "stages": [s], "compute_s": M * 3 * f, "frc_s": frc,
                          "reduce_s": 0.002, "optim_s": 0.006, "step_s": 1.0, "wait_s": 0.0,
                          "state_bytes": 12 * 300, "bytes_replica": 4 * 100,
                          "replica_host_bytes": replica_host_bytes})
        lines.append({"event": "step_done", "step": step, "wall_s": 0.5, "attempts": 1,
                      "nodes": nodes})
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(path)


@pytest.mark.parametrize("mode", ["eager", "off"])
def test_costs_from_events(tmp_path, mode: str) -> None:
    P, M, costs, notes = costs_from_events(_events(tmp_path, mode))
    assert (P, M) == (2, 2) and notes["steps_used"] == 3
    assert costs.forward == pytest.approx((0.01, 0.02))
    assert costs.backward == pytest.approx((0.02, 0.04))
    assert costs.commit == pytest.approx(0.002)
    if mode == "eager":  # own stage 100 of 300 parameters held: a third of the optimizer time
        assert costs.optim == pytest.approx((0.002, 0.002))
        assert costs.replica_optim == pytest.approx((0.004, 0.004))
    else:
        assert costs.optim == pytest.approx((0.006, 0.006))


@pytest.mark.parametrize("replica_host_bytes", [0, 4096])
def test_costs_from_a_lazy_run(tmp_path, replica_host_bytes: int) -> None:
    # A replica in host memory stepped on its own thread: optim_s is the primary's step
    # alone, and the replica's costs what its stage's own step does. On the device (a run
    # from before the host replica) its step was inside optim_s, split by size.
    _, _, costs, _ = costs_from_events(_events(tmp_path, "lazy", replica_host_bytes))
    if replica_host_bytes:
        assert costs.optim == pytest.approx((0.006, 0.006))
        assert costs.replica_optim == pytest.approx((0.006, 0.006))
    else:
        assert costs.optim == pytest.approx((0.002, 0.002))
        assert costs.replica_optim == pytest.approx((0.004, 0.004))


def test_cli(tmp_path, capsys) -> None:
    assert main(["--events", _events(tmp_path, "eager"), "--width", "40"]) == 0
    out = capsys.readouterr().out
    assert "eager" in out and "FRC in bubbles" in out and "n1 s1" in out
    assert main(["--stages", "4", "--micro-batches", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["eager"]["overhead"] == pytest.approx(0.0, abs=1e-12)


def test_render_names_every_node() -> None:
    text = render(compare(3, 3, Costs.uniform(3, 0.01, 0.02), cores=2))
    assert "2 shared cores" in text
    assert all(f"n{n} s{n}" in text for n in range(3))


def test_schedules_are_the_engines() -> None:
    # the model replays exactly node_schedule's lists (FRC included)
    from bamboo.plan.timeline import node_lists
    lists = node_lists(4, 4, "eager")
    assert lists[1] == S.node_schedule([1], 4, 4, frc_stage=2)
    assert sum(isinstance(i, S.RedundantForward) for i in lists[3]) == 4


@pytest.mark.parametrize("P,M", [(4, 4), (4, 8), (3, 2)])
def test_frc_at_waits_never_slower_and_conserves_work(P: int, M: int) -> None:
    costs = Costs.uniform(P, 0.01, 0.02)
    slot = simulate_step(P, M, "eager", costs, frc_policy="slot")
    waits = simulate_step(P, M, "eager", costs, frc_policy="waits")
    assert waits.step_s <= slot.step_s + 1e-12
    for nt in waits.nodes:
        assert nt.frc_s == pytest.approx(M * 0.01)
    one_core = simulate_step(P, M, "eager", costs, cores=1, frc_policy="waits")
    assert one_core.step_s == pytest.approx(P * M * 0.04)
    with pytest.raises(ValueError):
        simulate_step(P, M, "eager", costs, frc_policy="sometimes")


# -- re-routing a lost slot's micro-batches to its data-parallel peers -----------------------


def test_reroute_assignment_spreads_micro_batches_over_the_live_peers() -> None:
    served = reroute_assignment(4, 6, 3, [(0, 2)])
    assert [served[(0, 2, mb)] for mb in range(6)] == [(1, 2), (2, 2)] * 3
    two = reroute_assignment(4, 4, 3, [(0, 2), (1, 2)])
    assert {two[(d, 2, mb)] for d in (0, 1) for mb in range(4)} == {(2, 2)}
    with pytest.raises(ValueError, match="lost in every pipeline"):
        reroute_assignment(4, 4, 2, [(0, 1), (1, 1)])


@pytest.mark.parametrize("P,M,D", [(2, 2, 2), (4, 4, 2), (4, 8, 4), (3, 5, 3)])
def test_rerouted_step_without_a_loss_is_the_plain_step(P: int, M: int, D: int) -> None:
    costs = Costs(forward=tuple(1.0 + 0.1 * s for s in range(P)),
                  backward=tuple(2.0 + 0.3 * s for s in range(P)), latency=0.05, commit=0.5)
    assert rerouted_step(P, M, D, [], costs).step_s == pytest.approx(
        simulate_step(P, M, "off", costs).step_s)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_the_peers_carry_the_lost_slots_work_and_more_peers_slow_less(stage: int) -> None:
    """Each of the D - 1 peers does its own micro-batches and 1/(D - 1) of the lost slot's;
    the step is longer than the failure-free one, at most twice it, and shorter the more
    peers share the work."""
    P, M = 4, 12
    costs = Costs.uniform(P, 1.0, 2.0)
    steps = []
    for D in (2, 3, 4):
        clean = rerouted_step(P, M, D, [], costs)
        hit = rerouted_step(P, M, D, [(0, stage)], costs)
        for e in range(1, D):
            assert hit.busy_s[(e, stage)] == pytest.approx(3.0 * M * (1 + 1 / (D - 1)))
        assert (0, stage) not in hit.busy_s
        assert clean.step_s < hit.step_s <= 2 * clean.step_s
        steps.append(hit.step_s)
    assert steps == sorted(steps, reverse=True)


def test_two_lost_slots_at_different_stages_both_re_routed_without_deadlock() -> None:
    costs = Costs.uniform(4, 1.0, 2.0, latency=0.1)
    hit = rerouted_step(4, 4, 2, [(0, 1), (1, 2)], costs)
    assert set(hit.served_by) == {(0, 1, mb) for mb in range(4)} | {(1, 2, mb) for mb in range(4)}
    assert hit.step_s > rerouted_step(4, 4, 2, [], costs).step_s
