"""`--redundancy reroute` without processes: the role maps (`plan_reroute`), and the merged lists
built as the engine builds them finish without deadlock together, with the messages of each kind
between two nodes in one order on both sides (what strict rules need); the choice between a
shadow and a re-route; `--redundancy auto` weighing reroute; the layout panel. The runs:
tests/integration/test_reroute.py."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bamboo.plan import schedule as S
from bamboo.plan.layout import micro_batch_blocks
from bamboo.plan.program import node_instructions
from bamboo.plan.roles import RoleMap, Unrecoverable, plan_reroute


def initial(P: int, D: int) -> RoleMap:
    return RoleMap.initial(stages=P, pipelines=D, redundancy=False)


def test_a_lost_slot_is_served_by_its_peer_which_stays_in_its_own_pipeline() -> None:
    plan = plan_reroute(initial(2, 2), 1)  # n1 = stage 1 of pipeline 0
    roles = plan.roles
    assert plan.handled_as == "reroute" and roles.rerouted and roles.dead == [1]
    route = roles.route(0, 1)
    assert route is not None and route.peers == [3]
    assert roles.holders[0][1] == 3 and roles.pipeline_of(3) == 1 and roles.stages_of(3) == [1]
    assert roles.stage_members(1) == [3] and roles.stage_members(0) == [0, 2]
    assert [r.pipeline for r in roles.served_by(3)] == [0] and roles.served_by(0) == []
    assert roles.active_ranks() == [0, 2, 3]
    assert RoleMap.from_json(roles.to_json()) == roles


def test_a_slot_is_spread_over_every_peer_and_a_lost_peer_is_rerouted_again() -> None:
    first = plan_reroute(initial(2, 3), 1).roles  # stage 1 of pipeline 0
    route = first.route(0, 1)
    assert route is not None and route.peers == [3, 5]
    assert [first.worker(0, 1, i) for i in range(4)] == [3, 5, 3, 5]
    second = plan_reroute(first, 3).roles  # a serving peer, and stage 1 of pipeline 1
    assert second.route(0, 1).peers == [5] and second.route(1, 1).peers == [5]
    assert second.stage_members(1) == [5] and second.pipeline_of(5) == 2
    with pytest.raises(Unrecoverable, match="stage 1"):
        plan_reroute(second, 5)


def test_a_stage_lost_in_every_pipeline_is_unrecoverable() -> None:
    roles = plan_reroute(initial(3, 2), 4).roles  # stage 1 of pipeline 1
    with pytest.raises(Unrecoverable, match="stage 1"):
        plan_reroute(roles, 1)
    assert plan_reroute(roles, 0).roles.route(0, 0).peers == [3]  # another stage: fine


def lists_for(roles: RoleMap, P: int, blocks: list[list[int]], schedule: str) -> dict:
    """Every live node's list: what the engine runs (`program.node_instructions`)."""
    assert roles.stages == P
    return {rank: node_instructions(roles, rank, roles.stages_of(rank), blocks, schedule)
            for rank in roles.active_ranks()}


@given(P=st.integers(2, 4), D=st.integers(2, 4), extra=st.integers(0, 3),
       losses=st.lists(st.integers(0, 15), min_size=1, max_size=4),
       schedule=st.sampled_from(sorted(S.SCHEDULES)))
@settings(max_examples=200, deadline=None, derandomize=True)
def test_rerouted_lists_finish_together_in_one_order_per_pair(
        P: int, D: int, extra: int, losses: list[int], schedule: str) -> None:
    blocks = micro_batch_blocks(D * 2 + extra, D)
    owner = {g: (d, i) for d, block in enumerate(blocks) for i, g in enumerate(block)}
    roles = initial(P, D)
    for lost in losses:
        lost %= D * P
        if lost in roles.dead:
            continue
        try:
            roles = plan_reroute(roles, lost).roles
        except Unrecoverable:
            break
    lists = lists_for(roles, P, blocks, schedule)

    def worker(stage: int, g: int) -> int:
        return roles.worker(owner[g][0], stage, owner[g][1])

    # every instruction of every pipeline is run exactly once, by the slot's worker
    ran = [(type(i), i.stage, i.mb) for lst in lists.values() for i in lst]
    assert len(ran) == len(set(ran))
    for rank, lst in lists.items():
        assert all(worker(i.stage, i.mb) == rank for i in lst)
    expected = sum(len(S.global_order(P, len(b), schedule)) for b in blocks)
    assert len(ran) == expected
    # sends never block, a receive waits for its send: replaying must finish
    pos, sent = dict.fromkeys(lists, 0), set()
    while any(pos[r] < len(lists[r]) for r in lists):
        moved = False
        for r, lst in lists.items():
            while pos[r] < len(lst):
                need = S.matching_send(lst[pos[r]])
                if need is not None and need not in sent:
                    break
                i = lst[pos[r]]
                if isinstance(i, (S.SendActivation, S.SendGrad)):
                    sent.add((type(i), i.stage, i.mb))
                pos[r] += 1
                moved = True
        assert moved, f"deadlock: {pos}"
    # between two nodes, each kind of message is sent and received in one order
    for kind, recv_kind, peer_of in ((S.SendActivation, S.RecvActivation, 1),
                                     (S.SendGrad, S.RecvGrad, -1)):
        sends, recvs = {}, {}
        for r, lst in lists.items():
            for i in lst:
                if isinstance(i, kind):
                    sends.setdefault((r, worker(i.stage + peer_of, i.mb)), []).append(i.mb)
                elif isinstance(i, recv_kind):
                    recvs.setdefault((worker(i.stage - peer_of, i.mb), r), []).append(i.mb)
        assert sends == recvs


def test_the_shadow_is_kept_where_it_carries_no_more_than_the_peers() -> None:
    from bamboo.plan.roles import plan_failover, shadow_or_reroute, slot_loads
    shadowed = RoleMap.initial(stages=2, pipelines=2, redundancy=True)
    shadow, reroute = plan_failover(shadowed, 1), plan_reroute(shadowed, 1)
    assert max(slot_loads(shadow.roles).values()) == max(slot_loads(reroute.roles).values()) == 2
    assert shadow_or_reroute(shadow, reroute) is shadow  # D=2: a tie keeps the shadow
    three = RoleMap.initial(stages=2, pipelines=3, redundancy=True)
    choice = shadow_or_reroute(plan_failover(three, 1), plan_reroute(three, 1))
    assert choice.handled_as == "reroute" and slot_loads(choice.roles)[3] == 1.5
    assert choice.roles.replicas[0][1] is None and choice.roles.replicas[0][0] is None
    assert shadow_or_reroute(None, reroute) is reroute
    with pytest.raises(Unrecoverable):
        shadow_or_reroute(None, None)


def test_auto_weighs_reroute_where_there_are_peers() -> None:
    from bamboo.plan.redundancy_choice import ALL_MODES, ModeCosts, choose_mode
    costs = ModeCosts(samples_per_step=64, stages=4, pipelines=3,
                      step_s={"off": 1.0, "lazy": 1.03, "eager": 1.10},
                      failover_pause_s=0.3, reconfiguration_s=2.0, restart_s=20.0)
    busy = choose_mode(costs, 10 / 3600, ALL_MODES)  # 10 losses per node-hour
    assert set(busy.expected) == set(ALL_MODES) and "reroute" in busy.estimated
    # no replica to keep in step: as fast as off when quiet, covered like a shadow when busy
    assert busy.expected["reroute"] > busy.expected["off"]
    assert busy.mode == "reroute"
    quiet = choose_mode(costs, 0.0, ALL_MODES)
    assert quiet.expected["reroute"] == quiet.expected["off"] > quiet.expected["lazy"]
    single = ModeCosts(samples_per_step=64, stages=4, pipelines=1, step_s={"off": 1.0},
                       restart_s=20.0)
    alone = choose_mode(single, 10 / 3600, ALL_MODES)
    assert alone.expected["reroute"] == alone.expected["off"]  # no peer: every loss is fatal


def test_the_layout_panel_says_who_serves_a_rerouted_slot() -> None:
    from bamboo.run.progress import pipeline_rows
    roles = plan_reroute(initial(2, 2), 1).roles
    served = {(r.pipeline, r.stage): r.peers for r in roles.reroutes}
    assert pipeline_rows(roles.holders, ["n0", "n1", "n2", "n3"], roles.dead, served) == [
        "pipeline 0: n0:s0  s1 served by n3", "pipeline 1: n2:s0  n3:s1"]
