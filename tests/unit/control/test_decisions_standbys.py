"""The coordinator's decisions about nodes that are coming and standbys, without processes.

Trace replay treats the trace as capacity: a worker it started is coming until it says it is
ready, so a run whose last trained nodes are lost while the replacements start restores from
its checkpoint with them (it does not stop for want of nodes). And a standby that is up fills
a hole of the layout (a re-routed or shadowed slot) at the next step boundary, whatever the
other holes. Driven through `tests/coordinator_sim.py` like `test_decisions.py`.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from bamboo.config import JobConfig
from bamboo.config.modes import RedundancyMode
from bamboo.plan.planner import GenerationPlan, plan_generation
from coordinator_sim import SimCluster


def cfg(**kw) -> JobConfig:
    base = dict(nodes=4, stages=2, steps=20, micro_batches=4)
    return JobConfig.of(**(base | kw)).validate()


def _trace(tmp_path: Path, rows: list[tuple[float, str, str]]) -> str:
    path = tmp_path / "trace.csv"
    path.write_text("".join(f"{s * 1000:.0f},{kind},{node}\n" for s, kind, node in rows))
    return str(path)


def node_of(sim: SimCluster, pipeline: int, stage: int) -> int:
    return sim.core.gens.member(sim.ctx.roles.holders[pipeline][stage]).node


SWAP_TRACE = [(0, "add", f"a{i}") for i in range(1, 5)] + \
    [(5, "add", f"b{i}") for i in range(1, 5)] + \
    [(75, "remove", f"a{i}") for i in range(1, 5)]
"""Four nodes train; four more wait for a slot (--max-nodes 4) and take the slots when the
first four are removed, all at once, `--boot-s` later."""


@pytest.mark.timeout(60)
def test_started_replacements_are_coming_and_the_run_restores_its_checkpoint(
        tmp_path: Path) -> None:
    config = cfg(max_nodes=4, time_scale=40.0, boot_s=20.0, checkpoint_every=5,
                 trace=_trace(tmp_path, SWAP_TRACE))  # a step (0.25 s) is 10 trace s
    sim = SimCluster(config, tmp_path / "run")
    sim.finish()
    assert sim.stopped is None, sim.stopped
    assert sim.core.finished()
    assert [e["trace_node"] for e in sim.events.of("node_up")] == \
        ["a1", "a2", "a3", "a4", "b1", "b2", "b3", "b4"]
    [restore] = sim.events.of("checkpoint_restore")
    assert restore["step"] == 5 and restore["checkpoint"] is not None
    summary = sim.core.final_summary()
    assert summary["steps_completed"] == 20
    assert summary["redone_steps"] == restore["redone_steps"] > 0
    assert summary["checkpoint_restores"] >= 1 and summary["stopped"] == 0
    assert set(sim.ctx.plan.members) <= {"n4", "n5", "n6", "n7"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("redundancy, handled", [("reroute", "reroute"), ("eager", "failover")])
def test_one_standby_fills_one_of_two_holes_at_the_next_boundary(
        tmp_path: Path, redundancy: str, handled: str) -> None:
    """2 x 2: two nodes of different stages and pipelines lost (re-routed, or shadowed),
    then one standby comes up. It takes one of the two emptied slots at the next step
    boundary; the other stays served by its stage's peer. A later loss of the stage-0 node
    it joined is covered in flight (the standby now holds stage 0 as well): no restore."""
    sim = SimCluster(cfg(nodes=4, stages=2, steps=14, redundancy=redundancy), tmp_path / "run")
    for _ in range(3):
        sim.step()
    sim.kill(node_of(sim, 0, 1))
    sim.step()
    standby = sim.join()  # up; the second loss comes before the boundary it would join at
    sim.kill(node_of(sim, 1, 0))
    sim.step()  # the boundary after this step: the standby fills a hole
    sim.step()
    assert [e["handled_as"] for e in sim.lost_events()] == [handled, handled]
    [plan] = sim.events.of("reconfigured")
    assert "fill a hole" in plan["reason"], plan
    assert (plan["pipelines"], plan["stages"]) == (2, 2) and len(plan["members"]) == 3
    assert standby.node.name in plan["members"] and plan["checkpoint"] is None
    roles = sim.ctx.roles
    assert len(roles.reroutes) == 1 and sim.ctx.plan.holes == \
        [[roles.reroutes[0].pipeline, roles.reroutes[0].stage]]
    assert roles.stages_of(standby.node.rank) == [0]
    sim.kill(node_of(sim, 0, 0))
    while sim.stopped is None and sim.ctx.committed < 14:
        sim.step()
        sim.check_invariants()
    sim.finish()
    assert sim.stopped is None, sim.stopped
    assert sim.lost_events()[-1]["handled_as"] == "reroute"
    summary = sim.core.final_summary()
    assert summary["redone_steps"] == 0 and summary["checkpoint_restores"] == 0
    assert summary["steps_completed"] == 14


def _keep(nodes: list[str], holdings: dict[str, set[int]], layout: tuple[int, int],
          redundancy: RedundancyMode = RedundancyMode.OFF) -> GenerationPlan:
    return plan_generation(gen=1, epoch=5, start_step=3, nodes=nodes, holdings=holdings,
                           stages=layout[1], param_counts=[10] * 6, global_micro_batches=6,
                           redundancy=redundancy, keep_layout=layout)


def test_a_kept_layout_gives_every_stage_a_holder_and_reroutes_its_holes() -> None:
    """Three nodes that each hold more of stage 0 than of stage 1, in a 3 x 2 layout: one of
    them must take stage 1 all the same, and the three empty slots are served by their
    stage's holders."""
    held = {"n0": {0, 1, 2, 3}, "n1": {0, 1, 2, 4, 5}, "n2": {0, 1, 2, 4, 5}}
    plan = _keep(["n0", "n1", "n2"], held, (3, 2))
    assert plan.active == 3 and len(plan.holes) == 3
    roles = plan.roles()
    assert sorted(s for r in range(3) for s in roles.stages_of(r)) == [0, 0, 1]
    assert {(r.pipeline, r.stage) for r in roles.reroutes} == {tuple(h) for h in plan.holes}
    for r in roles.reroutes:
        assert r.peers and all(roles.stages_of(p) == [r.stage] for p in r.peers)
    assert {layer for layer, _, _ in plan.transfers} == {3}
    assert GenerationPlan.from_json(plan.to_json()) == plan


def test_a_kept_layout_keeps_no_replica_next_to_a_hole() -> None:
    plan = _keep(["n0", "n3", "n4"], {"n0": set(range(6)), "n3": set(range(6))}, (2, 2),
                 redundancy=RedundancyMode.LAZY)
    roles = plan.roles()
    [hole] = plan.holes
    d, s = hole
    assert roles.replicas[d][s] is None and roles.replicas[d][(s + 1) % 2] is None
    kept = [(e, t) for e in range(2) for t in range(2) if e != d]
    assert all(roles.replicas[e][t] is not None for e, t in kept)
    assert plan.transfers == [] or all(dst == 2 for _, _, dst in plan.transfers)
