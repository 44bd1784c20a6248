"""The chaos test on the user's own job: `soak`, the library behind `bamboo soak` (whose
flags `bamboo.cli.soak` reads).

    bamboo soak [--config FILE] [train flags...] --trials N
                [--faults kill,stop,notice,coordinator,burst] [--seed S] [--out DIR] [--json]

It runs the job once failure-free, then N times with faults drawn from the seed and sent
from outside, as a cloud would (never through the job's own fault injection):

    kill         SIGKILL of a live worker at a random moment of a random step
    stop         SIGSTOP of a live worker (a frozen VM): the lease must fence it
    notice       SIGTERM of a live worker (a preemption notice): it drains
    burst        SIGKILL of 2-4 live workers within one step
    coordinator  SIGKILL of the coordinator after a checkpoint, or (half the time) at the
                 run's end, the moment its last step's checkpoint is published (before or
                 after its summary is written); then the same command with `--resume auto`
                 (the job gets `--checkpoint-every 2` if it has none)

Each trial is compared with the failure-free run by the contract's rule (`bamboo.chaos.bits`):
**equal** (exit 0, losses within 1e-5 relative, `param_l2` within 1e-6, `param_sha256` equal
where every step kept the layout and the order of its sums, or under `--exact`, every loss
counted once), **clear_stop** (a nonzero exit with one line, e.g. every node killed),
**hang** (past the per-trial timeout), **wrong** (anything else). A table goes to stderr,
with a command line that reproduces every trial that was not equal: `bamboo train ... --kill
D:S@K[+notice]` where the fault maps onto one (a kill or notice of a node that held a
stage), else `bamboo soak ... --seed S --trial I` (this trial alone); `--json` prints the
contract's object on stdout. Exit code 0 when every trial was equal or a clear stop.
"""
from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bamboo.run.bits import differs, explain
from bamboo.run.runlog import read_events

__all__ = ["soak", "FAULT_KINDS", "Trial", "Draw", "draw", "judge", "rerun_command"]

log = logging.getLogger(__name__)

FAULT_KINDS = ("kill", "stop", "notice", "coordinator", "burst")


@dataclass(frozen=True)
class Draw:
    """What a trial's seed decides: the fault's kind and when it is sent."""

    kind: str
    at_step: int
    """Sent once this many steps are done..."""
    delay: float
    """...and this many seconds more."""
    at_end: bool
    """`coordinator` only: sent instead when the last step's checkpoint is published."""


def draw(seed: int, index: int, kinds: list[str], steps: int) -> tuple[Draw, random.Random]:
    """Trial `index`'s draws from the soak's `seed` (the same on every run), and the random
    source its later choices (which workers) draw from."""
    rng = random.Random(seed * 100_003 + index)
    kind = rng.choice(kinds)
    at_step = rng.randint(1, max(1, steps - 2))
    delay = rng.uniform(0.0, 0.5)
    at_end = kind == "coordinator" and rng.random() < 0.5
    return Draw(kind, at_step, delay, at_end), rng


@dataclass
class Trial:
    index: int
    faults: list[dict[str, Any]] = field(default_factory=list)
    command: str = ""
    outcome: str = "wrong"
    why: str = ""
    wall_s: float = 0.0


def rerun_command(train: list[str], trial: Trial, kinds: list[str], seed: int) -> str:
    """A command line that reproduces `trial`: the job with a `--kill D:S@K[+notice]` per
    fault where every fault maps onto one (a kill or notice of a node holding stage S of
    pipeline D in step K), else this soak's trial alone (its seed and index)."""
    kills = []
    for f in trial.faults:
        if f.get("kind") not in ("kill", "burst", "notice") or f.get("pipeline") is None \
                or f.get("stage") is None or f.get("step") is None:
            kills = []
            break
        notice = "+notice" if f["kind"] == "notice" else ""
        spec = f"{f['pipeline']}:{f['stage']}@{f['step']}{notice}"
        if spec in kills:  # one holder named twice: no --kill list says what happened
            kills = []
            break
        kills += ["--kill", spec]
    if kills:
        return " ".join(["bamboo", "train", *train, *kills])
    return " ".join(["bamboo", "soak", *train, "--faults", ",".join(kinds), "--seed", str(seed),
                     "--trial", str(trial.index)])


class _Run:
    """One `bamboo train` process of a trial, and what it wrote."""

    def __init__(self, argv: list[str], out: Path) -> None:
        self.argv, self.out = argv, out
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)

    def events(self) -> list[dict]:
        try:
            return read_events(self.out / "events.jsonl")
        except Exception:  # noqa: BLE001 - not there yet, or a line being written
            return []

    def live_workers(self) -> list[tuple[str, int]]:
        events = self.events()
        gone = {e["node"] for e in events if e["event"] in ("node_lost", "fenced", "preempt")}
        return [(e["node"], e["pid"]) for e in events if e["event"] == "node_up"
                and e["node"] not in gone and e.get("pid")]

    def role_of(self, node: str) -> tuple[int | None, int | None]:
        """(pipeline, stage) node `node` held last, by its node_up and role events (a shadow
        holding two stages: its own, the first)."""
        role: tuple[int | None, int | None] = (None, None)
        for e in self.events():
            if e.get("node") == node and e["event"] in ("node_up", "role"):
                role = (e.get("pipeline"), e.get("stage"))
        return role

    def steps_done(self) -> int:
        return sum(1 for e in self.events() if e["event"] == "step_done")

    def at_end(self, steps: int) -> bool:
        """The last step's checkpoint is published, or the run is done."""
        return any(e["event"] == "run_done" or (e["event"] == "checkpoint" and
                                                 e.get("step") == steps) for e in self.events())

    def wait(self, deadline: float) -> tuple[int | None, str, str]:
        try:
            out, err = self.proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            return self.proc.returncode, out, err
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, err = self.proc.communicate()
            return None, out, err


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _wait_for_moment(run: _Run, d: Draw, steps: int, deadline: float) -> None:
    """Until the drawn moment (or the run's exit, or the deadline)."""
    while run.proc.poll() is None and time.monotonic() < deadline:
        if d.at_end:
            if run.at_end(steps):
                return
            time.sleep(0.005)  # the end's window is a fraction of a second
            continue
        if run.steps_done() >= d.at_step:
            time.sleep(d.delay)
            return
        time.sleep(0.02)


def _run_trial(trial: Trial, d: Draw, rng: random.Random, train: list[str], out: Path,
               steps: int, timeout_s: float) -> tuple[int | None, str, str]:
    kind = d.kind
    argv = [sys.executable, "-m", "bamboo", "train", *train, "--out", str(out), "--json",
            "--quiet", "--no-report"]
    if kind == "coordinator":
        argv += ["--resume", "auto"]
        if "--checkpoint-every" not in train:
            argv += ["--checkpoint-every", "2"]
    deadline = time.monotonic() + timeout_s
    run = _Run(argv, out)
    _wait_for_moment(run, d, steps, deadline)
    live = run.live_workers()
    if run.proc.poll() is None and (live or d.at_end):
        if kind == "coordinator":
            _signal(run.proc.pid, signal.SIGKILL)
            trial.faults.append({"kind": kind, "after_step": run.steps_done()}
                                | ({"at": "end"} if d.at_end else {}))
            run.wait(deadline)
            time.sleep(1.0)  # its workers die with it (parent-death signal)
            run = _Run(argv, out)
        else:
            count = rng.randint(2, min(4, len(live))) if kind == "burst" else 1
            sig = {"kill": signal.SIGKILL, "burst": signal.SIGKILL, "stop": signal.SIGSTOP,
                   "notice": signal.SIGTERM}[kind]
            step = run.steps_done()  # the step under way
            chosen = rng.sample(live, min(count, len(live)))
            # Roles as they are before the first signal: a burst's later victims would
            # otherwise read the shadow roles its first ones caused.
            roles = {node: run.role_of(node) for node, _ in chosen}
            for node, pid in chosen:
                pipeline, stage = roles[node]
                if _signal(pid, sig):
                    trial.faults.append({"kind": kind, "node": node, "after_step": d.at_step,
                                         "pipeline": pipeline, "stage": stage,
                                         "step": step if step < steps else None})
    return run.wait(deadline)


def judge(trial: Trial, base: dict, code: int | None, stdout: str, stderr: str) -> None:
    """Set the trial's outcome and why from its last command's exit code, stdout (its
    `--json` summary) and stderr, against the failure-free run's summary `base`."""
    if code is None:
        trial.outcome, trial.why = "hang", "still running at the trial timeout"
        return
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    if code != 0:
        one_line = len(lines) == 1 and "Traceback" not in stderr
        trial.outcome = "clear_stop" if one_line else "wrong"
        trial.why = lines[-1] if lines else f"exit code {code} and no message"
        return
    try:
        summary = json.loads(stdout)
    except ValueError as e:
        trial.outcome = "wrong"
        trial.why = (f"exit code 0 but its stdout is not the summary ({e}): "
                     f"{stdout.strip()[:80]!r}")
        return
    trial.why = differs(base, summary)
    trial.outcome = "wrong" if trial.why else "equal"
    if not trial.why:
        trial.why = explain(base, summary)


def soak(train: list[str], kinds: list[str], trials: int = 10, seed: int = 0,
         out: str | None = None, trial_timeout: float = 300.0, only_trial: int | None = None,
         quiet: bool = False) -> dict[str, Any]:
    """Run the job `train` (`bamboo train`'s flags) failure-free, then `trials` times (or only
    trial `only_trial`) with faults of `kinds` drawn from `seed`; the contract's result object
    (`trials`, the four outcome counts, `out` and `cases`). Progress lines are logged (INFO,
    `bamboo.chaos.soak`) unless `quiet`."""
    out_dir = Path(out or f"runs/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=False)
    say = (lambda text: None) if quiet else (lambda text: log.info("%s", text))
    say(f"soak: the failure-free run ({' '.join(train)})")
    base_run = _Run([sys.executable, "-m", "bamboo", "train", *train, "--out",
                     str(out_dir / "failure-free"), "--json", "--quiet", "--no-report"],
                    out_dir / "failure-free")
    code, stdout, stderr = base_run.wait(time.monotonic() + trial_timeout)
    if code != 0:
        raise SystemExit(f"bamboo soak: error: the failure-free run did not complete: "
                         f"{(stderr.strip().splitlines() or ['no message'])[-1]}")
    try:
        base = json.loads(stdout)
    except ValueError as e:
        raise SystemExit(f"bamboo soak: error: the failure-free run's stdout is not its "
                         f"summary ({e}): {stdout.strip()[:80]!r}") from None
    steps = base["steps_completed"]
    done = []
    for i in range(trials) if only_trial is None else [only_trial]:
        d, rng = draw(seed, i, kinds, steps)
        kind = d.kind
        trial = Trial(index=i)
        start = time.monotonic()
        code, stdout, stderr = _run_trial(trial, d, rng, train, out_dir / f"trial-{i:03d}",
                                          steps, trial_timeout)
        trial.wall_s = round(time.monotonic() - start, 1)
        if not trial.faults:
            trial.faults.append({"kind": kind, "note": "the run ended before the fault"})
        trial.command = rerun_command(train, trial, kinds, seed)
        judge(trial, base, code, stdout, stderr)
        say(f"  trial {i}: {kind:<11} {trial.outcome:<10} {trial.wall_s:6.1f} s  {trial.why}")
        done.append(trial)
    counts = {k: sum(t.outcome == k for t in done) for k in ("equal", "clear_stop", "hang",
                                                            "wrong")}
    return {"trials": len(done), **counts, "out": str(out_dir),
            "cases": [asdict(t) for t in done]}
