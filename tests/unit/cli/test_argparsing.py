"""Every bamboo command parses its flags with the one parser of bamboo.cli.parsing: a usage
error is the same single line and exit status everywhere, and no command imports another's
module to get it.

Its tests that start processes: tests/integration/test_argparsing_runs.py."""
from __future__ import annotations

import ast

import pytest

from bamboo.cli.parsing import EXIT_USAGE, UsageParser
from support.procs import REPO

REQUIRED = {"train": [], "simulate": ["--trace", "x.csv"], "report": ["some-run"],
            "profile": [], "config": [], "agent": ["--join", "127.0.0.1:1"]}
"""Each command's required arguments, so that the unknown flag is the only error."""


@pytest.mark.parametrize("command", REQUIRED)
def test_an_unknown_flag_is_one_line_and_exit_2_for_every_command(command: str,
                                                                  capsys) -> None:
    from bamboo.cli import main
    with pytest.raises(SystemExit) as info:
        main([command, *REQUIRED[command], "--bogus-flag"])
    assert info.value.code == EXIT_USAGE == 2
    assert capsys.readouterr().err == (f"bamboo {command}: error: unrecognized arguments: "
                                       f"--bogus-flag (see bamboo {command} --help)\n")


@pytest.mark.parametrize("command, flag", [("train", "--nodes"), ("simulate", "--runs"),
                                           ("report", "--quiet"), ("profile", "--model"),
                                           ("agent", "--workers")])
def test_an_abbreviated_flag_is_refused_for_every_command(command: str, flag: str,
                                                          capsys) -> None:
    """`--node 4` once ran a whole default job as `--nodes 4`: a prefix is never taken
    (`bamboo config` has only subcommands, no flag of its own to abbreviate)."""
    from bamboo.cli import main
    with pytest.raises(SystemExit) as info:
        main([command, *REQUIRED[command], flag[:-1], "4"])
    assert info.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"unrecognized arguments: {flag[:-1]} 4" in err, err
    assert f"did you mean {flag}" in err, err


@pytest.mark.parametrize("given, meant", [("--node", "--nodes"), ("--stage", "--stages"),
                                          ("--stepz", "--steps"),
                                          ("--micro-batch", "--micro-batch-size or --micro-batches")])
def test_train_names_the_flag_that_was_meant(given: str, meant: str, capsys) -> None:
    from bamboo.cli import main
    with pytest.raises(SystemExit):
        main(["train", given, "4"])
    err = capsys.readouterr().err
    assert err == (f"bamboo train: error: unrecognized arguments: {given} 4; did you mean "
                   f"{meant}? (see bamboo train --help)\n")


def test_the_parsers_are_the_shared_class() -> None:
    from bamboo.cli.report import report_parser
    from bamboo.cli.simulate import build_parser
    from bamboo.cli.train import train_parser
    for parser in (train_parser(), report_parser(), build_parser()):
        assert type(parser) is UsageParser


def test_no_other_module_subclasses_argument_parser() -> None:
    found = []
    for path in sorted((REPO / "src" / "bamboo").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                    "ArgumentParser" in ast.unparse(base) for base in node.bases):
                found.append(f"{path.relative_to(REPO)} {node.name}")
    assert found == ["src/bamboo/cli/parsing.py UsageParser"]
