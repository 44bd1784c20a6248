"""`bamboo soak [train flags...] --trials N`: run the user's job failure-free, then N times with
random faults sent from outside, and compare (`bamboo.chaos.soak` runs the trials).

    bamboo soak --nodes 4 --stages 2 --steps 6 --trials 5 --faults kill,stop --json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bamboo.chaos.soak import FAULT_KINDS, soak
from bamboo.cli.parsing import UsageParser
from bamboo.util import strict_json

__all__ = ["main", "soak_parser"]


def soak_parser() -> argparse.ArgumentParser:
    """The soak's own flags; every other flag is the job's (`bamboo train`'s)."""
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


def _table(result: dict[str, Any]) -> str:
    rows = [f"trials {result['trials']}: equal {result['equal']}, clear stop "
            f"{result['clear_stop']}, hang {result['hang']}, wrong {result['wrong']}"]
    for case in result["cases"]:
        rows.append(f"  trial {case['index']} {case['outcome']}: {case['why']}"
                    + (f"\n    {case['command']}" if case["outcome"] != "equal" else ""))
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    """`bamboo soak`: 0 when every trial was equal or a clear stop, 1 otherwise, 2 for bad flags."""
    p = soak_parser()
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
    result = soak(train, kinds, trials=args.trials, seed=args.seed, out=args.out,
                  trial_timeout=args.trial_timeout, only_trial=args.trial, quiet=args.json)
    print(_table(result), file=sys.stderr)
    if args.json:
        print(strict_json.dumps(result, indent=2))
    return 0 if result["hang"] == 0 and result["wrong"] == 0 else 1
