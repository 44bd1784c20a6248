"""Durable checkpoints: round trip, fallback past broken ones, a full disk, safe loading."""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bamboo import checkpoint as ck
from bamboo.checkpoint import CheckpointError, load_latest, save_checkpoint
from conftest import mounted_tmpfs


def trained_state(seed: int) -> tuple[dict, dict]:
    """Two stages of real parameters and real AdamW state after two steps."""
    torch.manual_seed(seed)
    stages, optim = {}, {}
    for s in range(2):
        layer = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.01)
        for _ in range(2):
            layer(torch.randn(5, 4)).pow(2).sum().backward()
            opt.step()
        stages[s] = {k: v.detach().clone() for k, v in layer.state_dict().items()}
        optim[s] = opt.state_dict()
    return stages, optim


def assert_same(a, b) -> None:
    """Bitwise equal nested structures of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def two_checkpoints(root: Path) -> tuple[tuple, tuple]:
    old, new = trained_state(1), trained_state(2)
    save_checkpoint(root, 10, *old, {"run": "r", "losses": [3.5]})
    save_checkpoint(root, 20, *new, {"run": "r", "losses": [3.5, 3.1]})
    return old, new


def test_round_trip_is_bitwise_with_optimizer_state(tmp_path):
    stages, optim = trained_state(0)
    path = save_checkpoint(tmp_path, 7, stages, optim, {"seed": 0, "layout": [2, 1]})
    assert path == tmp_path / "step-00000007"
    assert (tmp_path / "LATEST").read_text().strip() == "step-00000007"
    manifest = json.loads((path / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    got = load_latest(tmp_path)
    assert got.step == 7 and got.warning is None and got.meta == {"seed": 0, "layout": [2, 1]}
    assert_same(got.stages, stages)
    assert_same(got.optimizer_states, optim)
    assert got.optimizer_states[1]["state"][0]["exp_avg_sq"].abs().sum() > 0


def test_keeps_the_newest_two_and_no_temporaries(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, *trained_state(step), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000003", "step-00000004"]
    assert load_latest(tmp_path).step == 4


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "no_manifest", "bad_manifest"])
def test_broken_newest_falls_back_to_previous_and_says_so(tmp_path, damage, caplog):
    old, _ = two_checkpoints(tmp_path)
    newest = tmp_path / "step-00000020"
    stage = newest / "stage-1.pt"
    if damage == "corrupt":
        data = bytearray(stage.read_bytes())
        data[len(data) // 2] ^= 0xFF
        stage.write_bytes(bytes(data))
    elif damage == "truncated":
        stage.write_bytes(stage.read_bytes()[:100])
    elif damage == "no_manifest":
        (newest / "manifest.json").unlink()
    else:
        (newest / "manifest.json").write_text('{"step": 20, "fil')
    expected = {"corrupt": "stage-1.pt is corrupt", "truncated": "stage-1.pt is truncated",
                "no_manifest": "manifest.json is missing",
                "bad_manifest": "manifest.json is unreadable"}[damage]
    with caplog.at_level(logging.WARNING, logger="bamboo.checkpoint"):
        got = load_latest(tmp_path)
    assert got.step == 10
    assert_same(got.stages, old[0])
    assert_same(got.optimizer_states, old[1])
    assert "step-00000020" in got.warning and expected in got.warning
    assert "resuming from step-00000010" in got.warning and "\n" not in got.warning
    assert [r.getMessage() for r in caplog.records] == [got.warning]


def test_unsafe_pickle_is_refused_even_with_a_valid_manifest(tmp_path):
    """weights_only: a file that would run code on load is skipped, not executed."""
    two_checkpoints(tmp_path)
    newest = tmp_path / "step-00000020"
    stage = newest / "stage-0.pt"
    torch.save({"params": {}, "optim": {"x": Path("/evil")}}, stage)  # not an allowed type
    manifest = json.loads((newest / "manifest.json").read_text())
    data = stage.read_bytes()
    manifest["files"]["stage-0.pt"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (newest / "manifest.json").write_text(json.dumps(manifest))
    got = load_latest(tmp_path)
    assert got.step == 10 and "does not load safely" in got.warning


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    old, _ = trained_state(1), None
    save_checkpoint(tmp_path, 10, *old, {"n": 1})
    budget = {"left": 5000}  # stage files are ~3.7 kB: the disk fills inside the second
    real_write = ck._HashingWriter.write

    def write(self, data):
        if budget["left"] < len(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        budget["left"] -= len(data)
        return real_write(self, data)
    monkeypatch.setattr(ck._HashingWriter, "write", write)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, 20, *trained_state(2), {"n": 2})
    text = str(info.value)
    assert "\n" not in text and "step 20" in text and "no space left" in text
    assert "step-00000010 is kept" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000010"]
    monkeypatch.undo()
    got = load_latest(tmp_path)
    assert got.step == 10 and got.warning is None
    assert_same(got.stages, old[0])


def test_failed_save_during_publish_keeps_previous(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 10, *trained_state(1), {})

    def fail(*args):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(ck, "_write_text", fail)  # the manifest write fails
    with pytest.raises(CheckpointError, match="Input/output error"):
        save_checkpoint(tmp_path, 20, *trained_state(2), {})
    monkeypatch.undo()
    assert load_latest(tmp_path).step == 10
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint in .*--checkpoint-every"):
        load_latest(tmp_path / "nothing-here")
    (tmp_path / "step-00000003").mkdir()
    with pytest.raises(CheckpointError, match="no whole checkpoint in .*manifest.json is missing"):
        load_latest(tmp_path)


# -- a manifest that lacks a layer ---------------------------------------------------------

LAYER_META = {"unit": "layer", "model": "gpt2-tiny", "seed": 0}
"""What the launcher writes: one entry per layer of the model (gpt2-tiny has 8)."""


def layer_states(seed: int, layers=range(8)) -> dict:
    torch.manual_seed(seed)
    return {i: {"state": torch.randn(6)} for i in layers}


@pytest.mark.parametrize("damage,missing", [("dropped", "layer 3 of the 8"),
                                            ("two_dropped", "layers 2, 5 of the 8"),
                                            ("last_never_saved", "layer 7 of the 8")])
def test_a_manifest_lacking_a_layer_is_skipped_like_a_corrupt_one(tmp_path, damage, missing,
                                                                  caplog):
    old = layer_states(1)
    save_checkpoint(tmp_path, 10, old, {}, LAYER_META)
    newest = tmp_path / "step-00000020"
    if damage == "last_never_saved":
        save_checkpoint(tmp_path, 20, layer_states(2, range(7)), {}, LAYER_META)
    else:
        save_checkpoint(tmp_path, 20, layer_states(2), {}, LAYER_META)
        manifest = json.loads((newest / "manifest.json").read_text())
        for layer in ([3] if damage == "dropped" else [2, 5]):
            manifest["stages"].remove(layer)
            if layer == 5:  # gone from the files too: only the gap shows it
                del manifest["files"][f"stage-{layer}.pt"]
        (newest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as info:
        ck.load_checkpoint(newest)  # what a worker loads: an error, never a later KeyError
    assert f"manifest.json lacks {missing} of gpt2-tiny" in str(info.value)
    with caplog.at_level(logging.WARNING, logger="bamboo.checkpoint"):
        got = load_latest(tmp_path)
    assert got.step == 10 and sorted(got.stages) == list(range(8))
    assert_same(got.stages, old)
    assert f"step-00000020: manifest.json lacks {missing}" in got.warning
    assert "resuming from step-00000010" in got.warning and "\n" not in got.warning


def test_a_gap_is_caught_without_knowing_the_model(tmp_path):
    save_checkpoint(tmp_path, 10, {0: {"w": torch.ones(2)}, 2: {"w": torch.ones(2)}}, {}, {})
    with pytest.raises(CheckpointError, match=r"no whole checkpoint .*lacks stage 1:"):
        load_latest(tmp_path)


# -- interrupted and failed saves leave nothing behind ------------------------------------


def _leftovers(root: Path, pid: int) -> list[str]:
    """What a save killed mid-way by process `pid` leaves: a partial step folder, a half
    replaced same-step folder and a half written LATEST."""
    partial = root / f".tmp-step-00000015-{pid}"
    partial.mkdir(parents=True)
    (partial / "stage-0.pt").write_bytes(b"half a file")
    (root / f".old-step-00000012-{pid}").mkdir()
    (root / f".LATEST.tmp-{pid}").write_text("step-000")
    return sorted([partial.name, f".old-step-00000012-{pid}", f".LATEST.tmp-{pid}"])


def test_the_next_save_removes_what_interrupted_saves_left(tmp_path):
    save_checkpoint(tmp_path, 10, *trained_state(1), {})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    _leftovers(tmp_path, dead.pid)
    _leftovers(tmp_path, os.getpid())  # this process's own, from a save it never finished
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as alive:
        try:
            in_progress = _leftovers(tmp_path, alive.pid)  # a save still running elsewhere
            save_checkpoint(tmp_path, 20, *trained_state(2), {})
            assert sorted(p.name for p in tmp_path.iterdir()) == \
                sorted(["LATEST", "step-00000010", "step-00000020", *in_progress])
        finally:
            alive.kill()
    save_checkpoint(tmp_path, 30, *trained_state(3), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000020",
                                                          "step-00000030"]
    assert load_latest(tmp_path).step == 30


def test_a_full_disk_is_one_error_naming_the_file_and_leaves_no_temporaries(tmp_path):
    """A real full disk: a 64 kB tmpfs, a checkpoint of 400 kB."""
    with mounted_tmpfs(tmp_path / "disk", "size=64k") as disk:
        root = disk / "checkpoints"
        old = trained_state(1)
        save_checkpoint(root, 10, *old, {})
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait(timeout=30)
        _leftovers(root, dead.pid)
        big = {0: {"w": torch.ones(100_000)}}  # 400 kB
        with pytest.raises(CheckpointError) as info:
            save_checkpoint(root, 20, big, {}, {})
        assert str(info.value) == (f"checkpoint of step 20 not saved in {root}: could not write "
                                   f"step-00000020/stage-0.pt: no space left on device; "
                                   f"step-00000010 is kept")
        assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-00000010"]
        assert sorted(p.name for p in disk.iterdir()) == ["checkpoints"]
        got = load_latest(root)
        assert got.step == 10 and got.warning is None
        assert_same(got.stages, old[0])
        save_checkpoint(root, 30, *trained_state(3), {})  # the space was given back
        assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-00000010",
                                                         "step-00000030"]
