"""``--redundancy auto``'s decision (bamboo/plan/redundancy_choice.py): the formula, its properties, and
that the simulator's adaptive policy decides with the very same function."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from bamboo.plan.redundancy_choice import (
    MODES,
    PRIOR_RATE,
    PRIOR_WEIGHT,
    Choice,
    ModeCosts,
    RateEstimator,
    choose_mode,
    expected_samples_per_s,
    mode_terms,
    posterior_rate,
    value,
)
from bamboo.sim.core import SimConfig
from bamboo.sim.cost_presets import SimModel, get_preset
from bamboo.sim.policies import AdaptivePolicy, make_policy

HOUR = 3600.0
secs = st.floats(0.0, 600.0, allow_nan=False)
rates = st.one_of(
    st.floats(0.0, 0.05, allow_nan=False),  # up to 180 preemptions per node-hour
    st.sampled_from([0.0, 1e-9, PRIOR_RATE, 0.01 / HOUR, 0.5 / HOUR, 5.0 / HOUR]),
)


@st.composite
def mode_costs(draw, min_stages: int = 1, all_measured: bool = False) -> ModeCosts:
    """Arbitrary costs; step times of each mode independent, some possibly unmeasured."""
    steps = {m: draw(st.floats(0.01, 20.0)) for m in MODES}
    keep = set(MODES) if all_measured else draw(st.sets(st.sampled_from(MODES), min_size=1))
    return ModeCosts(
        samples_per_step=draw(st.floats(1.0, 4096.0)),
        stages=draw(st.integers(min_stages, 16)),
        pipelines=draw(st.integers(1, 8)),
        step_s={m: steps[m] for m in keep},
        overhead={"eager": draw(st.floats(0.0, 1.0)), "lazy": draw(st.floats(0.0, 0.5))},
        failover_pause_s=draw(st.floats(0.0, 10.0)),
        reconfiguration_s=draw(st.floats(0.0, 60.0)),
        restart_s=draw(secs),
        shadow_slowdown=draw(st.floats(1.0, 3.0)),
        rollback_s=draw(st.floats(0.0, 3600.0)),
    )


# -- the formula, by hand

def test_value_matches_the_formula_by_hand():
    c = ModeCosts(samples_per_step=100, stages=4, pipelines=2, step_s={"eager": 1.1, "lazy": 1.03, "off": 1.0},
                  failover_pause_s=1.0, reconfiguration_s=20.0, restart_s=30.0, shadow_slowdown=1.5, rollback_s=5.0)
    lam = 1e-4
    r = lam * 2 * 4
    for mode, tau in (("eager", 1.1), ("lazy", 1.03), ("off", 1.0)):
        fatal = 30.0 + tau / 2 + 5.0
        if mode == "off":
            per = fatal
        else:
            q = 1 - math.exp(-2 * lam * (20.0 + tau))
            per = 1.0 + tau * 0.5 + 20.0 + q * fatal + (tau / 2 if mode == "lazy" else 0.0)
        want = 100 / tau / (1 + r * per)
        assert expected_samples_per_s(mode, c, lam) == pytest.approx(want, rel=1e-12)
    ch = choose_mode(c, lam)
    assert isinstance(ch, Choice) and ch.mode == max(ch.expected, key=ch.expected.get)
    assert ch.rate_per_node_hour == pytest.approx(lam * HOUR)
    assert ch.to_dict()["mode"] == ch.mode and ch.estimated == ()


def test_unmeasured_modes_are_estimated_from_a_measured_one():
    c = ModeCosts(samples_per_step=32, stages=4, pipelines=1, step_s={"eager": 1.1})
    assert c.step_time("off") == pytest.approx(1.0) and c.step_time("lazy") == pytest.approx(1.03)
    assert c.step_time("eager") == 1.1 and c.measured("eager") and not c.measured("off")
    ch = choose_mode(c, PRIOR_RATE)
    assert ch.estimated == ("lazy", "off") and set(ch.expected) == set(MODES)
    assert ch.step_s["off"] == pytest.approx(1.0)
    # off is the preferred reference, then lazy; own overhead factors are used
    c2 = ModeCosts(samples_per_step=32, stages=4, pipelines=1, step_s={"eager": 5.0, "off": 2.0},
                   overhead={"lazy": 0.5})
    assert c2.step_time("lazy") == pytest.approx(3.0) and c2.step_time("eager") == 5.0
    c3 = ModeCosts(samples_per_step=32, stages=4, pipelines=1, step_s={"lazy": 1.2},
                   overhead={"lazy": 0.2, "eager": 0.5})
    assert c3.step_time("off") == pytest.approx(1.0) and c3.step_time("eager") == pytest.approx(1.5)


@pytest.mark.parametrize("bad", [
    dict(step_s={}),
    dict(step_s={"fast": 1.0}),
    dict(step_s={"eager": 0.0}),
    dict(step_s={"eager": float("nan")}),
    dict(stages=0),
    dict(pipelines=1.5),
    dict(restart_s=-1.0),
    dict(overhead={"lazy": -1.0}),
])
def test_costs_are_validated(bad):
    kw = dict(samples_per_step=8, stages=4, pipelines=1, step_s={"eager": 1.0}) | bad
    with pytest.raises(ValueError):
        ModeCosts(**kw)


def test_choose_mode_rejects_bad_arguments():
    c = ModeCosts(samples_per_step=8, stages=4, pipelines=1, step_s={"eager": 1.0})
    for rate in (-1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            choose_mode(c, rate)
    with pytest.raises(ValueError):
        choose_mode(c, PRIOR_RATE, modes=())
    with pytest.raises(ValueError):
        choose_mode(c, PRIOR_RATE, modes=("eager", "both"))


# -- properties

@settings(max_examples=300, deadline=None)
@given(costs=mode_costs(), rate=rates, modes=st.sets(st.sampled_from(MODES), min_size=1))
def test_chosen_mode_is_the_argmax_of_its_expected(costs, rate, modes):
    ch = choose_mode(costs, rate, modes=sorted(modes, reverse=True))  # argument order is irrelevant
    assert set(ch.expected) == modes
    best = max(ch.expected.values())
    assert ch.expected[ch.mode] == best
    # exact ties go to the earliest of eager, lazy, off
    assert ch.mode == next(m for m in MODES if m in modes and ch.expected[m] == best)
    for m in modes:
        assert ch.expected[m] == expected_samples_per_s(m, costs, rate) >= 0.0


@settings(max_examples=200, deadline=None)
@given(costs=mode_costs())
def test_with_no_failures_the_cheapest_step_wins(costs):
    taus = {m: costs.step_time(m) for m in MODES}
    ch = choose_mode(costs, 0.0)
    # Step times one rounding apart (0.01 and 0.010000000000000002) give the same samples a
    # second, and the tie goes by the modes' order: the winner is the cheapest within that.
    assert math.isclose(taus[ch.mode], min(taus.values()), rel_tol=1e-12)
    for m in MODES:
        assert ch.expected[m] == pytest.approx(costs.samples_per_step / taus[m], rel=1e-12)
    # and a vanishing rate changes nothing when the step times differ by 1% or more
    cheapest = min(taus, key=taus.get)
    assume(all(taus[m] >= 1.01 * taus[cheapest] for m in MODES if m != cheapest))
    assert choose_mode(costs, 1e-12).mode == cheapest


@settings(max_examples=300, deadline=None)
@given(costs=mode_costs(), rate=rates, exposure=st.floats(0.0, 1e9))
def test_eager_only_when_its_extra_step_time_pays_for_itself(costs, rate, exposure):
    """Eager saves only lazy's recomputation (tau_lazy / 2 per failure): with r failures per second
    it never wins over lazy when tau_eager - tau_lazy > r * tau_eager * tau_lazy / 2."""
    te, tl = costs.step_time("eager"), costs.step_time("lazy")
    for lam in (rate, posterior_rate(0, exposure)):  # any rate, and a run with no loss observed yet
        r = lam * costs.pipelines * costs.stages
        if te - tl > r * te * tl / 2 * (1 + 1e-9) + 1e-12 * te:
            assert choose_mode(costs, lam).mode != "eager"
            assert choose_mode(costs, lam, modes=("eager", "lazy")).mode == "lazy"


def test_no_loss_at_the_prior_rate_keeps_a_slow_eager_out():
    # The CPU engine: eager FRC costs ~20% a step, lazy ~2%; restarts are costly.
    c = ModeCosts(samples_per_step=64, stages=4, pipelines=2, step_s={"eager": 0.36, "lazy": 0.306, "off": 0.30},
                  failover_pause_s=0.5, reconfiguration_s=3.0, restart_s=60.0, shadow_slowdown=1.6)
    lam = posterior_rate(0, 8 * 600.0)  # ten minutes of 8 nodes, nothing lost
    assert lam < PRIOR_RATE
    assert choose_mode(c, lam).mode != "eager"


@settings(max_examples=300, deadline=None)
@given(
    costs=mode_costs(min_stages=2, all_measured=True),
    lazy_over=st.floats(0.0, 0.10),
    rate_h=st.floats(0.01, 2.0),
    k=st.floats(1.0, 10.0),
)
def test_high_rate_and_costly_restarts_never_choose_off_over_lazy(costs, lazy_over, rate_h, k):
    """P > 1, lazy adds at most 10% a step, at most 2 preemptions per node-hour (so the chance a
    neighbour goes within a reconfiguration stays small), restarts cost at least 4x a covered
    failure and off would spend at least 20% of its time restarting (r * restart_s >= 1/4)."""
    off = costs.step_time("off")
    tau = off * (1 + lazy_over)
    lam = rate_h / HOUR
    r = lam * costs.pipelines * costs.stages
    covered = costs.failover_pause_s + tau * costs.shadow_slowdown + costs.reconfiguration_s
    restart = max(4 * covered, 0.25 / r) * k
    c = ModeCosts(samples_per_step=costs.samples_per_step, stages=costs.stages, pipelines=costs.pipelines,
                  step_s={"eager": costs.step_time("eager"), "lazy": tau, "off": off},
                  failover_pause_s=costs.failover_pause_s, reconfiguration_s=min(costs.reconfiguration_s, 30.0),
                  restart_s=restart, shadow_slowdown=costs.shadow_slowdown, rollback_s=costs.rollback_s)
    assume(c.reconfiguration_s + tau <= 40.0)
    ch = choose_mode(c, lam)
    assert ch.mode != "off" and ch.expected["lazy"] > ch.expected["off"]


@settings(max_examples=100, deadline=None)
@given(costs=mode_costs(), rate=rates)
def test_a_single_stage_alone_cannot_be_protected(costs, rate):
    c = ModeCosts(samples_per_step=costs.samples_per_step, stages=1, pipelines=1,
                  step_s={"off": 1.0}, restart_s=costs.restart_s,
                  reconfiguration_s=costs.reconfiguration_s, failover_pause_s=costs.failover_pause_s)
    assert not any(mode_terms(m, c).protected for m in MODES)
    assert c.step_time("eager") == c.step_time("lazy") == 1.0  # no replica, no FRC at one stage
    ch = choose_mode(c, rate)
    assert len(set(ch.expected.values())) == 1 and ch.mode == "eager"  # every mode alike: ties go first


def test_one_stage_with_peers_is_re_routed_in_flight_by_hand():
    """P == 1, D == 4: a loss costs the pause, the lost slot's share over the 3 peers and the
    boundary's reconfiguration, and is fatal only if all 3 peers go within the window."""
    c = ModeCosts(samples_per_step=48, stages=1, pipelines=4, step_s={"off": 0.8},
                  failover_pause_s=0.1, reconfiguration_s=0.25, restart_s=1.12)
    lam = 1e-3
    tau = 0.8
    q = (1 - math.exp(-lam * (0.25 + tau))) ** 3
    fatal = 1.12 + tau / 2
    for mode in ("eager", "lazy", "reroute"):
        t = mode_terms(mode, c)
        assert t.protected and c.step_time(mode) == tau
        per = 0.1 + tau / 3 + 0.25 + q * fatal
        assert value(t, lam) == pytest.approx(48 / tau / (1 + lam * 4 * per), rel=1e-12)
    assert value(mode_terms("off", c), lam) == pytest.approx(48 / tau / (1 + lam * 4 * fatal), rel=1e-12)
    assert choose_mode(c, lam).mode == "eager"  # protected modes tie; off loses
    # a measured pause (the loss step's excess) holds the lost slot's share already
    m = ModeCosts(samples_per_step=48, stages=1, pipelines=4, step_s={"off": 0.8},
                  failover_pause_by_mode={"lazy": 0.33}, reconfiguration_s=0.25, restart_s=1.12)
    assert mode_terms("lazy", m).base_s == pytest.approx(0.33 + 0.25)
    # at one stage every mode but off re-routes alike: one mode's measured pause is every one's
    for mode in ("eager", "reroute"):
        assert mode_terms(mode, m).base_s == mode_terms("lazy", m).base_s


@settings(max_examples=100, deadline=None)
@given(costs=mode_costs(), rate=rates)
def test_one_stage_with_peers_beats_off_when_a_re_route_costs_less_than_a_fatal_loss(costs, rate):
    D = max(costs.pipelines, 2)
    tau = costs.step_time("off")
    c = ModeCosts(samples_per_step=costs.samples_per_step, stages=1, pipelines=D,
                  step_s={"off": tau}, failover_pause_s=costs.failover_pause_s,
                  reconfiguration_s=costs.reconfiguration_s, restart_s=costs.restart_s,
                  rollback_s=costs.rollback_s)
    covered = c.failover_pause_s + tau / (D - 1) + c.reconfiguration_s
    fatal = c.restart_s + tau / 2 + c.rollback_s
    every_peer_goes = (1 - math.exp(-rate * (c.reconfiguration_s + tau))) ** (D - 1)
    assume(covered + every_peer_goes * fatal < 0.999 * fatal)  # clear of float rounding
    ch = choose_mode(c, rate)
    assert ch.expected["lazy"] >= ch.expected["off"]
    if rate > 1e-9:  # below, the difference is under a float's resolution
        assert ch.expected["lazy"] > ch.expected["off"] and ch.mode != "off"


# -- the rate estimator

@settings(max_examples=200, deadline=None)
@given(removals=st.integers(0, 10_000), per=st.floats(0.0, 1e-2), prior=st.floats(1e-9, 1e-2),
       weight=st.floats(1.0, 1e6))
def test_rate_estimator_prior_and_limit(removals, per, prior, weight):
    assert posterior_rate(0, 0.0) == pytest.approx(PRIOR_RATE, rel=1e-15)
    assert posterior_rate(0, 0.0, prior, weight) == pytest.approx(prior, rel=1e-12)
    assert RateEstimator(prior, weight).rate_per_node_s == pytest.approx(prior, rel=1e-12)
    # lots of exposure: the observed rate removals / exposure takes over
    exposure = 1e12
    k = round(per * exposure)
    est = RateEstimator(prior, weight)
    est.observe(exposure / 2, k // 2)
    est.observe(exposure / 2, k - k // 2)
    assert est.rate_per_node_s == posterior_rate(k, exposure, prior, weight)
    tol = 2 * weight / exposure
    assert est.rate_per_node_s == pytest.approx(k / exposure, rel=tol, abs=prior * tol)
    # monotone: a loss raises the rate, quiet exposure lowers it towards 0
    assert posterior_rate(removals + 1, 100.0, prior, weight) > posterior_rate(removals, 100.0, prior, weight)
    assert posterior_rate(0, 1e6, prior, weight) < prior


def test_rate_estimator_validates():
    with pytest.raises(ValueError):
        RateEstimator().observe(-1.0)
    with pytest.raises(ValueError):
        RateEstimator(prior_weight=0.0)
    e = RateEstimator()
    assert e.rate_per_node_hour == pytest.approx(0.10)
    assert AdaptivePolicy.PRIOR_RATE == PRIOR_RATE and AdaptivePolicy.PRIOR_WEIGHT == PRIOR_WEIGHT


# -- the simulator decides with the same function

TINY = SimModel(name="tiny", stages=4, samples_per_step=8, step_s={1: 2.0, 2: 1.0},
                   rebalance_s=20.0, restart_s=30.0, ckpt_save_s=5.0, ckpt_restart_s=60.0)
SIM_RATES = [1e-8, PRIOR_RATE, 0.5 / HOUR, 3.0 / HOUR, 30.0 / HOUR]


@pytest.mark.parametrize("preset", [get_preset("gpt2"), get_preset("bert"), get_preset("vgg"), TINY],
                         ids=lambda p: p.name)
@pytest.mark.parametrize("cfg", [SimConfig(), SimConfig(fallback_every_s=0.0), SimConfig(fatal_rollback=False)],
                         ids=["default", "no-fallback", "restart"])
def test_sim_adaptive_agrees_with_choose_mode(preset, cfg):
    pol = make_policy("adaptive", preset, cfg)
    pol._reset()
    P = preset.stages
    for lam in SIM_RATES:
        # observations that make the posterior lam: quiet exposure below the prior, losses above it
        W, prior = pol.PRIOR_WEIGHT, pol.PRIOR_RATE
        if lam <= prior:
            pol.removals, pol.exposure = 0, W * (prior / lam - 1.0)
        else:
            pol.removals, pol.exposure = (lam - prior) * W, 0.0
        assert pol.rate() == pytest.approx(lam, rel=1e-9, abs=1e-18)
        lam = pol.rate()
        best = None
        for D in range(1, preset.max_pipelines + 1):
            ch = choose_mode(pol.mode_costs(D), lam)
            for m in MODES:
                assert pol.expected_throughput(m, D, lam) == ch.expected[m]
            # the layout the sim picks with D pipelines at most: the same mode
            assert pol.choose_layout(D * P) in range(1, D + 1)
            if best is None or ch.expected[ch.mode] > best[2]:
                best = (D, ch.mode, ch.expected[ch.mode])
            assert (pol.choose_layout(D * P), pol.rc_mode) == best[:2]
        assert pol.choose_layout(P - 1) == 0


def test_sim_costs_are_the_preset_figures():
    """The mapping preset -> ModeCosts, spelled out (gpt2, D = 1 and 2, default config)."""
    pol = make_policy("adaptive", get_preset("gpt2"), SimConfig())
    plain = 1.2 / 1.1
    c1 = ModeCosts(samples_per_step=32, stages=12, pipelines=1,
                   step_s={"eager": 1.2, "lazy": plain * 1.03, "off": plain},
                   failover_pause_s=1.0, reconfiguration_s=20.0, restart_s=30.0, shadow_slowdown=1.5,
                   rollback_s=900.0)  # half the 30 min fallback interval: no peer pipeline
    c2 = ModeCosts(samples_per_step=32, stages=12, pipelines=2,
                   step_s={"eager": 1.085, "lazy": 1.085 / 1.1 * 1.03, "off": 1.085 / 1.1},
                   failover_pause_s=1.0, reconfiguration_s=20.0, restart_s=30.0, shadow_slowdown=1.5)
    for D, c in ((1, c1), (2, c2)):
        for lam in SIM_RATES:
            want = choose_mode(c, lam)
            for m in MODES:
                assert pol.expected_throughput(m, D, lam) == pytest.approx(want.expected[m], rel=1e-12)


def test_value_of_terms_is_expected_samples():
    c = ModeCosts(samples_per_step=8, stages=4, pipelines=2, step_s={"lazy": 1.0}, restart_s=30.0)
    for m in MODES:
        assert value(mode_terms(m, c), 1e-4) == expected_samples_per_s(m, c, 1e-4)


def test_redundant_work_floor_is_the_busiest_nodes_added_work() -> None:
    """Lazy adds the successor's optimizer step, eager that and one forward of the
    successor (a third of its compute); waits hide it only on a processor of its own."""
    from bamboo.plan.redundancy_choice import NodeWork, redundant_work_floor
    shared = [NodeWork((0,), 0.3, 0.05, 0.02, False), NodeWork((1,), 0.6, 0.05, 0.04, False)]
    floor = redundant_work_floor(shared, 2)
    # node of stage 0 holds stage 1's replica: 0.04 + 0.6 / 3; stage 1 holds stage 0's: 0.02 + 0.1
    assert floor == pytest.approx({"lazy": 0.04, "eager": 0.04 + 0.2})
    own = [n._replace(own_processor=True) for n in shared]
    assert redundant_work_floor(own, 2) == pytest.approx({"lazy": 0.0, "eager": 0.04 + 0.2 - 0.05})
    assert redundant_work_floor(shared, 1) == {}
    assert redundant_work_floor([NodeWork((0, 1), 0.3, 0.0, 0.1, False)], 2) == {}


def test_a_measured_reroute_pause_replaces_its_modelled_restart() -> None:
    """Once measured, a re-route's pause (the loss step's excess) is its whole in-flight
    cost: the restart and the slowed attempt are in it."""
    base = dict(samples_per_step=8, stages=4, pipelines=2, step_s={"off": 1.0},
                reconfiguration_s=0.5, shadow_slowdown=2.0)
    modelled = mode_terms("reroute", ModeCosts(**base, failover_pause_s=0.3))
    measured = mode_terms("reroute", ModeCosts(**base, failover_pause_by_mode={"reroute": 0.3}))
    assert modelled.base_s == pytest.approx(0.3 + 0.5 + 1.0 + 0.5)
    assert measured.base_s == pytest.approx(0.3 + 0.5)
