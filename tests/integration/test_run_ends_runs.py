"""The ends of a run, with real processes, and output that belongs to the user.

One failure-free `bamboo train --json` run of a noisy model (tests/support/noisy_model.py:
its code prints to stdout and stderr, logs through a logger bound to sys.stdout, writes to
descriptor 1) is the reference of every test here:

- its stdout is its summary alone; what the workers printed is in RUN/logs/n<id>.log, and
  none of it on the command's stdout or stderr;
- `--json --resume auto` on the finished run prints that summary (and `bamboo soak` judges
  it equal);
- a copy without model.pt and summary.json finishes from its last step's checkpoint with the
  same command (CLI and `bamboo.train`), equal, nothing redone; so does a run whose
  coordinator is SIGKILLed the moment that checkpoint is published;
- `bamboo soak --faults coordinator` with the kill drawn at the run's end: judged equal;
- a full checkpoint disk (a real tmpfs) stops the run at the first checkpoint it cannot
  write, naming the folder, the room left and the newest whole checkpoint, from which the
  same command resumes, once there is room, to the reference's losses and bits.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bamboo.chaos.soak import Trial, draw, judge
from support.noisy_model import MARK
from support.procs import BAMBOO, REPO, Result, mounted_tmpfs, run_bamboo, run_events
from support.strict import strict_loads

pytestmark = [pytest.mark.procs, pytest.mark.slow]  # every test here starts processes

STEPS = 4
MODEL = f"{REPO / 'tests' / 'support' / 'noisy_model.py'}:build"
JOB = ["--model", MODEL, "--nodes", "2", "--stages", "2", "--steps", str(STEPS), "--quiet",
       "--no-report"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Result:
    """The failure-free run (default checkpoints: after step 2 and after the last)."""
    out = tmp_path_factory.mktemp("ends") / "reference"
    result = run_bamboo(["train", *JOB, "--json"], out)
    assert result.code == 0, result.stderr
    return result


def _assert_equal(summary: dict, reference: Result) -> None:
    """The reference run's losses and bits, every step counted once, nothing redone."""
    want = reference.summary
    assert summary["status"] == "completed"
    assert summary["losses"] == want["losses"] and len(summary["losses"]) == STEPS
    assert summary["param_sha256"] == want["param_sha256"]
    assert summary["param_l2"] == want["param_l2"]
    assert summary["redone_steps"] == 0


def _same_model(a: Path, b: Path) -> None:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_json_stdout_is_the_summary_and_the_workers_output_is_in_their_logs(
        reference: Result) -> None:
    assert json.loads(reference.stdout) == reference.summary  # nothing else on stdout
    assert MARK not in reference.stdout
    workers = {e["node"]: e["pid"] for e in reference.events() if e["event"] == "node_up"}
    assert sorted(workers) == ["n0", "n1"]
    for node, pid in workers.items():
        log = (reference.out / "logs" / f"{node}.log").read_text()
        assert log.startswith(f"--- {node} (pid {pid}) started ")
        for what in ("build() on stdout", "build() on stderr", "a logger bound to sys.stdout",
                     "descriptor 1"):
            assert f"{MARK} {what} in pid {pid}" in log, (what, log)
        assert f"pid {pid}" not in reference.stderr  # the worker's text is in its log only
    # The calling process built the model once for its checks: its prints went to stderr.
    assert f"{MARK} descriptor 1 in pid" in reference.stderr
    assert f"{MARK} a logger bound to sys.stdout in pid" in reference.stderr


def test_resume_auto_on_a_finished_run_prints_its_summary(reference: Result) -> None:
    again = run_bamboo(["train", *JOB, "--json", "--resume", "auto"], reference.out)
    assert again.code == 0, again.stderr
    assert json.loads(again.stdout) == reference.summary
    assert f"the run in {reference.out} already completed {STEPS} steps; nothing to do" \
        in again.stderr
    trial = Trial(index=0)  # what `bamboo soak` makes of a coordinator killed after the summary
    judge(trial, reference.summary, again.code, again.stdout, again.stderr)
    assert trial.outcome == "equal", trial.why
    fewer = run_bamboo(["train", *JOB, "--steps", "3", "--json", "--resume", "auto"],
                       reference.out)  # the last --steps counts
    assert fewer.code == 0 and json.loads(fewer.stdout) == reference.summary, fewer.stderr
    assert f"already completed {STEPS} steps" in fewer.stderr  # the steps the run did


def _without_its_end(reference: Result, out: Path) -> Path:
    """A copy of the finished run as a coordinator killed after its last checkpoint leaves
    it: its checkpoints and events, no model.pt, no summary.json."""
    shutil.copytree(reference.out, out)
    (out / "model.pt").unlink()
    (out / "summary.json").unlink()
    assert (out / "checkpoints" / f"step-{STEPS:08d}" / "manifest.json").is_file()
    return out


def test_a_run_without_its_model_and_summary_finishes_from_its_last_checkpoint(
        reference: Result, tmp_path: Path) -> None:
    out = _without_its_end(reference, tmp_path / "cli")
    done = run_bamboo(["train", *JOB, "--json", "--resume", "auto"], out)
    assert done.code == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary == done.summary
    _assert_equal(summary, reference)
    assert summary["resumed_from_step"] == STEPS
    assert f"the checkpoint of step {STEPS} is the run's last: writing its model.pt" \
        in done.stderr
    assert sum(e["event"] == "step_done" for e in done.events()) == STEPS  # none run again
    _same_model(out / "model.pt", reference.out / "model.pt")


def test_bamboo_train_with_resume_auto_finishes_it_too(reference: Result, tmp_path: Path) -> None:
    out = _without_its_end(reference, tmp_path / "api")
    code = ("import json, sys, bamboo\n"
            "r = bamboo.train(bamboo.Job(model=sys.argv[1], nodes=2, stages=2, steps=4, "
            "out=sys.argv[2], resume='auto'))\n"
            "print(json.dumps({'losses': r.losses, 'sha': r.param_sha256, "
            "'redone': r.redone_steps, 'from': r.resumed_from_step}))\n")
    done = subprocess.run([sys.executable, "-c", code, MODEL, str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"losses": reference.summary["losses"],
                   "sha": reference.summary["param_sha256"], "redone": 0, "from": STEPS}
    _assert_equal(strict_loads((out / "summary.json").read_text(), "summary.json"), reference)
    _same_model(out / "model.pt", reference.out / "model.pt")


def _kill_at_last_checkpoint(argv: list[str], out: Path) -> bool:
    """Start `bamboo ARGV`, SIGKILL it the moment its last step's checkpoint is published
    (a `checkpoint` event of step STEPS); whether the kill came before its summary.json."""
    proc = subprocess.Popen(BAMBOO + argv, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if any(e["event"] == "checkpoint" and e["step"] == STEPS for e in run_events(out)):
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    time.sleep(0.5)  # its workers die with it (parent-death signal)
    return proc.returncode == -signal.SIGKILL and not (out / "summary.json").exists()


def test_a_coordinator_killed_after_the_last_checkpoint_finishes_with_the_same_command(
        reference: Result, tmp_path: Path) -> None:
    """The window (final layers written and read back, model.pt, summary.json) lasts about
    0.1 s here; each try is a fresh run directory, and one in three must land in it."""
    for attempt in range(3):
        out = tmp_path / f"run{attempt}"
        argv = ["train", *JOB, "--json", "--resume", "auto", "--out", str(out)]
        if _kill_at_last_checkpoint(argv, out):
            break
    else:
        pytest.fail("three kills in a row came after summary.json was written")
    assert not (out / "model.pt").exists()
    again = run_bamboo(argv[:-2], out)
    assert again.code == 0, again.stderr
    _assert_equal(json.loads(again.stdout), reference)
    assert json.loads(again.stdout)["resumed_from_step"] == STEPS
    _same_model(out / "model.pt", reference.out / "model.pt")


def test_soak_judges_a_coordinator_killed_at_the_end_of_the_run_equal(tmp_path: Path) -> None:
    """`bamboo soak --json` of the noisy model (its failure-free run's stdout must parse)
    with one coordinator kill, drawn at the run's end (the seed picked for that)."""
    seed = next(s for s in range(100) if draw(s, 0, ["coordinator"], STEPS)[0].at_end)
    proc = subprocess.run(BAMBOO + ["soak", *JOB[:-2], "--trials", "1", "--faults",
                                    "coordinator", "--seed", str(seed), "--out",
                                    str(tmp_path / "soak"), "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=250)
    assert proc.returncode == 0, proc.stderr
    assert "internal error" not in proc.stderr
    result = json.loads(proc.stdout)
    assert (result["trials"], result["equal"]) == (1, 1), proc.stderr
    faults = result["cases"][0]["faults"]
    assert faults == [{"kind": "coordinator", "after_step": faults[0]["after_step"],
                       "at": "end"}], faults


def test_a_full_disk_stops_at_the_first_failed_checkpoint_and_resumes_from_the_newest(
        reference: Result, tmp_path: Path) -> None:
    """--checkpoint-dir on a 420 kB tmpfs, a checkpoint every step (each takes about 280 kB
    there): one fits, the next cannot be written."""
    out, disk = tmp_path / "run", tmp_path / "disk"
    argv = ["train", *JOB, "--json", "--checkpoint-every", "1", "--checkpoint-dir", str(disk)]
    with mounted_tmpfs(disk, "size=420k"):
        full = run_bamboo(argv, out)
        assert full.code == 1, full.stderr
        last = full.stderr.strip().splitlines()[-1]
        assert "Traceback" not in full.stderr
        failed = [e for e in full.events() if e["event"] == "checkpoint_failed"]
        assert len(failed) == 1, failed
        step = failed[0]["step"]
        assert step >= 2
        assert last.startswith(f"bamboo train: error: checkpoint of step {step} not saved: "
                               f"could not write ")
        assert f"{disk}/step-{step:08d}: No space left on device (" in last
        assert " free there); stopped the run" in last
        assert last.endswith(f"the newest whole checkpoint is step {step - 1} "
                             f"({disk}/step-{step - 1:08d}): the run resumes from it once "
                             f"there is room")
        summary = json.loads(full.stdout)
        assert summary["status"] == "failed" and f"bamboo train: error: {summary['error']}" == last
        assert summary["steps_completed"] < STEPS
        assert sorted(p.name for p in disk.glob("step-*")) == [f"step-{step - 1:08d}"]
        subprocess.run(["mount", "-o", "remount,size=2m", str(disk)], check=True, timeout=30)
        resumed = run_bamboo([*argv, "--resume", "auto"], out)
        assert resumed.code == 0, resumed.stderr
        summary = json.loads(resumed.stdout)
        assert summary["resumed_from_step"] == step - 1
        _assert_equal(summary, reference)
    assert not os.path.ismount(disk)
