"""Role maps and failover plans, without processes."""
from __future__ import annotations

import pytest

from bamboo.plan.roles import RoleMap, Unrecoverable, plan_failover


def roles(P: int = 4, D: int = 1) -> RoleMap:
    return RoleMap.initial(stages=P, pipelines=D, redundancy=True)


def test_each_node_keeps_its_successors_replica() -> None:
    r = roles(4, 2)
    assert r.holders == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [r.replica_of(n) for n in range(8)] == [1, 2, 3, 0, 1, 2, 3, 0]
    assert r.stage_members(2) == [2, 6]


@pytest.mark.parametrize("lost,shadow", [(2, 1), (0, 3), (3, 2)])
def test_predecessor_becomes_the_shadow(lost: int, shadow: int) -> None:
    plan = plan_failover(roles(), lost)
    assert plan.handled_as == "failover"
    assert [(t.stage, t.new_holder) for t in plan.takeovers] == [(lost, shadow)]
    assert sorted(plan.roles.stages_of(shadow)) == sorted({shadow, lost})
    assert plan.roles.replica_of(shadow) is None  # its replica became its primary
    assert plan.roles.replicas[0][(lost + 1) % 4] is None  # the lost node's replica is gone
    assert plan.roles.epoch == 1 and plan.roles.dead == [lost]


def test_two_stage_pipeline_shadow_holds_both() -> None:
    plan = plan_failover(roles(2), 0)
    assert plan.roles.stages_of(1) == [0, 1]


def test_adjacent_losses_without_a_peer_pipeline_are_unrecoverable() -> None:
    first = plan_failover(roles(), 2).roles
    with pytest.raises(Unrecoverable, match="stage 2 of pipeline 0 lost every copy"):
        plan_failover(first, 1)  # n1 shadows stage 2, whose only copy it held
    with pytest.raises(Unrecoverable, match="stage 2 of pipeline 0 lost every copy with node n2"):
        plan_failover(plan_failover(roles(), 1).roles, 2)  # stage 2's replica was on n1


def test_adjacent_losses_restore_from_a_peer_pipeline() -> None:
    first = plan_failover(roles(4, 2), 1)
    second = plan_failover(first.roles, 2)
    assert second.handled_as == "peer_restore"
    [t] = second.takeovers
    assert (t.stage, t.new_holder, t.source) == (2, 0, 6)
    assert second.roles.stages_of(0) == [0, 1, 2]


def test_losing_a_shadow_moves_both_its_stages() -> None:
    first = plan_failover(roles(4, 2), 2).roles  # n1 holds stages 1, 2
    plan = plan_failover(first, 1)
    assert [(t.stage, t.kind, t.new_holder) for t in plan.takeovers] == [
        (1, "failover", 0), (2, "peer_restore", 0)]
    assert plan.roles.stages_of(0) == [0, 1, 2]


def test_wrapped_run_of_stages() -> None:
    first = plan_failover(roles(4, 2), 0).roles  # n3 holds stages 3 and 0
    assert first.stages_of(3) == [0, 3]
    plan = plan_failover(first, 3)
    assert [(t.stage, t.kind, t.new_holder) for t in plan.takeovers] == [
        (3, "failover", 2), (0, "peer_restore", 2)]


def test_standby_loss_changes_no_role() -> None:
    r = roles(4, 1)
    plan = plan_failover(r, 9)
    assert plan.takeovers == [] and plan.roles.holders == r.holders


def test_json_round_trip() -> None:
    r = plan_failover(roles(4, 2), 5).roles
    assert RoleMap.from_json(r.to_json()) == r


def test_losing_a_pipelines_last_node_is_unrecoverable() -> None:
    alone = plan_failover(roles(2), 0).roles  # n1 holds both stages
    with pytest.raises(Unrecoverable, match="last node"):
        plan_failover(alone, 1)
