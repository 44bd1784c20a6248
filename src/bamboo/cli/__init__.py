"""The `bamboo` command: one module per command in this package, each a thin layer over
the library that reads the command's flags and calls it (`bamboo.cli.<command>.main`).

    bamboo train --nodes 4 --stages 4 --steps 50          # a local 4-stage pipeline
    bamboo train --nodes 8 --stages 4 --json              # 2 pipelines, summary on stdout
    bamboo simulate --trace traces/p3.csv --json          # project a spot trace

A command's module is imported only when it runs, and validates its arguments before it
imports torch.
"""
from __future__ import annotations

import errno
import importlib
import os
import signal
import sys
from collections.abc import Callable

from bamboo.cli.logs import to_stderr
from bamboo.cli.parsing import EXIT_USAGE

__all__ = ["main", "COMMANDS"]

COMMANDS: dict[str, str] = {
    "train": "bamboo.cli.train", "simulate": "bamboo.cli.simulate", "report": "bamboo.cli.report",
    "config": "bamboo.cli.config", "profile": "bamboo.cli.profile",
    "coordinator": "bamboo.cli.coordinator", "agent": "bamboo.cli.agent", "lab": "bamboo.cli.lab",
    "data": "bamboo.cli.data", "export": "bamboo.cli.export", "soak": "bamboo.cli.soak",
    "timeline": "bamboo.cli.timeline",
}
"""Command -> the module whose `main(argv) -> int` runs it."""


def _command(name: str) -> Callable[[list[str]], int]:
    return importlib.import_module(COMMANDS[name]).main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: bamboo {train,coordinator,agent,lab,data,soak,simulate,report,config,"
              "profile,timeline,export} ...\n\n"
              "  train        train a model on a local cluster of worker processes\n"
              "  coordinator  run a job whose nodes are agents on other machines\n"
              "  agent        run one machine's workers for a coordinator (--join)\n"
              "  lab          a coordinator and agents on hosts made of network namespaces\n"
              "  data         tokenize text files for --data (data prepare FILE... --out DIR)\n"
              "  soak         run your job with random faults from outside, and compare\n"
              "  simulate     project throughput and cost of a spot trace\n"
              "  report       write the text summary and plots of a run directory\n"
              "  profile      measure a model's step costs here for `simulate --costs`\n"
              "  timeline     model one step's timeline with and without redundancy\n"
              "  export       write a finished run's model as a Hugging Face directory\n"
              "  config       print an example job file (--example)", file=sys.stderr)
        return 0 if argv else EXIT_USAGE
    if argv[0] not in COMMANDS:
        print(f"bamboo: error: unknown command '{argv[0]}'; choose one of: "
              f"{', '.join(COMMANDS)}", file=sys.stderr)
        return EXIT_USAGE
    debug = "--debug" in argv
    with to_stderr(debug):  # the library's warnings and notes, as this command's lines
        return _run(argv, debug)


def _run(argv: list[str], debug: bool) -> int:
    """Run the command `argv[0]`: its exit status; an error nobody handled is one line
    (raised instead with `debug`)."""
    try:
        return _command(argv[0])(argv[1:])
    except KeyboardInterrupt:
        print("bamboo: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `bamboo ... | head`: the reader left; say nothing, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except Exception as e:  # the one place an unexpected error becomes a single line
        if debug:
            raise
        print(f"bamboo: {_unexpected(e, argv[0])} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1


def _unexpected(e: BaseException, command: str) -> str:
    """One line for an exception nobody handled: its type always, its message's first line
    when it has one, and what to do for the ones a user can act on."""
    kind = type(e).__name__
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    if isinstance(e, MemoryError) or kind == "OutOfMemoryError":  # torch.cuda's is a RuntimeError
        what = f"{kind}: {text[:200]}" if text else kind
        hint = ("reduce --micro-batch-size or the model size, or spread it over more --stages"
                if command in ("train", "coordinator", "profile") else
                "free memory or give it a smaller input")
        return f"out of memory ({what}): {hint}"
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        where = f": {e.filename}" if e.filename else ""
        return f"no space left on device ({kind}{where}): free some space or write elsewhere"
    if not text:
        return f"internal error: {kind} (it carries no message)"
    return f"internal error: {kind}: {text}"
