"""The argument parser every `bamboo` command uses: a usage error is one line and exit 2.

Kept apart from `bamboo.cli` (and free of torch and of any other bamboo module) so that
`bamboo train`, `simulate`, `report`, `profile`, `config` and `agent` can all share it
without importing one another:

    bamboo train: error: argument --steps: invalid int value: 'ten' (see bamboo train --help)
"""
from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["EXIT_USAGE", "UsageParser"]

EXIT_USAGE = 2
"""Exit status of a user error (a bad flag, value or file), as argparse itself uses."""


class UsageParser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line: what is wrong, and where the help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
