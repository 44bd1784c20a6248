"""Checkpoints written and restored by real runs: what a restore reads back, through kills
and damaged files."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bamboo.run.checkpoint import (
    CheckpointError,
    load_latest,
    load_layer_tensors,
    load_layers,
    step_dir,
    write_layers,
)
from bamboo.run.checkpoint_storage import HOST
from support.checkpoints import (
    assert_same,
    damage_checkpoint,
    save,
    state_vectors,
    states,
    two_checkpoints,
)
from support.procs import mounted_tmpfs, run_bamboo

pytestmark = pytest.mark.procs  # every test here starts processes


def test_finding_whole_checkpoints_needs_no_torch(tmp_path):
    two_checkpoints(tmp_path)
    damage_checkpoint(tmp_path / "step-00000020", "truncated")
    code = ("import sys; from bamboo.run import checkpoint as c; "
            f"assert c.has_whole_checkpoint({str(tmp_path)!r}); "
            f"assert c.load_latest({str(tmp_path)!r}).step == 10; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _leftovers(folder: Path, pid: int, host: str | None = None) -> list[str]:
    """What a write killed mid-way by process `pid` leaves: a partial layer folder, a half
    replaced same-layer folder and a half written manifest."""
    tag = f"{pid}-{host}" if host else str(pid)
    partial = folder / f".tmp-layer-0001-{tag}"
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"half a file")
    (folder / f".old-layer-0002-{tag}").mkdir()
    (folder / f".manifest.json.tmp-{tag}").write_text("{")
    return sorted([partial.name, f".old-layer-0002-{tag}", f".manifest.json.tmp-{tag}"])


def test_the_next_write_removes_what_interrupted_writes_of_this_machine_left(tmp_path):
    folder = step_dir(tmp_path, 20)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    _leftovers(folder, dead.pid)
    _leftovers(folder, dead.pid, HOST)  # this machine's, named with its host
    _leftovers(folder, os.getpid(), HOST)  # this process's own, from a write it never finished
    elsewhere = _leftovers(folder, dead.pid, "another-machine")  # its processes can't be seen
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as alive:
        try:
            in_progress = _leftovers(folder, alive.pid)  # a write still running here
            write_layers(folder, {0: {"state": torch.ones(3)}})
            assert sorted(p.name for p in folder.iterdir()) == \
                sorted(["layer-0000", *in_progress, *elsewhere])
        finally:
            alive.kill()
    write_layers(folder, {0: {"state": torch.ones(3)}})
    assert sorted(p.name for p in folder.iterdir()) == sorted(["layer-0000", *elsewhere])


def test_a_real_full_disk_is_one_error_naming_the_layer_and_leaves_no_temporaries(tmp_path):
    """A 256 kB tmpfs, a layer of 400 kB."""
    with mounted_tmpfs(tmp_path / "disk", "size=256k") as disk:
        root = disk / "checkpoints"
        old = states(1, size=100)
        save(root, 10, old)
        with pytest.raises(CheckpointError) as info:
            write_layers(step_dir(root, 20), {0: {"state": torch.ones(100_000)}})
        assert str(info.value).startswith(f"could not write layer 0 to {root}/step-00000020: "
                                          f"No space left on device (")
        assert str(info.value).endswith(" kB free there)")  # the room left on the tmpfs
        assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-00000010",
                                                         "step-00000020"]
        assert list((root / "step-00000020").iterdir()) == []
        got = load_latest(root)
        assert got.step == 10 and "step-00000020: manifest.json is missing" in got.warning
        assert_same(state_vectors(load_layers(got.path, range(8))), old)
        save(root, 30, states(3, size=100))  # the space was given back
        assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-00000010",
                                                         "step-00000030"]


def _recorded(monkeypatch) -> list:
    """Every CheckpointPart and LayerParams the in-process coordinator receives."""
    from bamboo.control.checkpointing import CheckpointAssembly
    from bamboo.control.results import Results
    seen: list = []
    for cls, name in ((CheckpointAssembly, "on_part"), (Results, "on_params")):
        real = getattr(cls, name)

        def spy(self, msg, real=real):
            seen.append(msg)
            return real(self, msg)
        monkeypatch.setattr(cls, name, spy)
    return seen


@pytest.mark.timeout(240)
def test_a_file_url_checkpoint_dir_restores_and_ends_equal(tmp_path, monkeypatch):
    """No live copy of stage 2 survives: the run restores from the checkpoint its holders
    wrote under a file:// URL; the parts and final reports are plain JSON."""
    from support.procs import run_events
    from support.runs import assert_equal_and_accounted, config, run_in_process
    seen = _recorded(monkeypatch)
    url = f"file://{tmp_path}/shared/ckpt"
    cfg = config(nodes=4, stages=4, steps=7, checkpoint_every=2, kills=["0:1@5", "0:2@5"],
                 checkpoint_dir=url)
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equal_and_accounted(summary, cfg, lost=2)
    assert summary["checkpoint_restores"] >= 1 and summary["redone_steps"] == 1
    restore = [e for e in run_events(tmp_path / "run") if e["event"] == "checkpoint_restore"]
    assert restore[0]["step"] == 4 and restore[0]["checkpoint"] == f"{url}/step-00000004"
    assert not (tmp_path / "run" / "checkpoints").exists()
    shared = tmp_path / "shared" / "ckpt"
    assert sorted(p.name for p in shared.iterdir()) == [  # the final state is a resume point
        "LATEST", "final-00000007", "step-00000006", "step-00000007"]
    kinds = {type(m).__name__ for m in seen}
    assert kinds == {"CheckpointPart", "LayerParams"}
    for msg in seen:
        data = dataclasses.asdict(msg)
        assert json.loads(json.dumps(data)) == data
    finals = sorted(i for m in seen if type(m).__name__ == "LayerParams" for i in m.layers)
    assert finals == list(range(8))  # each layer's final copy written once


@pytest.mark.timeout(180)
def test_keep_checkpoints_one_leaves_one_and_model_pt_matches_the_final_layers(tmp_path):
    out = tmp_path / "run"
    result = run_bamboo(["train", "--nodes", "2", "--stages", "2", "--steps", "5",
                         "--checkpoint-every", "1", "--keep-checkpoints", "1", "--json",
                         "--quiet", "--no-report"], out)
    assert result.code == 0, result.stderr
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "final-00000005",
                                                     "step-00000005"]  # the final state
    assert not [p for p in root.rglob(".*tmp*")]
    model = torch.load(out / "model.pt", weights_only=True)
    from_storage = {f"layers.{i}.{n.removeprefix('param.')}": t for i in range(8)
                    for n, t in load_layer_tensors(root / "final-00000005", i)}
    assert list(model) == list(from_storage)
    assert_same(model, from_storage)
