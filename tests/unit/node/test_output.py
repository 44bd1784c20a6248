"""`--json`'s stdout kept for the summary (`bamboo.cli.json_out`), under capfd. Where a
worker's output goes, in a forked child: tests/integration/test_worker_output_runs.py."""
from __future__ import annotations

import os
import sys

import pytest

from bamboo.cli.json_out import json_stdout


def test_json_stdout_holds_the_document_alone(capfd: pytest.CaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdout", open(1, "w", closefd=False))
    monkeypatch.setattr(sys, "stderr", open(2, "w", closefd=False))
    with json_stdout(True) as out:
        print("the user's factory")
        os.write(1, b"a C library\n")
        print('{"status": "completed"}', file=out)
    print("after")
    sys.stdout.flush()
    sys.stderr.flush()
    got, err = capfd.readouterr()
    assert got == '{"status": "completed"}\nafter\n'
    # Both on stderr (the buffered print written when the block ends, the other at once).
    assert sorted(err.splitlines()) == ["a C library", "the user's factory"]
    with json_stdout(False) as out:
        assert out is sys.stdout
