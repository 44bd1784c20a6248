"""Policy mechanics: the fatal-failure rule, on-demand closed form, time accounting, determinism.
Its tests that start processes: tests/integration/test_sim_policies_runs.py."""

import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bamboo.sim.core import SimConfig
from bamboo.sim.cost_presets import SimModel, get_preset
from bamboo.sim.policies import make_policy
from bamboo.traces.trace import ADD, REMOVE, Trace, load_trace

TRACES = Path(__file__).resolve().parents[3] / "traces"
P3 = TRACES / "aws-p3-2xlarge.csv"

# A tiny 4-stage model: 2 pipelines of 4 need 8 nodes.
TINY = SimModel(name="tiny", stages=4, samples_per_step=8, step_s={1: 2.0, 2: 1.0},
                   rebalance_s=20.0, restart_s=30.0, ckpt_save_s=5.0, ckpt_restart_s=60.0)
CFG = SimConfig(alloc_delay_s=0.0, fallback_every_s=0.0)


def make_trace(events, duration=3600.0, nodes=8):
    rows = [(0.0, ADD, n) for n in range(nodes)] + [(t, REMOVE, n) for t, n in events]
    rows.sort(key=lambda r: r[0])
    return Trace(name="hand", times=[r[0] for r in rows], kinds=[r[1] for r in rows],
                 nodes=[r[2] for r in rows], duration=duration)


def bamboo(trace):
    return make_policy("bamboo", TINY, CFG).run(trace)


# Layout (ordered placement, rendezvous done at t=30): pipeline 0 = nodes 0,1,2,3 (stages 0..3),
# pipeline 1 = nodes 4,5,6,7. A reconfiguration starts at the step boundary after a failover.

def test_adjacent_stages_lost_before_recovery_is_fatal():
    assert bamboo(make_trace([(100.0, 1), (100.5, 2)])).fatal_failures == 1  # stages 1 and 2
    assert bamboo(make_trace([(100.0, 2), (100.5, 1)])).fatal_failures == 1  # the other order
    assert bamboo(make_trace([(100.0, 0), (100.5, 3)])).fatal_failures == 1  # wrap-around: 3 then 0


def test_non_adjacent_or_other_pipeline_or_after_recovery_is_not_fatal():
    assert bamboo(make_trace([(100.0, 1), (100.5, 3)])).fatal_failures == 0  # stages 1 and 3
    assert bamboo(make_trace([(100.0, 1), (100.5, 6)])).fatal_failures == 0  # pipelines differ
    # After the reconfiguration (boundary + 20 s rendezvous) the second loss is covered again.
    r = bamboo(make_trace([(100.0, 1), (200.0, 2)]))
    assert r.fatal_failures == 0 and r.extra["failovers"] == 2
    assert bamboo(make_trace([(100.0, 1)])).extra["failovers"] == 1


def test_fatal_restores_from_peer_pipeline_without_losing_steps():
    r = bamboo(make_trace([(100.0, 1), (100.5, 2)]))
    assert r.extra["peer_restores"] == 1 and r.extra.get("rolled_back_steps", 0) == 0


def reroute(trace):
    return make_policy("reroute", TINY, CFG).run(trace)


def test_reroute_survives_what_kills_a_shadow_and_dies_only_with_a_whole_stage():
    """Adjacent stages of one pipeline (fatal for bamboo) are re-routed to the other
    pipeline; stage 1 lost in both pipelines has no holder left: a restore point."""
    r = reroute(make_trace([(100.0, 1), (100.5, 2)]))
    assert r.fatal_failures == 0 and r.extra["reroutes"] == 2
    assert "failovers" not in r.extra
    lost_everywhere = reroute(make_trace([(100.0, 1), (100.5, 5)]))  # stage 1 of both pipelines
    assert lost_everywhere.fatal_failures == 1 and lost_everywhere.extra["reroutes"] == 1


# One stage, four pipelines: nodes 0..3 each hold the whole model.
FLAT = SimModel(name="flat", stages=1, samples_per_step=8,
                step_s={1: 4.0, 2: 2.0, 3: 4 / 3, 4: 1.0}, rebalance_s=0.5, restart_s=30.0,
                failover_pause_s=0.1, rc_overhead=0.1, lazy_overhead=0.03, ckpt_save_s=5.0,
                ckpt_restart_s=60.0)


@pytest.mark.parametrize("mode", ["eager", "lazy", "auto", "reroute"])
def test_one_stage_re_routes_a_loss_in_flight_in_every_mode_but_off(mode):
    """At P == 1 no mode keeps a replica, so none pays for one; a loss goes to the peers and
    is not fatal until the last node goes; off restores from a peer (a restart)."""
    quiet = make_policy(mode, FLAT, CFG).run(make_trace([], nodes=4))
    off_quiet = make_policy("off", FLAT, CFG).run(make_trace([], nodes=4))
    assert quiet.steps == off_quiet.steps  # no replica, no FRC at one stage
    one = make_policy(mode, FLAT, CFG).run(make_trace([(100.0, 1)], nodes=4))
    off = make_policy("off", FLAT, CFG).run(make_trace([(100.0, 1)], nodes=4))
    assert one.fatal_failures == 0 and one.extra["reroutes"] == 1
    assert "peer_restores" not in one.extra
    assert off.extra["peer_restores"] == 1 and "reroutes" not in off.extra
    assert one.steps > off.steps
    if mode != "reroute":  # the generation ends at the loss step's boundary
        assert one.reconfigurations == 1
    three = make_policy(mode, FLAT, CFG).run(make_trace([(100.0, 1), (100.2, 2), (100.4, 3)], nodes=4))
    assert three.fatal_failures == 0 and three.extra["reroutes"] == 3
    everyone = make_policy(mode, FLAT, CFG).run(
        make_trace([(100.0, 1), (100.2, 2), (100.4, 3), (100.6, 0)], nodes=4))
    assert everyone.extra["reroutes"] == 3 and everyone.steps < three.steps


def test_one_stage_ends_the_generation_at_the_loss_steps_boundary_in_every_mode_but_reroute():
    """48 pipelines, one lost: too few overloaded for bamboo's trigger (5%), yet the other
    modes end the generation at the boundary onto 47 pipelines; reroute waits for a standby."""
    wide = SimModel(name="wide", stages=1, samples_per_step=48, step_s={d: 48.0 / d for d in range(1, 49)},
                    rebalance_s=0.5, failover_pause_s=0.1)
    trace = make_trace([(100.0, 5)], nodes=48)
    assert make_policy("lazy", wide, CFG).run(trace).reconfigurations == 1
    assert make_policy("reroute", wide, CFG).run(trace).reconfigurations == 0


def test_one_stage_keeps_the_peers_finished_work_only_at_a_generations_first_re_route():
    """A loss 0.9 s into a 1-s step at D == 4: the peers keep their 0.9 s and take the lost
    slot's share; a second loss in the same generation starts the step again."""
    pol = make_policy("reroute", FLAT, CFG)
    pol.run(make_trace([], duration=40.0, nodes=4))
    D, tau = pol.D, pol.base_tau
    assert (D, tau) == (4, 1.0)
    pol.frac = 0.9
    pol.holder[pol.slot[1]] = None
    assert pol.reroute(0.0, pol.slot.pop(1))
    # the rest of the step at 4/3 the pace, plus the pause and the lost slot's 0.9 s over 3 peers
    left = (1.0 - pol.frac) * pol.tau
    assert left == pytest.approx(0.1 * 4 / 3 + 0.1 + 0.9 / 3)
    pol.frac = 0.9
    pol.holder[pol.slot[2]] = None
    assert pol.reroute(0.0, pol.slot.pop(2))
    assert (1.0 - pol.frac) * pol.tau == pytest.approx(0.1 * 2 + 0.1 + 0.9)


def test_reroute_costs_nothing_before_a_loss():
    """No replica, no FRC: on a quiet trace it runs at the plain step time, eager's
    overhead (`rc_overhead`) faster than bamboo."""
    quiet = make_trace([])
    ratio = reroute(quiet).steps / bamboo(quiet).steps
    assert ratio == pytest.approx(1 + TINY.rc_overhead, rel=0.01)


def test_on_demand_closed_form():
    preset = get_preset("gpt2")
    trace = make_trace([], duration=7200.0, nodes=24)  # mean 24 live -> 2 pipelines of 12
    cfg = SimConfig()
    r = make_policy("on-demand", preset, cfg).run(trace)
    tau = 1.085 / 1.10
    steps = int((7200 - 45) / tau)
    assert r.steps == steps
    assert abs(r.throughput - steps * 32 / 7200) < 1e-9
    assert abs(r.cost_per_hour - 24 * 3.06) < 1e-9
    ref = make_policy("on-demand", preset, SimConfig(on_demand="ref")).run(trace)
    assert ref.steps == int((7200 - 45) / 3.37) and abs(ref.cost_per_hour - 32 * 3.06) < 1e-9


@settings(max_examples=60, deadline=None)
@given(
    events=st.lists(st.tuples(st.floats(0, 7200), st.integers(0, 15), st.booleans()), max_size=60),
    policy=st.sampled_from(["bamboo", "checkpoint", "adaptive", "reroute"]),
    rollback=st.booleans(),
)
def test_time_accounting_sums_to_wall_time(events, policy, rollback):
    rows = [(0.0, ADD, n) for n in range(10)]
    live = set(range(10))
    nxt = 10
    for t, n, add in sorted(events):
        if add:
            rows.append((t, ADD, nxt))
            live.add(nxt)
            nxt += 1
        elif live:
            victim = sorted(live)[n % len(live)]
            live.discard(victim)
            rows.append((t, REMOVE, victim))
    rows.sort(key=lambda r: r[0])
    trace = Trace(name="h", times=[r[0] for r in rows], kinds=[r[1] for r in rows],
                  nodes=[r[2] for r in rows], duration=7200.0)
    cfg = SimConfig(alloc_delay_s=45.0, fallback_every_s=600.0, checkpoint_every_s=300.0, fatal_rollback=rollback)
    r = make_policy(policy, TINY, cfg).run(trace)
    assert abs(sum(r.breakdown.values()) - 7200.0) < 1e-6
    assert all(v > -1e-6 for v in r.breakdown.values()), r.breakdown
    assert r.steps >= 0 and r.preemptions == sum(1 for k in trace.kinds if k == REMOVE)


def test_p3_trace_calibration_and_speed():
    trace = load_trace(P3)
    t0 = time.perf_counter()
    res = {p: make_policy(p, get_preset("gpt2"), SimConfig()).run(trace)
           for p in ("bamboo", "checkpoint", "on-demand", "adaptive")}
    assert time.perf_counter() - t0 < 1.0  # the target (measured ~10 ms)
    b = res["bamboo"]
    assert b.preemptions == 167
    assert abs(b.cost_per_hour - 21.90) / 21.90 < 0.01
    assert abs(b.throughput - 23.68) / 23.68 < 0.15
    assert 3 <= b.fatal_failures <= 9
    assert res["bamboo"].throughput > res["checkpoint"].throughput
