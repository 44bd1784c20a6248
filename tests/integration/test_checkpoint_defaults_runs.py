"""Checkpoints a newcomer gets without asking, in real `bamboo train` runs: an uncovered loss
restores the default checkpoint, not step 0; the same command resumes with `--resume auto`
and a finished run extends without redoing; an edited or corrupt checkpoint is skipped with
one line; a full disk stops the run at its first failed save and leaves none. (The interval and
the checks of a manifest, without processes: tests/unit/control/test_checkpoint_defaults.py.)
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bamboo.config import JobConfig
from support.procs import mounted_tmpfs, run_bamboo, run_events
from support.runs import assert_close

# -- real runs ----------------------------------------------------------------------------------

JOB = ["train", "--nodes", "2", "--stages", "2", "--no-report"]


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_an_uncovered_loss_restores_the_default_checkpoint_not_step_0(tmp_path: Path) -> None:
    """The newcomer's run: 4 nodes, no checkpoint flag, stages 1 and 2 of the only pipeline
    killed in step 6. The run goes back to the checkpoint it wrote after step 2 and ends
    equal to the failure-free run."""
    from support.runs import assert_equal_and_accounted
    out = tmp_path / "run"
    result = run_bamboo([*JOB[:1], "--nodes", "4", "--stages", "4", "--steps", "8", "--quiet",
                         "--no-report", "--json", "--kill", "0:1@6", "--kill", "0:2@6"], out)
    assert result.code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert_equal_and_accounted(summary, JobConfig.of(nodes=4, stages=4, steps=8).validate(),
                               lost=2)
    restores = [e for e in run_events(out) if e["event"] == "checkpoint_restore"]
    assert [(Path(e["checkpoint"]).name, e["redone_steps"]) for e in restores] == [
        ("step-00000002", 4)]
    assert summary["checkpoint_restores"] == 1 and summary["redone_steps"] == 4


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_the_same_command_resumes_and_a_finished_run_extends_without_redoing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = run_bamboo([*JOB, "--steps", "4", "--json", "--quiet"], out)
    assert first.code == 0, first.stderr
    summary = json.loads(first.stdout)
    assert summary["config"]["checkpoint_every_by"] == "run"
    assert summary["config"]["checkpoint_every"] >= 1
    again = run_bamboo([*JOB, "--steps", "4", "--quiet"], out)
    assert again.code == 2 and "--resume auto" in again.stderr, again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    more = run_bamboo([*JOB, "--steps", "6", "--json", "--resume", "auto"], out)
    assert more.code == 0, more.stderr
    extended = json.loads(more.stdout)
    assert "resumed from step 4 (" in more.stderr, more.stderr
    assert (extended["resumed_from_step"], extended["redone_steps"]) == (4, 0)
    assert_close(extended["losses"][:4], summary["losses"], rel=0)


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_resume_auto_past_an_edited_or_corrupt_checkpoint(tmp_path: Path) -> None:
    """The newest checkpoint edited: resumed from the one before, with one line. Every one
    damaged: one line saying so, and a start from step 0 (no traceback either way)."""
    out = tmp_path / "run"
    first = run_bamboo([*JOB, "--steps", "5", "--checkpoint-every", "2", "--json", "--quiet"], out)
    assert first.code == 0, first.stderr
    root = out / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000004", "step-00000005"]
    manifest = json.loads((root / "step-00000005" / "manifest.json").read_text())
    manifest["step"] = 3
    (root / "step-00000005" / "manifest.json").write_text(json.dumps(manifest))
    second = run_bamboo([*JOB, "--steps", "6", "--json", "--quiet", "--resume", "auto"], out)
    assert second.code == 0, second.stderr
    warned = [line for line in second.stderr.splitlines() if "step-00000005" in line]
    assert len(warned) == 1 and "does not match its checksum" in warned[0], second.stderr
    assert json.loads(second.stdout)["resumed_from_step"] == 4
    for manifest in root.glob("step-*/manifest.json"):
        manifest.write_text(manifest.read_text().replace('"step"', '"stop"'))
    third = run_bamboo([*JOB, "--steps", "7", "--json", "--quiet", "--resume", "auto"], out)
    assert third.code == 0, third.stderr
    warned = [line for line in third.stderr.splitlines() if "warning" in line]
    assert len(warned) == 1 and "--resume auto: no whole checkpoint" in warned[0] and \
        "starting from step 0" in warned[0], third.stderr
    assert "Traceback" not in second.stderr + third.stderr
    assert json.loads(third.stdout)["resumed_from_step"] is None


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_a_full_run_disk_stops_at_the_first_failed_save_and_leaves_none(tmp_path: Path) -> None:
    """A 2 MB --out and a checkpoint every step: the first save (5 MB) does not fit; the run
    stops there with one line naming the folder and the room left, its failed save removed
    (no step folder without its manifest), its summary written."""
    with mounted_tmpfs(tmp_path / "disk", "size=2m") as disk:
        out = disk / "run"
        result = run_bamboo([*JOB, "--steps", "8", "--checkpoint-every", "1", "--json", "--quiet"],
                            out)
        assert "Traceback" not in result.stderr
        assert result.code == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        failed = [e for e in run_events(out) if e["event"] == "checkpoint_failed"]
        assert [e["step"] for e in failed] == [1], failed
        assert result.stderr.startswith("bamboo train: error: checkpoint of step 1 not saved: "
                                        "could not write ")
        assert f"{out}/checkpoints/step-00000001" in result.stderr
        assert "No space left on device (" in result.stderr
        assert result.stderr.rstrip().endswith("no whole checkpoint was written before: the run "
                                               "starts over once there is room")
        leftover = [p.name for p in (out / "checkpoints").glob("step-*")
                    if not (p / "manifest.json").exists()]
        assert leftover == []
        summary = json.loads((out / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["steps_completed"] < 8
