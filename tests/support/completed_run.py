"""A `bamboo.train` job that starts no worker, for tests of what Bamboo says: its trace has a
row out of time order (a warning) and `resume="auto"` finds its run already complete (a
note)."""
from __future__ import annotations

from pathlib import Path

TRACE = "0,add,n0\n0,add,n1\n60,remove,n1\n30,add,n2\n"
"""Two adds for `nodes=2`, and one row (the last) out of time order."""


def completed_run(where: Path) -> tuple[Path, Path]:
    """The trace, and a run directory whose 2-step run already completed."""
    trace, run = where / "trace.csv", where / "run"
    trace.write_text(TRACE)
    run.mkdir()
    (run / "summary.json").write_text('{"status": "completed", "steps_completed": 2, '
                                      '"losses": [5.0, 4.0], "config": {}}')
    return trace, run


def said_lines(prog: str, trace: Path, run: Path, steps: str, out: str) -> list[str]:
    """What the call or command `prog` says of that job, in its own words."""
    return [f"{prog}: warning: {trace}: 1 row(s) out of time order were sorted",
            f"{prog}: the run in {run} already completed 2 steps; nothing to do (pass more "
            f"{steps}, or another {out} for a new run)"]
