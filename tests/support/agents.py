"""A `bamboo coordinator` and its `bamboo agent`s on loopback, started as a user would; an
agent's whole machine (its session: agent, fork server, workers) frozen or killed at once."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from support.processes import session_processes
from support.procs import BAMBOO, REPO, run_events
from support.runs import assert_close, config, reference


def start(args: list[str], session: bool = False) -> subprocess.Popen:
    """`bamboo ARGS` in the background, its output piped; `session`: in a session of its own
    (a machine of its own, for `signal_machine`)."""
    return subprocess.Popen(BAMBOO + args, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=session,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def coordinator(out: Path, port: int, *job: str) -> subprocess.Popen:
    """`bamboo coordinator` of `job` on 127.0.0.1:`port`, writing `out`."""
    return start(["coordinator", "--bind", f"127.0.0.1:{port}", "--out", str(out), "--json",
                  "--quiet", "--no-report", *job])


def agent(out: Path, port: int, *extra: str) -> subprocess.Popen:
    """`bamboo agent` joining the coordinator of `out` with its token file, on a machine
    (session) of its own."""
    return start(["agent", "--join", f"127.0.0.1:{port}", "--token-file",
                  str(out / "join-token"), *extra], session=True)


def wait_for(path: Path, timeout: float = 60) -> None:
    """Until `path` exists."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def wait_step(out: Path, step: int, coord: subprocess.Popen, timeout: float = 150) -> None:
    """Until the run in `out` has done `step` (fails if the coordinator ended before)."""
    deadline = time.monotonic() + timeout
    while not (out / "events.jsonl").exists() or not any(
            e["event"] == "step_done" and e["step"] >= step for e in run_events(out)):
        assert time.monotonic() < deadline and coord.poll() is None, "the run never got there"
        time.sleep(0.2)


def stop(processes: list[subprocess.Popen]) -> None:
    """SIGKILL to each process still running."""
    for p in processes:
        if p.poll() is None:
            p.kill()


def signal_machine(agent_proc: subprocess.Popen, signum: int) -> None:
    """`signum` to every process of the agent's machine: its session (the agent, its fork
    server and workers, in a process group of their own, and the resource tracker)."""
    try:
        sid = os.getsid(agent_proc.pid)
    except ProcessLookupError:
        return
    for pid in session_processes(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def kill_machine(agent_proc: subprocess.Popen) -> None:
    """The agent's whole machine SIGKILLed."""
    signal_machine(agent_proc, signal.SIGKILL)


def assert_failure_free(summary: dict, **layout: int) -> None:
    """The summary's losses and parameters are the failure-free run's (within 1e-4) for a
    job of `layout` (`bamboo train`'s flags)."""
    cfg = config(**layout)
    losses, l2 = reference(cfg.training.steps, cfg.global_micro_batches, cfg.layout.micro_batch_size)
    assert_close(summary["losses"], losses, rel=1e-4)
    assert_close(summary["param_l2"], l2, rel=1e-4)
