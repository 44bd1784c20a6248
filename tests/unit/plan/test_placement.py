"""Placement across machines: a stage's replica holder is on another machine than the
stage's primary wherever the machines allow, and nothing changes for single-worker nodes."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bamboo.config.modes import RedundancyMode
from bamboo.plan.placement import conflicts, spread
from bamboo.plan.planner import plan_generation


def test_two_machines_of_four_workers_alternate_within_each_pipeline() -> None:
    machine = {f"n{i}": "AB"[i // 4] for i in range(8)}
    order = spread([f"n{i}" for i in range(8)], machine.get, 4)
    assert sorted(order) == sorted(machine)
    assert conflicts(order, machine.get, 4) == 0
    for d in range(2):
        row = [machine[n] for n in order[4 * d:4 * d + 4]]
        assert all(row[s] != row[(s + 1) % 4] for s in range(4))


def test_nodes_without_a_machine_keep_their_order() -> None:
    nodes = [f"n{i}" for i in range(6)]
    assert spread(nodes, lambda n: None, 3) == nodes


@settings(max_examples=60, deadline=None)
@given(stages=st.integers(1, 4), pipelines=st.integers(1, 3),
       machines=st.lists(st.integers(0, 3), min_size=12, max_size=12))
def test_spread_is_a_permutation_that_never_adds_conflicts(stages: int, pipelines: int,
                                                           machines: list[int]) -> None:
    nodes = [f"n{i}" for i in range(stages * pipelines)]
    machine = {n: f"m{machines[i]}" for i, n in enumerate(nodes)}
    order = spread(nodes, machine.get, stages)
    assert sorted(order) == sorted(nodes)
    assert conflicts(order, machine.get, stages) <= conflicts(nodes, machine.get, stages)
    counts = [sum(1 for n in nodes if machine[n] == m) for m in set(machine.values())]
    if stages % 2 == 0 and len(counts) == 2 and counts[0] == counts[1]:
        assert conflicts(order, machine.get, stages) == 0


def test_a_reconfiguration_places_replicas_off_the_primary_machine() -> None:
    """Six survivors on two machines re-planned into 1 pipeline of 4 stages (+2 standbys):
    no stage shares a machine with its replica holder."""
    nodes = [f"n{i}" for i in range(6)]
    machine = {n: "AB"[i % 2 == 0 and i < 4] for i, n in enumerate(nodes)}
    plan = plan_generation(gen=1, epoch=1, start_step=0, nodes=nodes,
                           holdings={n: set(range(4)) for n in nodes}, stages=4,
                           param_counts=[10, 10, 10, 10], global_micro_batches=4,
                           redundancy=RedundancyMode.LAZY, max_pipelines=1, machine_of=machine.get)
    assert conflicts(plan.members[:4], machine.get, 4) == 0
