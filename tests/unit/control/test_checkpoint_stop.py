"""A checkpoint that cannot be saved stops the run at once, naming the storage's error and
the newest whole checkpoint (where the run resumes), in its one line and its summary: the
coordinator's decision, driven without processes (tests/coordinator_sim.py). The real run
on a full tmpfs: tests/integration/test_run_ends_runs.py."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bamboo.config import JobConfig
from bamboo.protocol.messages import CheckpointPart
from coordinator_sim import SimCluster
from support.decisions import node_of, run

FULL = "could not write layer 3 to /disk/step-00000004: No space left on device (12 kB free there)"


def _part_fails(step: int, error: str) -> Callable[[SimCluster], None]:
    """The writer of stage 1 reports that its part of step `step`'s checkpoint failed."""
    def act(sim: SimCluster) -> None:
        w = sim.workers[node_of(sim, 0, 1)]
        sim._send(w, CheckpointPart(rank=w.node.rank, step=step, layers=[], error=error))
    return act


def _job(**kw: object) -> JobConfig:
    return JobConfig.of(**(dict(nodes=2, stages=2, steps=6, checkpoint_every=1) | kw)).validate()


def test_a_full_disk_stops_the_run_at_the_first_failed_save(tmp_path: Path) -> None:
    sim = run(tmp_path, _job(), {3: _part_fails(4, FULL)})
    newest = tmp_path / "run" / "checkpoints" / "step-00000003"
    assert sim.stopped == (
        f"checkpoint of step 4 not saved: {FULL}; stopped the run, as training on would go "
        f"without a restore point (a checkpoint of this job takes about 5.2 MB); the newest "
        f"whole checkpoint is step 3 ({newest.resolve()}): the run resumes from it once there "
        f"is room")
    assert sim.failed["status"] == "failed" and sim.failed["error"] == sim.stopped
    assert sim.failed["steps_completed"] == 3
    failed = sim.events.of("checkpoint_failed")
    assert [(e["step"], e["error"]) for e in failed] == [(4, FULL)]
    assert [e["step"] for e in sim.events.of("checkpoint")] == [1, 2, 3]
    assert sim.events.of("run_failed")[0]["error"] == sim.stopped


def test_without_a_whole_checkpoint_the_run_starts_over(tmp_path: Path) -> None:
    denied = "could not write checkpoint folder /ro/step-00000001: Permission denied"
    sim = run(tmp_path, _job(), {0: _part_fails(1, denied)})
    assert sim.stopped is not None and sim.stopped.startswith(
        f"checkpoint of step 1 not saved: {denied}; stopped the run")
    assert sim.stopped.endswith("; no whole checkpoint was written before: the run starts over "
                                "once its checkpoints can be written")


def test_a_manifest_that_cannot_be_written_stops_the_run_too(tmp_path: Path) -> None:
    """Every part is durable but the coordinator cannot write step 3's manifest (its name is
    taken by a folder): the same stop, the newest whole checkpoint step 2."""
    def block(sim: SimCluster) -> None:
        (tmp_path / "run" / "checkpoints" / "step-00000003" / "manifest.json").mkdir(parents=True)
    sim = run(tmp_path, _job(), {2: block})
    assert sim.stopped is not None
    assert sim.stopped.startswith("checkpoint of step 3 not published in ")
    assert "could not write step-00000003/manifest.json: Is a directory; step-00000002 is " \
        "kept; stopped the run" in sim.stopped
    assert "the newest whole checkpoint is step 2 (" in sim.stopped
    assert sim.failed["steps_completed"] == 3
