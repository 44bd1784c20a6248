"""The run directory's files: a write that fails leaves the old file and no temporary, and
says in one line which file could not be written and why."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest

from bamboo.config import ConfigError
from bamboo.run.runlog import RunDir, RunDirError, write_atomic
from support.procs import mounted_tmpfs


@pytest.mark.procs
def test_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "disk", "size=64k") as disk:
        model = disk / "model.pt"
        write_atomic(model, b"old model")
        with pytest.raises(RunDirError) as info:
            write_atomic(model, bytes(400_000))
        assert str(info.value) == f"could not write {model}: No space left on device"
        assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
        assert sorted(p.name for p in disk.iterdir()) == ["model.pt"]  # no temporary left
        assert model.read_bytes() == b"old model"


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


@pytest.mark.procs
def test_check_writable_on_a_read_only_disk(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "ro", "ro") as ro:
        with pytest.raises(ConfigError) as info:
            RunDir(ro / "runs" / "x").check_writable()
        assert str(info.value) == (f"--out {ro}/runs/x: cannot write {ro}/runs (Read-only file "
                                   f"system): choose a directory you can write to")
        assert list(ro.iterdir()) == []
