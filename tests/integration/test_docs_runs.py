"""The README's quick start, for real: each of its `bamboo train` commands, shortened to 2
steps, exits 0 with a summary, and a run with a kill ends with the bits of the same command
without it, as the README says. (The pages' commands, paths, names and links, checked
without processes: tests/unit/test_docs.py.)"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.pages import page_commands
from support.procs import REPO

# -- the quick start, for real ----------------------------------------------------------------


def quick_start_trains() -> list[list[str]]:
    """The `bamboo train` commands of the README's "Quick start" section."""
    page = REPO / "README.md"
    lines = page.read_text(encoding="utf-8").split("\n")
    start = lines.index("## Quick start") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("## ")) + 1
    return [list(c.words[2:]) for c in page_commands(page)
            if start <= c.line <= end and c.words[:2] == ("bamboo", "train")]


def shortened(args: list[str], out: Path) -> list[str]:
    """The command in a short form: 2 steps, a kill moved into step 1, its own --out."""
    short: list[str] = []
    words = iter(args)
    for word in words:
        if word in ("--steps", "--out"):
            next(words)
        elif word == "--kill":
            short += [word, re.sub(r"@\d+", "@1", next(words))]
        else:
            short.append(word)
    return [*short, "--steps", "2", "--out", str(out), "--no-report"]


def without_kills(args: list[str]) -> tuple[str, ...]:
    words, kept = iter(args), []
    for word in words:
        if word == "--kill":
            next(words)
        elif word != "--out":
            kept.append(word)
        else:
            next(words)
    return tuple(kept)


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_the_quick_start_trains(tmp_path: Path) -> None:
    """Each quick-start `bamboo train`, shortened, exits 0 with a summary; a run with a kill
    ends with the bits of the same command without it, as the README says."""
    trains = quick_start_trains()
    assert trains, "the README's quick start shows no bamboo train command"
    bits: dict[tuple[str, ...], set[str]] = {}
    for number, args in enumerate(trains):
        out = tmp_path / f"run{number}"
        cmd = [sys.executable, "-m", "bamboo", "train", *shortened(args, out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
        assert proc.returncode == 0, \
            f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        summary = json.loads((out / "summary.json").read_text())
        assert summary["steps_completed"] == 2
        assert summary["preemptions"] == args.count("--kill")
        bits.setdefault(without_kills(args), set()).add(summary["param_sha256"])
    for args, digests in bits.items():
        assert len(digests) == 1, f"`bamboo train {' '.join(args)}` with and without its kill " \
                                  f"ended with other parameters: {digests}"
