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
