"""The peers' policies (torchrun restarts, torchft replica groups) and bamboo train's modes by
name: step and sample accounting worked out by hand on small traces."""

from pathlib import Path

import pytest

from bamboo.sim.core import SimConfig
from bamboo.sim.cost_presets import SimModel, get_preset
from bamboo.sim.policies import POLICIES, make_policy
from bamboo.traces.trace import ADD, REMOVE, Trace, load_trace

P3 = Path(__file__).resolve().parents[3] / "traces" / "aws-p3-2xlarge.csv"

ONE_STAGE = SimModel(name="one", stages=1, samples_per_step=10, step_s={1: 1.0, 2: 1.0}, rc_overhead=0.0,
                     ckpt_restart_s=5.0, ckpt_save_s=0.0, heal_s=4.0, quorum_s=0.5)


def trace(rows: list[tuple[float, int, int]], duration: float, nodes: int = 2) -> Trace:
    rows = sorted([(0.0, ADD, n) for n in range(nodes)] + rows, key=lambda r: r[0])
    return Trace(name="hand", times=[r[0] for r in rows], kinds=[r[1] for r in rows],
                 nodes=[r[2] for r in rows], duration=duration)


def test_torchrun_restarts_every_worker_from_the_newest_checkpoint_once_the_world_is_whole() -> None:
    cfg = SimConfig(alloc_delay_s=0.0, checkpoint_every_steps=3, torchrun_min_nodes=2)
    # start at 5 (restart 5 s); steps end at 6..10, a checkpoint after step 3 (t=8); node 1
    # lost at 10.5: steps 4 and 5 are lost, nothing runs until a replacement (node 2, ready at
    # 12) makes the world whole; restart until 17; steps end at 18, 19, 20
    policy = make_policy("torchrun", ONE_STAGE, cfg)
    result = policy.run(trace([(10.5, REMOVE, 1), (12.0, ADD, 2)], duration=20.5))
    assert policy.first_run_t == 5.0
    assert result.steps == 6 and result.samples == 60
    assert result.extra["rolled_back_steps"] == 2 and result.fatal_failures == 1
    assert result.breakdown["restart"] == pytest.approx(10.0)  # both restarts
    assert result.breakdown["idle"] == pytest.approx(1.5)  # 10.5 to 12: waiting for the world
    # elastic (one node enough): it restarts at once on the node left, without waiting
    elastic = make_policy("torchrun", ONE_STAGE, SimConfig(alloc_delay_s=0.0, checkpoint_every_steps=3))
    assert elastic.run(trace([(10.5, REMOVE, 1)], duration=20.5)).breakdown["idle"] == 0.0


def test_torchft_drops_a_lost_group_share_and_heals_it_back() -> None:
    cfg = SimConfig(alloc_delay_s=0.0)
    # two groups of one node, 1 s a step; node 1 lost at 4.5 (4 steps done, the step under way
    # voided); one group alone commits half a batch a second, plus 0.5 s for the new quorum:
    # a whole batch's worth at 7.0; its replacement, ready at 4.5, heals until 8.5; then
    # whole steps at 8.75, 9.75, 10.75
    result = make_policy("torchft", ONE_STAGE, cfg).run(
        trace([(4.5, REMOVE, 1), (4.5, ADD, 2)], duration=10.8))
    assert result.samples == 80
    assert result.extra == {"groups_dropped": 1, "heals": 1}
    assert result.breakdown["lost"] == pytest.approx(0.5 + 0.05)  # the voided step, the unfinished one


def test_torchft_on_shared_processors_loses_no_rate_with_a_group_gone() -> None:
    # 2 groups on 1 shared processor: one group alone does half the work in half the time
    cfg = SimConfig(alloc_delay_s=0.0, shared_cores=1)
    model = SimModel(name="one", stages=1, samples_per_step=10, step_s={1: 1.0, 2: 1.0}, rc_overhead=0.0,
                     heal_s=100.0, quorum_s=0.0)
    result = make_policy("torchft", model, cfg).run(trace([(4.0, REMOVE, 1)], duration=10.0))
    assert result.samples == 100


def test_a_group_lost_while_healing_heals_again_from_its_next_replacement() -> None:
    cfg = SimConfig(alloc_delay_s=0.0)
    policy = make_policy("torchft", ONE_STAGE, cfg)
    # node 1 lost at 2; its replacement 2 (ready at 2) lost at 5 before its heal ends (6);
    # replacement 3 at 5 heals until 9: the first heal's timer must not bring the group back
    result = policy.run(trace([(2.0, REMOVE, 1), (2.0, ADD, 2), (5.0, REMOVE, 2), (5.0, ADD, 3)],
                              duration=8.9))
    assert result.extra.get("heals", 0) == 0 and result.extra["groups_dropped"] == 1


def test_torchft_with_every_group_lost_begins_again_at_step_0() -> None:
    cfg = SimConfig(alloc_delay_s=0.0)
    policy = make_policy("torchft", ONE_STAGE, cfg)
    # two groups of one node, 1 s a step: 4 steps by 4.0; node 1 lost at 4.5, node 0 at 4.6:
    # no group holds the model, the 4 steps are lost. Replacement 2 (ready at 6) makes group 0
    # whole and it starts from step 0 at once, alone: half a batch a second, a global step at
    # 8.0; replacement 3 heals from it until 10.0
    result = policy.run(trace([(4.5, REMOVE, 1), (4.6, REMOVE, 0), (6.0, ADD, 2), (6.0, ADD, 3)],
                              duration=9.5))
    assert result.samples == 10
    assert result.extra["restarts_from_zero"] == 1 and result.extra["rolled_back_steps"] == 4
    assert result.extra["groups_dropped"] == 2 and result.extra.get("heals", 0) == 0
    # the same losses with group 0 kept: nothing rolled back
    kept = make_policy("torchft", ONE_STAGE, cfg).run(
        trace([(4.5, REMOVE, 1), (6.0, ADD, 3)], duration=9.5))
    assert "restarts_from_zero" not in kept.extra and kept.samples > 40


def test_torchft_with_its_last_group_lost_goes_on_from_a_group_healing() -> None:
    cfg = SimConfig(alloc_delay_s=0.0)
    policy = make_policy("torchft", ONE_STAGE, cfg)
    # node 1 lost at 2.5 (2 steps), its replacement 2 heals from 2.5 (until 6.5); node 0 lost
    # at 3.0: group 1 holds the model from its heal and goes on alone at once, half a batch a
    # second after the new quorum's 0.5 s: global steps at 5.5 and 7.5; nothing is rolled back
    result = policy.run(trace([(2.5, REMOVE, 1), (2.5, ADD, 2), (3.0, REMOVE, 0)], duration=7.6))
    assert "restarts_from_zero" not in result.extra and "rolled_back_steps" not in result.extra
    assert result.extra["heals"] == 1 and result.samples == 40


def test_every_redundancy_mode_and_peer_has_a_policy_of_its_name() -> None:
    for name in ("eager", "lazy", "off", "reroute", "auto", "checkpoint", "torchrun", "torchft"):
        assert POLICIES[name].name == name
    gpt2, cfg = get_preset("gpt2"), SimConfig()
    p3 = load_trace(P3)
    runs = {name: make_policy(name, gpt2, cfg).run(p3) for name in ("eager", "lazy", "off", "bamboo")}
    assert runs["eager"].samples == runs["bamboo"].samples  # the paper's system, two names
    # lazy pays less than eager a step and keeps its failovers; off restores from peers instead
    assert runs["lazy"].samples > runs["eager"].samples
    assert runs["off"].extra.get("failovers", 0) == 0 < runs["lazy"].extra["failovers"]
