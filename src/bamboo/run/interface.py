"""Which interface started a run, and how it tells its user to continue the run.

A message that says what to do next speaks the words of the interface the user typed: the
command line's `--resume auto` and `--out`, the Python API's `resume="auto"` in the Job and
`bamboo.train(job, out=DIR)`. Whoever starts a run names its interface (`bamboo train` and
`bamboo coordinator` the command line, `bamboo.train` the API), and the parts that say such
a thing (the user's stop, the run directory's checks, `--resume auto`) take it from there.
A new way in (`bamboo.Trainer`) is a new member, its value the call the user writes.
"""
from __future__ import annotations

import enum
from pathlib import Path

__all__ = ["Interface"]


class Interface(enum.Enum):
    """The command line, or a Python call (its value: what the user types)."""

    CLI = "bamboo train"
    TRAIN = "bamboo.train"
    TRAINER = "bamboo.Trainer"

    @property
    def resume_auto(self) -> str:
        """How the user asks for `--resume auto`."""
        return "--resume auto" if self is Interface.CLI else 'resume="auto"'

    @property
    def out(self) -> str:
        """How the user names the run directory, before its value (`--out DIR`, `out=DIR`)."""
        return "--out " if self is Interface.CLI else "out="

    def option(self, name: str, value: object) -> str:
        """An option as the user writes it: `--checkpoint-every 0`, `checkpoint_every=0`
        (`name` as the flag has it, without `--`)."""
        if self is Interface.CLI:
            return f"--{name} {value}"
        return f"{name.replace('-', '_')}={value!r}"

    def steps(self) -> str:
        """How the user asks for more steps."""
        return "more --steps" if self is Interface.CLI else "more steps="

    def rerun(self, out: str | Path | None = None) -> str:
        """The clause that tells how to continue the run in `out`: `run the same command with
        --resume auto`, or `call bamboo.train(job, out='DIR') again with resume="auto" in
        the Job`."""
        if self is Interface.CLI:
            return "run the same command with --resume auto"
        where = repr(str(out)) if out is not None else "DIR"
        verb = "make" if self is Interface.TRAINER else "call"
        return f'{verb} {self.value}(job, out={where}) again with resume="auto" in the Job'

    def add_resume(self) -> str:
        """The clause that tells the user to ask for `--resume auto` in what they wrote."""
        return "add --resume auto" if self is Interface.CLI else 'give the Job resume="auto"'
