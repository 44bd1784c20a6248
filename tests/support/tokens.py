"""Text to tokenize for the tests, and `bamboo data prepare` run in the test's process."""
from __future__ import annotations

from pathlib import Path

import pytest

from bamboo import cli
from support.procs import REPO


def docs_text(tmp_path: Path, names: tuple[str, ...] = ("architecture", "cluster", "models"),
              size: int = 4000) -> list[Path]:
    """A few KB of the repository's own documentation, one file per doc."""
    files = []
    for name in names:
        f = tmp_path / f"{name}.txt"
        f.write_text((REPO / "docs" / f"{name}.md").read_text(encoding="utf-8")[:size],
                     encoding="utf-8")
        files.append(f)
    return files


def prepare(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """`bamboo data prepare ARGS --quiet` in this process: its exit code and stderr."""
    code = cli.main(["data", "prepare", *args, "--quiet"])
    return code, capsys.readouterr().err
