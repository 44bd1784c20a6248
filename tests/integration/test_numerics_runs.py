"""Numerics and memory in real runs: --precision bf16, --activation-checkpointing,
--frc-offload, and the memory each redundancy mode reports in summary.json. (The gradient
sum's dtype and the tensor accounting alone: tests/unit/engine/test_numerics.py.)

End-to-end runs use the in-process launcher of test_failover (its fork server stays warm);
each distinct job runs once per module and is shared by the tests that read it.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from support.runs import assert_close, config, run_in_process

BF16_REL = 1e-2
"""bf16 against fp32, per loss and for param_l2 (gpt2-tiny, 6 steps): observed at most
1.6e-4 on a loss and 6e-6 on param_l2."""
KILL_REL = 1e-6
"""A bf16 run with a failover against bf16's failure-free run: observed bit-identical
(equal losses and param_l2); the failover tests' tolerance."""
OFFLOAD_RATIO = 1.5
"""Eager with --frc-offload against --redundancy off, max over nodes of peak device bytes
(gpt2-mini, 4 stages, 8 micro-batches): observed 1.07x (eager without offload: 2.8x)."""

TINY = dict(steps=6)
MINI = dict(model="gpt2-mini", nodes=4, stages=4, micro_batches=8, steps=2)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict]:
    """`run(**flags)`: the summary of that job, run once for the whole module."""
    done: dict[tuple, dict] = {}

    def go(**flags: object) -> dict:
        key = tuple(sorted((k, str(v)) for k, v in flags.items()))
        if key not in done:
            out = tmp_path_factory.mktemp("run") / "run"
            done[key] = run_in_process(config(dict(flags)), out)
            assert done[key]["status"] == "completed", done[key]["error"]
        return done[key]
    return go


# -- bf16 --------------------------------------------------------------------------------------


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_bf16_trains_close_to_fp32(run) -> None:
    fp32, bf16 = run(**TINY), run(**TINY, precision="bf16")
    losses = bf16["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert losses != fp32["losses"]  # bf16 compute is really on
    assert_close(losses, fp32["losses"], rel=BF16_REL)
    assert_close(bf16["param_l2"], fp32["param_l2"], rel=BF16_REL)
    # bf16 activations are half the bytes: less memory on every node
    assert max(bf16["memory_per_node_bytes"]) < max(fp32["memory_per_node_bytes"])


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_bf16_survives_a_kill_and_ends_equal_to_its_failure_free_run(run) -> None:
    free, killed = run(**TINY, precision="bf16"), run(**TINY, precision="bf16", kills=["0:2@3"])
    assert killed["failovers"] == 1 and killed["checkpoint_restores"] == 0
    assert_close(killed["losses"], free["losses"], rel=KILL_REL)
    assert_close(killed["param_l2"], free["param_l2"], rel=KILL_REL)


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_bf16_boundaries_travel_in_their_spec_dtype(run) -> None:
    """cnn-tiny's layers give bf16 under autocast; stage outputs are cast to the boundary
    spec's fp32, which the successor's receive buffers are, so the pipeline runs."""
    summary = run(model="cnn-tiny", steps=2, precision="bf16")
    assert all(math.isfinite(x) for x in summary["losses"])


# -- activation checkpointing ------------------------------------------------------------------


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_activation_checkpointing_is_bit_identical_and_saves_memory(run) -> None:
    """Per-layer checkpoints for the primaries and the replica's FRC: a run with a failover
    (the shadow backpropagates through its checkpointed FRC forwards) ends with the very
    bits of the plain failure-free run."""
    plain = run(**TINY)
    checkpointed = run(**TINY, activation_checkpointing=True, kills=["0:2@3"])
    assert checkpointed["failovers"] == 1
    assert checkpointed["losses"] == plain["losses"]
    assert checkpointed["param_l2"] == plain["param_l2"]
    assert checkpointed["param_sha256"] == plain["param_sha256"]
    assert max(checkpointed["memory_per_node_bytes"]) < max(plain["memory_per_node_bytes"]) / 2


# -- memory accounting and --frc-offload --------------------------------------------------------


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_memory_orders_the_redundancy_modes_and_offload_bounds_eager(run) -> None:
    off, lazy, eager = (run(**MINI, redundancy=m) for m in ("off", "lazy", "eager"))
    offload = run(**MINI, redundancy="eager", frc_offload=True)
    mem = {name: s["memory_per_node_bytes"] for name, s in
           [("off", off), ("lazy", lazy), ("eager", eager), ("offload", offload)]}
    assert all(len(m) == 4 and min(m) > 0 for m in mem.values()), mem
    host = {name: s["host_memory_per_node_bytes"] for name, s in
            [("off", off), ("lazy", lazy), ("eager", eager), ("offload", offload)]}
    for a, b, c in zip(mem["off"], mem["lazy"], mem["eager"]):  # every node, so the max too
        assert a <= b < c, mem
    # lazy's replica lives in host memory: on the device, lazy adds only the stage outputs a
    # shadow's redo needs, less than the replica it keeps on the host
    for a, b, h in zip(mem["off"], mem["lazy"], host["lazy"]):
        assert b - a < h, (mem, host)
    assert max(mem["offload"]) <= OFFLOAD_RATIO * max(mem["off"]), mem
    assert max(mem["eager"]) > OFFLOAD_RATIO * max(mem["off"]), mem  # offloading matters
    assert host["off"] == host["eager"] == [0, 0, 0, 0], host
    assert min(host["lazy"]) > 0 and min(host["offload"]) > 0, host
    assert lazy["replica_host_bytes"] == max(host["lazy"]), (lazy["replica_host_bytes"], host)
    assert off["replica_host_bytes"] == eager["replica_host_bytes"] == 0
    assert 0 < offload["replica_host_bytes"] < lazy["replica_host_bytes"]  # its moments only
    assert offload["losses"] == eager["losses"] and offload["param_sha256"] == eager["param_sha256"]
