"""The run directory's files: a write that fails leaves the old file and no temporary, and
says in one line which file could not be written and why.

Its tests that start processes: tests/integration/test_runlog_runs.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from bamboo.run.runlog import RunDir, RunDirError


def test_write_json_under_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("a file, not a directory")
    with pytest.raises(RunDirError) as info:
        RunDir(tmp_path / "run").write_json("summary.json", {"steps": 3})
    assert str(info.value) == f"could not write {tmp_path}/run/summary.json: Not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_check_writable_leaves_nothing_behind(tmp_path: Path) -> None:
    RunDir(tmp_path / "a" / "b" / "run").check_writable()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "old").mkdir()
    RunDir(tmp_path / "old").check_writable()
    assert [p.name for p in tmp_path.iterdir()] == ["old"] and not any((tmp_path / "old").iterdir())
