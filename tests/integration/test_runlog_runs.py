"""The run log on real disks (a tmpfs): a full disk names the file and keeps the old one;
a read-only one is refused before the run starts."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest

from bamboo.config import ConfigError
from bamboo.run.runlog import RunDir, RunDirError, write_atomic
from support.procs import mounted_tmpfs

pytestmark = pytest.mark.procs  # every test here starts processes


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


def test_check_writable_on_a_read_only_disk(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "ro", "ro") as ro:
        with pytest.raises(ConfigError) as info:
            RunDir(ro / "runs" / "x").check_writable()
        assert str(info.value) == (f"--out {ro}/runs/x: cannot write {ro}/runs (Read-only file "
                                   f"system): choose a directory you can write to")
        assert list(ro.iterdir()) == []
