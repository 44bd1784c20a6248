"""`--stages auto`'s planner: the fewest stages that fit a node, the most pipelines the nodes
and the global batch allow, M = S / (D x B), and one-line refusals."""
from __future__ import annotations

import pytest

from bamboo.config import ConfigError
from bamboo.config.modes import RedundancyMode
from bamboo.plan.layout_choice import (
    BYTES_PER_PARAMETER,
    Footprint,
    choose_layout,
    node_need,
)

MiB = 2**20
LAYER = 1_000_000
"""Parameters a layer of the model below: 16 MB of state (parameter, gradient, two moments)."""


def model(layers: int = 8, costs: tuple[float, ...] | None = None) -> Footprint:
    return Footprint("toy", (LAYER,) * layers, costs or (float(LAYER),) * layers,
                     (4096,) * layers)


def choose(memory: int, *, nodes: int = 4, s: int = 64, b: int = 8, replica: bool = True,
           m: Footprint | None = None, least: int = 1):
    return choose_layout(m or model(), nodes=nodes, memory_per_node=memory, global_batch=s,
                         micro_batch_size=b, replica=replica, least_pipelines=least)


def test_a_model_that_fits_one_node_gets_one_stage_and_every_node_a_pipeline() -> None:
    c = choose(1 << 30)
    assert (c.stages, c.pipelines, c.micro_batches) == (1, 4, 2)
    assert c.need.state_bytes == 8 * LAYER * BYTES_PER_PARAMETER  # no replica at P=1
    assert "at P=1" in c.why and "4 pipelines on 4 of the nodes" in c.why


def test_the_smallest_p_whose_stage_with_its_replica_fits() -> None:
    # P=2 holds 4 layers and the next stage's 4 (128 MB), P=3 3 + 3 (96 MB), P=4 2 + 2
    c = choose(90 * 10**6)
    assert (c.stages, c.pipelines, c.micro_batches) == (4, 1, 8)
    assert c.need.state_bytes == 4 * LAYER * BYTES_PER_PARAMETER
    assert "with its replica" in c.why and "at P=3 a node needs 91.6 MiB" in c.why
    # off and reroute keep no replica: the same memory holds the model in 2 stages
    off = choose(90 * 10**6, replica=False)
    assert (off.stages, off.pipelines, off.micro_batches) == (2, 2, 4)
    assert off.need.state_bytes == 4 * LAYER * BYTES_PER_PARAMETER


def test_a_replica_in_host_memory_counts_against_host_memory_not_the_device() -> None:
    # 90 MB of device memory: with the replica on the device P=4 (above); in host memory
    # the stage alone must fit it (P=2: 4 layers, 64 MB) and the next stage's 64 MB the host
    c = choose_layout(model(), nodes=4, memory_per_node=90 * 10**6, global_batch=64,
                      micro_batch_size=8, replica=True, host_memory_per_node=1 << 30)
    assert (c.stages, c.pipelines) == (2, 2)
    assert c.need.state_bytes == c.need.host_bytes == 4 * LAYER * BYTES_PER_PARAMETER
    assert "its replica's 61.0 MiB in host memory" in c.why
    # too little host memory for any replica: one line naming the flag
    with pytest.raises(ConfigError, match="--host-memory-per-node 10.0 MiB") as e:
        choose_layout(model(), nodes=4, memory_per_node=90 * 10**6, global_batch=64,
                      micro_batch_size=8, replica=True, host_memory_per_node=10 * MiB)
    assert e.value.options == ("host_memory_per_node",) and "\n" not in str(e.value)
    assert [m.value for m in RedundancyMode if m.keeps_replica_on_host] == ["lazy"]


def test_the_redundancy_modes_that_keep_a_replica() -> None:
    """Memory is planned for a replica where the mode keeps one, and under auto."""
    assert [m.value for m in RedundancyMode if m.may_keep_replica] == ["eager", "lazy", "auto"]
    assert [m.value for m in RedundancyMode if m.keeps_replica] == ["eager", "lazy"]


def test_pipelines_are_the_most_the_global_batch_divides_into() -> None:
    c = choose(1 << 30, nodes=4, s=48)  # 6 micro-batches: 4 pipelines cannot share them
    assert (c.stages, c.pipelines, c.micro_batches) == (1, 3, 2)
    c = choose(1 << 30, nodes=8, s=56)  # 7: a prime, one pipeline takes them all
    assert (c.stages, c.pipelines, c.micro_batches) == (1, 7, 1)
    # every layout keeps the global batch: D x M x B = S
    for nodes in range(1, 9):
        for s in (8, 16, 24, 64, 96):
            c = choose(1 << 30, nodes=nodes, s=s)
            assert c.pipelines * c.micro_batches * 8 == s and c.pipelines * c.stages <= nodes


def test_reroute_needs_two_pipelines() -> None:
    c = choose(1 << 30, least=2, replica=False)
    assert c.pipelines >= 2
    with pytest.raises(ConfigError, match="cannot be shared by 2 or more pipelines"):
        choose(1 << 30, nodes=4, s=40, least=2, replica=False, m=model(layers=1))


def test_stages_are_cut_by_the_layer_costs_given() -> None:
    # measured seconds that put the first 6 layers in stage 0 of 2
    measured = model(costs=(1.0,) * 6 + (3.0, 3.0))
    assert node_need(measured, 2, 4, False).state_bytes == 6 * LAYER * BYTES_PER_PARAMETER
    assert node_need(model(), 2, 4, False).state_bytes == 4 * LAYER * BYTES_PER_PARAMETER
    # so 80 MB holds no stage of the measured cut at P=2, but one at P=3
    assert choose(80 * 10**6, replica=False).stages == 2
    assert choose(80 * 10**6, replica=False, m=measured).stages == 3


def test_activations_in_flight_and_the_schedule_count() -> None:
    need = node_need(model(), 2, 4, True)
    assert need.activation_bytes == 2 * 4 * 4096  # min(M, P) micro-batches of stage 0's layers
    assert need.schedule_bytes == (4 * 4 + 8) * 56
    assert need.total == need.state_bytes + need.activation_bytes + need.schedule_bytes


@pytest.mark.parametrize("kwargs,expected", [
    (dict(memory=10 * MiB), "no layout of toy fits a node's 10.0 MiB on 4 nodes: the least a "
                            "node needs is 61.1 MiB (P=4"),
    (dict(memory=1 << 30, s=60), "--global-batch-size 60 is not a multiple of "
                                 "--micro-batch-size 8: use 56 or 64"),
    (dict(memory=1 << 30, s=4), "use 8"),
])
def test_refusals_are_one_line(kwargs: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        choose(**kwargs)
    assert expected in str(info.value) and "\n" not in str(info.value)
