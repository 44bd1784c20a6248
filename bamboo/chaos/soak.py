"""`bamboo soak`: the chaos test as a command, on the user's own job.

    bamboo soak [--config FILE] [train flags...] --trials N
                [--faults kill,stop,notice,coordinator,burst] [--seed S] [--out DIR] [--json]

It runs the job once failure-free, then N times with faults drawn from the seed and sent
from outside, as a cloud would (never through the job's own fault injection):

    kill         SIGKILL of a live worker at a random moment of a random step
    stop         SIGSTOP of a live worker (a frozen VM): the lease must fence it
    notice       SIGTERM of a live worker (a preemption notice): it drains
    burst        SIGKILL of 2-4 live workers within one step
    coordinator  SIGKILL of the coordinator after a checkpoint, then the same command with
                 `--resume auto` (the job gets `--checkpoint-every 2` if it has none)

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

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bamboo.util import strict_json
from bamboo.cli.parsing import UsageParser
from bamboo.chaos.bits import differs, explain
from bamboo.run.runlog import read_events

__all__ = ["main", "FAULT_KINDS", "Trial", "rerun_command"]

FAULT_KINDS = ("kill", "stop", "notice", "coordinator", "burst")


@dataclass
class Trial:
    index: int
    faults: list[dict[str, Any]] = field(default_factory=list)
    command: str = ""
    outcome: str = "wrong"
    why: str = ""
    wall_s: float = 0.0


def _parser() -> argparse.ArgumentParser:
    p = UsageParser(prog="bamboo soak", description="Run your job failure-free, then N times "
                    "with random faults sent from outside, and compare every trial with it. "
                    "Every other flag is `bamboo train`'s.")
    p.add_argument("--trials", type=int, default=10, help="faulty runs (default 10)")
    p.add_argument("--faults", default="kill,stop,notice,burst",
                   help=f"fault kinds to draw from, comma-separated: {', '.join(FAULT_KINDS)} "
                   f"(default kill,stop,notice,burst)")
    p.add_argument("--seed", type=int, default=0, help="seeds the faults (not the job)")
    p.add_argument("--out", help="where the runs go (default runs/soak-<time>)")
    p.add_argument("--trial-timeout", type=float, default=300.0, metavar="S",
                   help="a trial still running after this is a hang (default 300)")
    p.add_argument("--trial", type=int, metavar="I",
                   help="run trial I of this --seed alone (as a table line suggests)")
    p.add_argument("--json", action="store_true", help="print the result object on stdout")
    return p


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


def _run_trial(trial: Trial, kind: str, rng: random.Random, train: list[str], out: Path,
               steps: int, timeout_s: float) -> tuple[int | None, str, str]:
    argv = [sys.executable, "-m", "bamboo", "train", *train, "--out", str(out), "--json",
            "--quiet", "--no-report"]
    if kind == "coordinator":
        argv += ["--resume", "auto"]
        if "--checkpoint-every" not in train:
            argv += ["--checkpoint-every", "2"]
    deadline = time.monotonic() + timeout_s
    run = _Run(argv, out)
    at_step = rng.randint(1, max(1, steps - 2))
    delay = rng.uniform(0.0, 0.5)
    while run.proc.poll() is None and time.monotonic() < deadline:
        if run.steps_done() >= at_step:
            time.sleep(delay)
            break
        time.sleep(0.02)
    live = run.live_workers()
    if run.proc.poll() is None and live:
        if kind == "coordinator":
            _signal(run.proc.pid, signal.SIGKILL)
            trial.faults.append({"kind": kind, "after_step": at_step})
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
                    trial.faults.append({"kind": kind, "node": node, "after_step": at_step,
                                         "pipeline": pipeline, "stage": stage,
                                         "step": step if step < steps else None})
    return run.wait(deadline)


def _outcome(trial: Trial, base: dict, code: int | None, stdout: str, stderr: str) -> None:
    if code is None:
        trial.outcome, trial.why = "hang", "still running at the trial timeout"
        return
    try:
        summary = json.loads(stdout) if stdout.strip() else {}
    except ValueError:
        summary = {}
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    if code != 0:
        one_line = len(lines) == 1 and "Traceback" not in stderr
        trial.outcome = "clear_stop" if one_line else "wrong"
        trial.why = lines[-1] if lines else f"exit code {code} and no message"
        return
    trial.why = differs(base, summary)
    trial.outcome = "wrong" if trial.why else "equal"
    if not trial.why:
        trial.why = explain(base, summary)


def soak(args: argparse.Namespace, train: list[str]) -> dict[str, Any]:
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    out = Path(args.out or f"runs/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=False)
    say = (lambda text: None) if args.json else (lambda text: print(text, file=sys.stderr))
    say(f"soak: the failure-free run ({' '.join(train)})")
    base_run = _Run([sys.executable, "-m", "bamboo", "train", *train, "--out",
                     str(out / "failure-free"), "--json", "--quiet", "--no-report"],
                    out / "failure-free")
    code, stdout, stderr = base_run.wait(time.monotonic() + args.trial_timeout)
    if code != 0:
        raise SystemExit(f"bamboo soak: error: the failure-free run did not complete: "
                         f"{(stderr.strip().splitlines() or ['no message'])[-1]}")
    base = json.loads(stdout)
    steps = base["steps_completed"]
    trials = []
    for i in range(args.trials) if args.trial is None else [args.trial]:
        rng = random.Random(args.seed * 100_003 + i)
        kind = rng.choice(kinds)
        trial = Trial(index=i)
        start = time.monotonic()
        code, stdout, stderr = _run_trial(trial, kind, rng, train, out / f"trial-{i:03d}",
                                          steps, args.trial_timeout)
        trial.wall_s = round(time.monotonic() - start, 1)
        if not trial.faults:
            trial.faults.append({"kind": kind, "note": "the run ended before the fault"})
        trial.command = rerun_command(train, trial, kinds, args.seed)
        _outcome(trial, base, code, stdout, stderr)
        say(f"  trial {i}: {kind:<11} {trial.outcome:<10} {trial.wall_s:6.1f} s  {trial.why}")
        trials.append(trial)
    counts = {k: sum(t.outcome == k for t in trials) for k in ("equal", "clear_stop", "hang",
                                                              "wrong")}
    return {"trials": len(trials), **counts, "out": str(out),
            "cases": [asdict(t) for t in trials]}


def _table(result: dict[str, Any]) -> str:
    rows = [f"trials {result['trials']}: equal {result['equal']}, clear stop "
            f"{result['clear_stop']}, hang {result['hang']}, wrong {result['wrong']}"]
    for case in result["cases"]:
        rows.append(f"  trial {case['index']} {case['outcome']}: {case['why']}"
                    + (f"\n    {case['command']}" if case["outcome"] != "equal" else ""))
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    p = _parser()
    args, train = p.parse_known_args(argv)
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    bad = [k for k in kinds if k not in FAULT_KINDS]
    if bad or not kinds:
        p.error(f"--faults {args.faults!r}: choose from {', '.join(FAULT_KINDS)}")
    if args.trial is not None and args.trial < 0:
        p.error(f"--trial must be 0 or more (got {args.trial}): a trial's index as the table "
                f"shows it")
    if args.trials < 1:
        p.error(f"--trials must be a positive integer (got {args.trials})")
    if args.out is not None and Path(args.out).exists():
        p.error(f"--out {args.out} exists: choose a new directory for the soak's runs")
    if any(a in ("--out", "--resume", "--json") for a in train):
        p.error("--out, --resume and --json are the soak's own: leave them out of the job")
    result = soak(args, train)
    print(_table(result), file=sys.stderr)
    if args.json:
        print(strict_json.dumps(result, indent=2))
    return 0 if result["hang"] == 0 and result["wrong"] == 0 else 1
