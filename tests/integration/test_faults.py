"""Faults without redundancy: a software error or a lost node stops the run at once,
with the cause shown, and leaves no process behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support.processes import start_training, wait_for_steps, wait_gone
from support.procs import BAMBOO, REPO, mounted_tmpfs, run_bamboo, run_events
from support.runs import assert_close, config, reference, run_in_process


def worker_pids(result) -> list[int]:
    return [e["pid"] for e in result.events() if e["event"] == "node_up"]


@pytest.mark.timeout(120)
def test_software_error_stops_the_run_with_that_error(bamboo) -> None:
    result = bamboo(["--steps", "6", "--crash", "0:2@3", "--quiet"])
    assert result.code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0] == ("bamboo train: error: worker n2 (pipeline 0, stage 2) failed in step 3: "
                        "InjectedError: injected software error at step 3")
    events = result.events()
    failed = next(e for e in events if e["event"] == "run_failed")
    last_step = max(e["t"] for e in events if e["event"] == "step_done")
    assert failed["t"] - last_step < 5.0  # stopped within seconds, not a comm timeout
    summary = result.summary
    assert summary["status"] == "failed" and summary["steps_completed"] == 3
    assert wait_gone(worker_pids(result)) == []


@pytest.mark.timeout(120)
def test_debug_shows_the_workers_traceback(bamboo) -> None:
    result = bamboo(["--steps", "3", "--crash", "0:0@1", "--quiet", "--debug"])
    assert result.code == 1
    assert "Traceback" in result.stderr and "InjectedError" in result.stderr


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_lost_node_without_redundancy_restarts_from_the_initial_state(tmp_path: Path) -> None:
    """No copy, checkpoints off: the run goes back to its seeded start instead of stopping,
    and ends equal to the failure-free run (the launcher in this process, kept warm)."""
    cfg = config(steps=6, redundancy="off", checkpoint_every=0)  # what every clean run ends with
    s = run_in_process(config(steps=6, redundancy="off", checkpoint_every=0, kills=["0:1@2"]),
                       tmp_path / "killed")
    assert s["status"] == "completed", s["error"]
    assert (s["checkpoint_restores"], s["redone_steps"], s["failovers"]) == (1, 2, 0)
    losses, _ = reference(cfg.training.steps, cfg.global_micro_batches, cfg.layout.micro_batch_size)
    assert_close(s["losses"], losses, rel=1e-4)
    events = run_events(tmp_path / "killed")
    lost = [e for e in events if e["event"] == "node_lost"]
    assert [(e["node"], e["step"], e["handled_as"]) for e in lost] == [
        ("n1", 2, "checkpoint_restore")]
    assert wait_gone([e["pid"] for e in events if e["event"] == "node_up"]) == []


@pytest.mark.procs
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_launcher_stops_everything(tmp_path: Path, signum: int) -> None:
    out = tmp_path / "run"
    proc = start_training(out)
    wait_for_steps(out, proc)
    pids = [e["pid"] for e in run_events(out) if e["event"] == "node_up"]
    sent = time.monotonic()
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 10
    assert proc.returncode == 128 + signum
    name = signal.Signals(signum).name
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"stopped by {name} with " in errors[0], stderr
    assert "add --resume auto" in errors[0] or "--resume auto to continue" in errors[0]
    assert wait_gone(pids) == []


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_a_stop_sent_to_the_whole_group_is_the_users_and_resumes_equal(tmp_path: Path) -> None:
    """`timeout` and a terminal's Ctrl-C signal the launcher's whole process group. That is
    the user stopping the run, not a notice to every worker: it is said once, a resume point
    is written at the next boundary, and `--resume auto` (the same command otherwise) goes on
    from it with nothing redone and ends equal to the run that was never stopped."""
    args = ["--nodes", "2", "--stages", "2", "--steps", "20", "--no-report", "--json"]
    out = tmp_path / "run"
    proc = subprocess.Popen([*BAMBOO, "train", *args, "--out", str(out)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not any(e["event"] == "step_done" and e["step"] >= 4 for e in run_events(out)):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "preemption notice" not in stderr and stderr.count("stopping on SIGTERM") == 1, stderr
    events = run_events(out)
    assert [e for e in events if e["event"] in ("notice", "node_lost")] == []
    done = [e for e in events if e["event"] == "checkpoint"][-1]["step"]
    assert f"stopped by SIGTERM with {done} steps done" in stderr and done < 20, stderr
    resumed = subprocess.run([*BAMBOO, "train", *args, "--out", str(out), "--resume", "auto"],
                             cwd=REPO, capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from step {done}" in resumed.stderr
    clean = subprocess.run([*BAMBOO, "train", *args, "--out", str(tmp_path / "clean")],
                           cwd=REPO, capture_output=True, text=True, timeout=180)
    assert clean.returncode == 0, clean.stderr
    got, want = json.loads(resumed.stdout), json.loads(clean.stdout)
    assert got["redone_steps"] == 0 and got["resumed_from_step"] == done
    assert got["losses"] == want["losses"] and got["param_sha256"] == want["param_sha256"]


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_workers_die_with_a_killed_launcher(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = start_training(out)
    wait_for_steps(out, proc)
    pids = [e["pid"] for e in run_events(out) if e["event"] == "node_up"]
    proc.kill()
    proc.communicate(timeout=30)
    assert wait_gone(pids, timeout=15) == []


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_a_worker_killed_from_outside_is_a_lost_node(tmp_path: Path) -> None:
    """A `kill -9` nobody in bamboo sent: the node is lost, accounted, and covered (with
    --redundancy off, by going back to the initial state); the run trains on."""
    out = tmp_path / "run"
    proc = start_training(out, "--redundancy", "off")
    wait_for_steps(out, proc)
    victim = next(e for e in run_events(out) if e["event"] == "node_up" and e["node"] == "n2")
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not any(e["event"] == "generation_ready" and e.get("gen") == 1
                  for e in run_events(out)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    lost = [e for e in run_events(out) if e["event"] == "node_lost"]
    assert [(e["node"], e["handled_as"], e["signal"]) for e in lost] == [
        ("n2", "checkpoint_restore", "SIGKILL")]


@pytest.mark.timeout(180)
def test_a_full_disk_at_the_end_is_one_line_with_the_summary(tmp_path: Path, bamboo) -> None:
    """model.pt does not fit: one line naming it, exit 1, the summary still on stdout with
    --json, and no temporary file left behind. (No checkpoints: the first one would not fit
    either, and a failed checkpoint stops the run before its end.)"""
    with mounted_tmpfs(tmp_path / "disk", "size=600k") as disk:
        out = disk / "run"
        result = run_bamboo(["train", "--steps", "3", "--quiet", "--json", "--no-report",
                             "--checkpoint-every", "0"], out)
        assert result.code == 1, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "model.pt" in lines[0] and "No space left" in lines[0], lines
        assert "internal error" not in result.stderr and "Traceback" not in result.stderr
        summary = json.loads(result.stdout)
        assert summary["status"] == "failed" and summary["steps_completed"] == 3
        assert [p.name for p in out.iterdir() if "tmp" in p.name] == []


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_a_worker_killed_as_the_last_one_starts_is_covered(tmp_path: Path) -> None:
    """Killed while generation 0 forms (nothing trained yet): the seven others train on
    from the seeded start and end equal to the failure-free run."""
    out = tmp_path / "run"
    proc = subprocess.Popen([*BAMBOO, "train", "--nodes", "8", "--stages", "4", "--steps", "3",
                             "--quiet", "--json", "--no-report", "--out", str(out)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (up := [e for e in run_events(out) if e["event"] == "node_up"
                      and e["node"] == "n7"]):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    pid = up[0]["pid"]
    os.kill(pid, signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    summary = json.loads(stdout)
    assert summary["steps_completed"] == 3 and summary["preemptions"] == 1
    losses, l2 = reference(3, 8, 8)
    assert_close(summary["losses"], losses, rel=1e-4)
    assert_close(summary["param_l2"], l2, rel=1e-4)


@pytest.mark.timeout(180)
def test_a_disk_that_fills_with_checkpoints_leaves_no_temporary(tmp_path: Path, bamboo) -> None:
    """A 2 MB --out: checkpoints and the final layers fill it. The run ends with one line
    and its summary, and no write of any worker leaves a temporary behind."""
    with mounted_tmpfs(tmp_path / "disk", "size=2m") as disk:
        out = disk / "run"
        result = run_bamboo(["train", "--steps", "12", "--checkpoint-every", "4", "--quiet",
                             "--json", "--no-report"], out)
        assert result.code != 0, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "no space left" in lines[0].lower(), lines
        left = [str(p.relative_to(out)) for p in out.rglob(".*") if ".tmp" in p.name
                or p.name.startswith(".old-")]
        assert left == [], left


@pytest.mark.timeout(240)
def test_every_node_lost_stops_naming_the_resume_point_and_resumes_equal(bamboo) -> None:
    """No node left and none coming is a clear stop (exit 3), and the line says how to go on
    from the checkpoint the run wrote by default; that command ends equal to the run that
    lost nothing."""
    args = ["--nodes", "2", "--stages", "2", "--steps", "8", "--quiet", "--json"]
    lost = bamboo([*args, "--kill", "0:0@4", "--kill", "0:1@4"], "lost")
    assert lost.code == 3, lost.stderr
    errors = [line for line in lost.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "none is coming" in errors[0], lost.stderr
    assert f"its checkpoints are in {lost.out / 'checkpoints'}: run the same command with " \
           f"--resume auto" in errors[0], errors
    resumed = bamboo([*args, "--resume", "auto"], "lost")
    clean = bamboo(args, "clean")
    assert resumed.code == 0 and clean.code == 0, resumed.stderr + clean.stderr
    got, want = resumed.summary, clean.summary
    assert got["resumed_from_step"] in (2, 3, 4) and got["steps_completed"] == 8
    assert got["losses"] == want["losses"] and got["param_sha256"] == want["param_sha256"]
