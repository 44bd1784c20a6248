"""The argument parser every `bamboo` command uses: a usage error is one line and exit 2.

Kept apart from `bamboo.cli` (and free of torch and of any other bamboo module) so that
`bamboo train`, `simulate`, `report`, `profile`, `config` and `agent` can all share it
without importing one another:

    bamboo train: error: argument --steps: invalid int value: 'ten' (see bamboo train --help)
"""
from __future__ import annotations

import argparse
import difflib
import re
from typing import Any, NoReturn

__all__ = ["EXIT_USAGE", "UsageParser"]

EXIT_USAGE = 2
"""Exit status of a user error (a bad flag, value or file), as argparse itself uses."""


class UsageParser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line: what is wrong, and where the help is.

    A flag must be given in full: `--node 4` is an error that names `--nodes`, never a
    silent abbreviation of it (argparse's `allow_abbrev`, off here)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        hint = self._did_you_mean(message)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}{hint} (see {self.prog} --help)\n")

    def _did_you_mean(self, message: str) -> str:
        """`; did you mean --nodes?` for the first unknown flag of an "unrecognized
        arguments" message that is a prefix or a near miss of a real flag."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        for word in message.split(":", 1)[1].split():
            flag = word.split("=", 1)[0]
            if not re.fullmatch(r"--[\w-]+", flag):
                continue
            starts = sorted(o for o in known if o.startswith(flag))
            close = starts or difflib.get_close_matches(flag, known, n=3, cutoff=0.75)
            if close:
                return f"; did you mean {' or '.join(close[:3])}?"
        return ""
