"""`bamboo.Trainer` in real processes: the user's loop (tests/support/trainer_loop.py: a
step per call, the held-out loss every 3 steps, the rate halved on a plateau, an early stop)
killed in flight and between two calls ends equal to the same loop failure-free; stopped
early, it resumes where it stopped and ends equal to one loop to the end; a loop of
`train_step()` to the end gives what `bamboo.train` gives; Ctrl-C in the loop's own code
leaves a resume point, stops every worker and says how to go on from Python."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bamboo
from bamboo.chaos.bits import differs
from support.trainer_loop import JOB, run_loop

pytestmark = [pytest.mark.procs, pytest.mark.slow]  # every test here starts processes

TESTS = Path(__file__).resolve().parents[1]


def _same(base: object, got: object) -> None:
    """`got` ends as the failure-free `base` by the contract's rule, and the loop did the
    same things: the same evaluations, the same learning-rate scales."""
    assert got.status == "completed", got.summary.get("error")
    assert differs(base.summary, got.summary) == "", differs(base.summary, got.summary)
    assert got.eval_losses == base.eval_losses
    assert got.lr_scales == base.lr_scales


@pytest.mark.timeout(300)
def test_a_loop_killed_in_flight_and_between_calls_ends_as_the_same_loop_failure_free(
        tmp_path: Path) -> None:
    """The loop stops early after 9 of the job's 12 steps. Killed: stage 1 of pipeline 0 in
    step 4 (a failover inside a call), and stage 0 of pipeline 1 after step 6, while the
    loop is between calls (the run takes the new roles on at the next call, the
    evaluation). The same losses, held-out losses, scales and parameters."""
    clean = run_loop(tmp_path / "clean", stop_at=9)
    assert clean.steps_completed == 9 and clean.lr_scales, clean.summary  # the rule acted
    assert [step for step, _ in clean.eval_losses] == [3, 6, 9]
    killed = run_loop(tmp_path / "killed", stop_at=9, kill=["0:1@4"], kill_between=(6, 1, 0))
    _same(clean, killed)
    assert killed.preemptions == 2 and killed.redone_steps == 0, killed.summary
    lost = [json.loads(line) for line in (tmp_path / "killed" / "events.jsonl").open()
            if '"node_lost"' in line]
    assert [e["step"] for e in lost] == [4, 6], lost
    assert (tmp_path / "killed" / "checkpoints" / "step-00000009").is_dir()  # a resume point


@pytest.mark.timeout(300)
def test_a_loop_stopped_early_resumes_where_it_stopped_equal_to_one_loop(tmp_path: Path) -> None:
    """Stopped after 6 steps (its scale lowered on the way), the loop made again with
    `resume="auto"` goes on from step 6 with that scale and the run's history, and ends
    equal to one loop to the end, with nothing redone."""
    whole = run_loop(tmp_path / "whole", stop_at=12)
    first = run_loop(tmp_path / "resumed", stop_at=6)
    assert first.steps_completed == 6 and first.lr_scales
    resumed = run_loop(tmp_path / "resumed", stop_at=12, resume=True)
    assert resumed.resumed_from_step == 6 and resumed.redone_steps == 0
    _same(whole, resumed)
    assert resumed.param_sha256 == whole.param_sha256


@pytest.mark.timeout(300)
def test_a_loop_of_train_steps_gives_what_bamboo_train_gives(tmp_path: Path) -> None:
    job = bamboo.Job(**(JOB | {"steps": 6}))
    trained = bamboo.train(job, out=tmp_path / "train")
    looped = run_loop(tmp_path / "loop", stop_at=6, rule=False)
    assert looped.losses == trained.losses
    assert looped.param_sha256 == trained.param_sha256


@pytest.mark.timeout(300)
def test_ctrl_c_in_the_loop_leaves_a_resume_point_and_says_how_to_go_on(tmp_path: Path) -> None:
    """SIGINT while the loop's own code runs (between two calls): a resume point after the
    steps done, every worker stopped, the one line saying how to continue from Python;
    then the same loop with `resume="auto"` ends equal to a loop never interrupted."""
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]))
    loop = [sys.executable, "-m", "support.trainer_loop", str(out), "--stop-at", "8",
            "--no-rule"]
    proc = subprocess.Popen([*loop, "--sleep-after", "4"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "sleeping").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=150)  # 29 s alone, over 60 s on a loaded machine
    finally:
        proc.kill()
    assert proc.returncode != 0, f"the loop did not stop on SIGINT: {stderr}"
    said = [line for line in stderr.splitlines() if line.startswith("bamboo.Trainer:")]
    assert len(said) == 1 and "stopped by Ctrl-C with 4 steps done" in said[0], stderr
    assert 'resume="auto"' in said[0] and "step-00000004" in said[0], said
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps_completed"] == 4
    pids = [json.loads(line)["pid"] for line in (out / "events.jsonl").open()
            if '"node_up"' in line]
    for pid in pids:  # every worker is gone (or a zombie no one waits for)
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    resumed = subprocess.run([*loop, "--resume"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=200)
    assert resumed.returncode == 0, resumed.stderr
    whole = run_loop(tmp_path / "whole", stop_at=8, rule=False)
    got = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert got == {"losses": whole.losses, "param_sha256": whole.param_sha256}
