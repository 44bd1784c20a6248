"""A user's script that continues its own run: `bamboo.Job(..., resume="auto")` and
`bamboo.train(job, out=DIR)`, the same code for the first start and every restart. The
script's process (the run's coordinator) is killed from outside with SIGKILL, or stopped
with SIGINT (the user's Ctrl-C, which says how to continue in the API's words, not the
command line's); the same script run again continues from the newest checkpoint in DIR and
ends `bamboo.same` as the failure-free run, bit for bit, its `state_dict()` loading into
the script's own `nn.Sequential` with strict=True."""
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
from support.processes import wait_gone
from support.procs import run_events

pytestmark = [pytest.mark.procs, pytest.mark.slow]  # every test here starts processes

STEPS = 8

SCRIPT = f"""
import json, sys, time
import torch
from torch import nn
import bamboo


class Mix(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


def build(vocab_size: int = 256, context: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Embedding(vocab_size, 8), Mix(8), Mix(8), nn.Linear(8, vocab_size))


def slowly(event: dict) -> None:
    # the first attempt's steps last long enough for the test to stop it between two
    if event["event"] == "step_done":
        time.sleep(0.4)


if __name__ == "__main__":
    job = bamboo.Job(model=build, nodes=2, stages=2, steps={STEPS}, micro_batches=2,
                     micro_batch_size=2, seed=3, checkpoint_every=1, resume="auto")
    try:
        result = bamboo.train(job, out=sys.argv[1],
                              on_event=slowly if "--slowly" in sys.argv else None)
    except bamboo.RunFailed as e:
        print(f"stopped: {{e}}", file=sys.stderr)
        sys.exit(e.exit_code)
    mine = build()
    missing, unexpected = mine.load_state_dict(result.state_dict(), strict=True)
    print(json.dumps({{"resumed_from_step": result.resumed_from_step,
                      "redone_steps": result.redone_steps, "loaded": [missing, unexpected],
                      "weight": mine[3].weight.sum().item()}}))
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("script") / "continue_me.py"
    path.write_text(SCRIPT)
    return path


@pytest.fixture(scope="module")
def failure_free(script: Path, tmp_path_factory: pytest.TempPathFactory) -> bamboo.RunResult:
    """The same script, never stopped: the run every continued one must equal."""
    out = tmp_path_factory.mktemp("clean") / "run"
    done = subprocess.run([sys.executable, str(script), str(out)], cwd=out.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return bamboo.load_result(out)


def start_and_stop(script: Path, out: Path, signum: int) -> tuple[int, str, int]:
    """The script's first attempt, sent `signum` once a checkpoint of step 3 or later is
    published: (its exit code, its stderr, the newest checkpoint's step when it ended)."""
    proc = subprocess.Popen([sys.executable, str(script), str(out), "--slowly"], cwd=out.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not [e for e in run_events(out) if e["event"] == "checkpoint" and e["step"] >= 3]:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        os.kill(proc.pid, signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert wait_gone([e["pid"] for e in run_events(out) if e["event"] == "node_up"]) == []
    newest = max(e["step"] for e in run_events(out) if e["event"] == "checkpoint")
    return proc.returncode, stderr, newest


def continue_run(script: Path, out: Path) -> dict:
    done = subprocess.run([sys.executable, str(script), str(out)], cwd=out.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_same_as(clean: bamboo.RunResult, out: Path, got: dict, newest: int) -> None:
    assert 3 <= got["resumed_from_step"] <= newest < STEPS and got["redone_steps"] == 0, got
    verdict = bamboo.same(clean, out)
    assert verdict and verdict.reason.startswith("bit-equal"), verdict.reason
    assert got["loaded"] == [[], []]
    assert got["weight"] == pytest.approx(clean.state_dict()["3.weight"].sum().item(), rel=1e-6)


@pytest.mark.timeout(300)
def test_a_killed_scripts_run_is_continued_by_the_same_script(
        script: Path, failure_free: bamboo.RunResult, tmp_path: Path) -> None:
    """SIGKILL to the calling process mid-run (its workers die with it); the same script
    continues the run in its `out` from the newest checkpoint."""
    out = tmp_path / "run"
    code, _, newest = start_and_stop(script, out, signal.SIGKILL)
    assert code == -signal.SIGKILL and not (out / "summary.json").exists()
    assert_same_as(failure_free, out, continue_run(script, out), newest)


@pytest.mark.timeout(300)
def test_ctrl_c_from_python_says_how_to_continue_from_python(
        script: Path, failure_free: bamboo.RunResult, tmp_path: Path) -> None:
    """SIGINT to the script: RunFailed's one line names the call that continues the run
    (`bamboo.train(job, out=...)` with `resume="auto"` in the Job), not the command line's
    flag; doing that continues it."""
    out = tmp_path / "run"
    code, stderr, newest = start_and_stop(script, out, signal.SIGINT)
    assert code == 128 + signal.SIGINT, stderr
    line = next(x for x in stderr.splitlines() if x.startswith("stopped: "))
    resolved = out.resolve()
    assert line.startswith(f"stopped: stopped by SIGINT with {newest} steps done; their resume "
                           f"point is "), line
    assert line.endswith(f": call bamboo.train(job, out={str(resolved)!r}) again with "
                         f"resume=\"auto\" in the Job to continue"), line
    assert "--" not in line
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == ("failed", line.removeprefix("stopped: "))
    assert_same_as(failure_free, out, continue_run(script, out), newest)
