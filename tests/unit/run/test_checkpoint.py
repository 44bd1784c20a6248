"""Durable checkpoints written by the holders (one DCP folder per layer, the
manifest written last by the coordinator): round trip, subsets, fallback past partial and
broken ones, pruning, full disks, safe loading, URLs.

Its tests that start processes: tests/integration/test_checkpoint_runs.py."""
from __future__ import annotations

import dataclasses
import errno
import io
import json
import logging
import os
import pickle
import re
from pathlib import Path

import pytest
import torch

from bamboo.run import checkpoint as ck
from bamboo.run.checkpoint import (
    CheckpointError,
    has_whole_checkpoint,
    list_checkpoints,
    load_latest,
    load_layer_tensors,
    load_layers,
    publish,
    step_dir,
    write_layers,
)
from bamboo.run.checkpoint_storage import LocalStore
from support.checkpoints import (
    LAYER_META,
    assert_same,
    damage_checkpoint,
    save,
    state_vectors,
    states,
    two_checkpoints,
)


def test_round_trip_is_bitwise_and_reads_any_subset(tmp_path):
    vectors = states(0)
    path = save(tmp_path, 7, vectors, LAYER_META | {"layout": [2, 1]})
    assert path == tmp_path / "step-00000007"
    assert (tmp_path / "LATEST").read_text().strip() == "step-00000007"
    manifest = json.loads((path / "manifest.json").read_text())
    checksum, sidecars = manifest.pop("checksum"), manifest.pop("sidecars")
    assert manifest == {"format": ck.FORMAT, "step": 7, "layers": list(range(8)),
                        "meta": LAYER_META | {"layout": [2, 1]}}
    assert ck.FORMAT == 4 and len(checksum) == 64 and sorted(sidecars) == [
        f"layer-{i:04d}" for i in range(8)]
    for i in range(8):  # each layer is a DCP folder of its own, under a per-layer key
        names = sorted(p.name for p in (path / f"layer-{i:04d}").iterdir())
        assert names == [".metadata", "__0_0.distcp", "layer.json"]
    got = load_latest(tmp_path)
    assert (got.step, got.layers, got.warning, got.path) == (7, list(range(8)), None, path)
    assert got.meta == LAYER_META | {"layout": [2, 1]}
    assert_same(state_vectors(load_layers(got.path, range(8))), vectors)
    # A later layout with another partition reads only its layers.
    assert_same(state_vectors(load_layers(got.path, [5, 2, 3])), {i: vectors[i] for i in (2, 3, 5)})
    assert [n for n, _ in load_layer_tensors(got.path, 4)] == ["state"]


def test_named_tensors_keep_their_order_and_dtype(tmp_path):
    tensors = {"param.b": torch.arange(3.0), "param.a": torch.ones(2, 2, dtype=torch.float64),
               "param.c": torch.tensor([1, 2], dtype=torch.int64)}
    write_layers(tmp_path / "final-00000005", {3: tensors})
    got = load_layer_tensors(tmp_path / "final-00000005", 3)
    assert [n for n, _ in got] == ["param.b", "param.a", "param.c"]
    assert_same(dict(got), tensors)


def test_publishing_prunes_to_keep_and_leaves_no_temporaries(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, states(step))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000003", "step-00000004"]
    save(tmp_path, 5, states(5), keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000005"]
    assert load_latest(tmp_path).step == 5


def test_pruning_spares_a_later_step_still_being_written(tmp_path):
    save(tmp_path, 4, states(4))
    write_layers(step_dir(tmp_path, 8), {0: {"state": torch.ones(2)}})  # in flight
    write_layers(step_dir(tmp_path, 5), {0: {"state": torch.ones(2)}})  # never finished
    save(tmp_path, 6, states(6), keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000006",
                                                         "step-00000008"]


def test_a_stopped_run_leaves_only_whole_checkpoints_and_final_folders(tmp_path):
    """A run that stops while a step's parts were still being written (or after one failed)
    removes that step's folder: no worker is left to make it whole."""
    save(tmp_path, 4, states(4))
    write_layers(step_dir(tmp_path, 5), {0: {"state": torch.ones(2)}})  # its other part: never
    write_layers(ck.final_dir(tmp_path, 6), {0: {"param.w": torch.ones(2)}})
    assert ck.remove_unfinished_writes(tmp_path) == ["step-00000005"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "final-00000006",
                                                         "step-00000004"]
    assert load_latest(tmp_path).step == 4


@pytest.mark.parametrize("damage", ["layer_missing", "truncated", "no_metadata", "no_sidecar",
                                    "no_manifest", "bad_manifest", "old_format",
                                    "format_3", "manifest_keys", "sidecar_keys"])
def test_a_partial_newest_falls_back_to_the_newest_whole_and_says_so(tmp_path, damage, caplog):
    old, _ = two_checkpoints(tmp_path)
    expected = damage_checkpoint(tmp_path / "step-00000020", damage)
    assert has_whole_checkpoint(tmp_path)
    with caplog.at_level(logging.WARNING, logger="bamboo.run.checkpoint"):
        got = load_latest(tmp_path)
    assert got.step == 10 and got.meta["losses"] == [3.5]
    assert_same(state_vectors(load_layers(got.path, range(8))), old)
    assert "step-00000020" in got.warning and expected in got.warning, got.warning
    assert "resuming from step-00000010" in got.warning and "\n" not in got.warning
    assert [r.getMessage() for r in caplog.records if r.name == "bamboo.run.checkpoint"] == \
        [got.warning]


def test_corrupt_bytes_are_caught_by_sha256_when_the_layer_is_read(tmp_path):
    """A flipped byte keeps every size: the file's digest catches it when a checkpoint is
    chosen (it falls back), and the tensor's when the layer is read."""
    old, _ = two_checkpoints(tmp_path)
    data = tmp_path / "step-00000020" / "layer-0003" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    at = bytes(raw).index(states(2)[3].numpy().tobytes())  # the tensor's own bytes
    raw[at + 5] ^= 0xFF
    data.write_bytes(bytes(raw))
    got = load_latest(tmp_path)
    assert got.step == 10 and got.warning == (
        "checkpoint step-00000020: layer-0003/__0_0.distcp is corrupt (sha256 mismatch); "
        "resuming from step-00000010 instead")
    with pytest.raises(CheckpointError, match="layer-0003: layer.3.state is corrupt"):
        load_layers(tmp_path / "step-00000020", [3])
    assert_same(state_vectors(load_layers(tmp_path / "step-00000020", [2, 4])),
                {i: states(2)[i] for i in (2, 4)})  # the other layers are fine
    got = load_latest(tmp_path, verify_data=True)
    assert got.step == 10 and "sha256 mismatch" in got.warning
    assert_same(state_vectors(load_layers(got.path, range(8))), old)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/bamboo-pwned",))


def test_an_unsafe_pickle_in_dcp_metadata_is_refused_not_run(tmp_path):
    two_checkpoints(tmp_path)
    meta = tmp_path / "step-00000020" / "layer-0001" / ".metadata"
    payload = pickle.dumps(_Evil())
    meta.write_bytes(payload)
    sidecar = meta.parent / "layer.json"
    info = json.loads(sidecar.read_text())
    info["files"][".metadata"] = len(payload)  # a valid size: only reading can tell
    sidecar.write_text(json.dumps(info))
    Path("/tmp/bamboo-pwned").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="layer-0001 cannot be read .*posix.system is not "
                                              "allowed in DCP metadata"):
        load_layers(tmp_path / "step-00000020", [1])
    got = load_latest(tmp_path, verify_data=True)  # the edited sidecar: not its digest
    assert got.step == 10 and "layer-0001/layer.json does not match" in got.warning
    assert not Path("/tmp/bamboo-pwned").exists()


def test_a_failed_layer_write_keeps_everything_earlier(tmp_path, monkeypatch):
    old = states(1)
    save(tmp_path, 10, old)
    import torch.distributed.checkpoint.filesystem as fs
    real = fs._write_item

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(fs, "_write_item", full)
    with pytest.raises(CheckpointError) as info:
        write_layers(step_dir(tmp_path, 20), {2: {"state": torch.ones(5)}})
    text = str(info.value)
    assert "\n" not in text
    # A full disk also says how much room is left where it was writing.
    assert re.fullmatch(f"could not write layer 2 to {re.escape(str(tmp_path))}/step-00000020: "
                        r"No space left on device \(\d+(\.\d)? [kMG]B free there\)", text), text
    monkeypatch.setattr(fs, "_write_item", real)
    assert sorted(p.name for p in (tmp_path / "step-00000020").iterdir()) == []  # no temporary
    got = load_latest(tmp_path)
    assert got.step == 10 and "step-00000020: manifest.json is missing" in got.warning
    assert_same(state_vectors(load_layers(got.path, range(8))), old)


def test_a_failed_manifest_write_publishes_nothing(tmp_path, monkeypatch):
    save(tmp_path, 10, states(1))
    write_layers(step_dir(tmp_path, 20), {i: {"state": v} for i, v in states(2).items()})

    def fail(self, path, data):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(LocalStore, "write_atomic", fail)
    with pytest.raises(CheckpointError) as info:
        publish(tmp_path, 20, range(8), LAYER_META)
    assert str(info.value) == (f"checkpoint of step 20 not published in {tmp_path}: could not "
                               f"write step-00000020/manifest.json: Input/output error; "
                               f"step-00000010 is kept")
    monkeypatch.undo()
    assert load_latest(tmp_path).step == 10
    assert (tmp_path / "LATEST").read_text() == "step-00000010\n"


def test_a_layer_the_coordinator_cannot_see_is_not_published(tmp_path):
    """A worker that wrote to its own disk instead of the shared one: caught at publish."""
    write_layers(step_dir(tmp_path, 3), {i: {"state": v} for i, v in states(1, range(7)).items()})
    with pytest.raises(CheckpointError, match=r"layer 7 reported written but not found in "
                                              r".*give a shared --checkpoint-dir"):
        publish(tmp_path, 3, range(8), LAYER_META)
    assert list_checkpoints(tmp_path) == [tmp_path / "step-00000003"]
    assert not has_whole_checkpoint(tmp_path)


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint in .*--checkpoint-every"):
        load_latest(tmp_path / "nothing-here")
    assert not has_whole_checkpoint(tmp_path / "nothing-here")
    (tmp_path / "step-00000003").mkdir()
    with pytest.raises(CheckpointError, match="no whole checkpoint in .*manifest.json is missing"):
        load_latest(tmp_path)
    assert not has_whole_checkpoint(tmp_path)


@pytest.mark.parametrize("damage,missing", [("dropped", "layer 3 of the 8"),
                                            ("two_dropped", "layers 2, 5 of the 8"),
                                            ("last_never_written", "layer 7 of the 8")])
def test_a_manifest_lacking_a_layer_is_skipped_like_a_broken_one(tmp_path, damage, missing,
                                                                  caplog):
    old = states(1)
    save(tmp_path, 10, old)
    newest = tmp_path / "step-00000020"
    if damage == "last_never_written":
        save(tmp_path, 20, states(2, range(7)))
    else:
        save(tmp_path, 20, states(2))
        manifest = json.loads((newest / "manifest.json").read_text())
        for layer in ([3] if damage == "dropped" else [2, 5]):
            manifest["layers"].remove(layer)
        (newest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as info:
        ck.load_checkpoint(newest)
    assert f"manifest.json lacks {missing} of gpt2-tiny" in str(info.value)
    with caplog.at_level(logging.WARNING, logger="bamboo.run.checkpoint"):
        got = load_latest(tmp_path)
    assert got.step == 10 and got.layers == list(range(8))
    assert_same(state_vectors(load_layers(got.path, range(8))), old)
    assert f"step-00000020: manifest.json lacks {missing}" in got.warning
    assert "resuming from step-00000010" in got.warning and "\n" not in got.warning


def test_a_gap_is_caught_without_knowing_the_model(tmp_path):
    save(tmp_path, 10, {0: torch.ones(2), 2: torch.ones(2)}, {})
    with pytest.raises(CheckpointError, match=r"no whole checkpoint .*lacks layer 1:"):
        load_latest(tmp_path)


def test_a_file_url_root_works_like_a_folder(tmp_path):
    root = f"file://{tmp_path}/ckpt"
    old, new = states(1), states(2)
    assert save(root, 10, old) == f"{root}/step-00000010"
    save(root, 20, new)
    save(root, 30, states(3), keep=2)
    assert list_checkpoints(root) == [f"{root}/step-00000030", f"{root}/step-00000020"]
    assert (tmp_path / "ckpt" / "LATEST").read_text() == "step-00000030\n"
    (tmp_path / "ckpt" / "step-00000030" / "manifest.json").unlink()
    got = load_latest(root)
    assert got.step == 20 and got.path == f"{root}/step-00000020"
    assert "step-00000030: manifest.json is missing" in got.warning
    assert_same(state_vectors(load_layers(got.path, [1, 6])), {i: new[i] for i in (1, 6)})
    assert not [p for p in (tmp_path / "ckpt").rglob(".*tmp*")]


# -- interrupted writes leave nothing behind ------------------------------------------------


# -- the protocol carries no tensor -------------------------------------------------------


def test_checkpoint_and_final_reports_are_plain_json() -> None:
    from bamboo.protocol import frames as wire
    from bamboo.protocol.messages import CheckpointPart, LayerParams
    wire.register(CheckpointPart, LayerParams)
    for msg in (CheckpointPart(rank=1, step=4, layers=[2, 3]),
                CheckpointPart(rank=1, step=4, layers=[], error="could not write layer 2"),
                LayerParams(rank=0, layers=[0, 1]), LayerParams(rank=2)):
        data = dataclasses.asdict(msg)
        assert json.loads(json.dumps(data)) == data
        assert wire.decode(json.loads(json.dumps(wire.encode(msg)))) == msg  # the agents' wire


# -- real runs ------------------------------------------------------------------------------


# -- the final model: written by the holders, read back by the coordinator --------------------


def _finished_sim(tmp_path: Path, **kw):
    """A run played to its last step by scripted workers (tests/coordinator_sim.py), each
    stage's first holder having written its final layers."""
    from bamboo.config import JobConfig
    from coordinator_sim import SimCluster
    sim = SimCluster(JobConfig.of(**(dict(nodes=4, stages=4, steps=3) | kw)).validate(),
                     tmp_path / "run")
    sim.finish()
    assert sim.stopped is None, sim.stopped
    return sim


def test_the_model_is_read_back_from_the_final_layers_on_storage(tmp_path):
    sim = _finished_sim(tmp_path, nodes=8)
    summary = sim.core.final_summary()
    final = tmp_path / "run" / "checkpoints" / "final-00000003"
    assert sorted(p.name for p in final.iterdir()) == [f"layer-{i:04d}" for i in range(8)]
    model = torch.load(io.BytesIO(sim.core.results.model_bytes()), weights_only=True)
    assert list(model) == [f"layers.{i}.w" for i in range(8)]  # the sim's one parameter
    assert summary["param_l2"] == 0.0 and summary["param_sha256"]


@pytest.mark.parametrize("damage", ["never_reported", "truncated"])
def test_a_missing_or_broken_final_layer_fails_the_run_cleanly(tmp_path, damage):
    from bamboo.control.state import Stop
    sim = _finished_sim(tmp_path)
    results = sim.core.results
    if damage == "never_reported":  # its writer was lost after the last step
        results.final.discard(5)
    else:
        data = tmp_path / "run" / "checkpoints" / "final-00000003" / "layer-0005" / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[:50])
    with pytest.raises(Stop) as info:
        sim.core.final_summary()
    if damage == "never_reported":
        assert info.value.exit_code == 3
        assert str(info.value).startswith("the node writing layer 5's final parameters was lost")
    else:
        assert info.value.exit_code == 1
        assert "the trained model cannot be read back" in str(info.value)
        assert "layer-0005/__0_0.distcp is truncated (50 of" in str(info.value)
    assert not (tmp_path / "run" / "model.pt").exists()
    assert sim.core.summary("failed", "x")["param_l2"] is None


def test_a_failed_final_write_stops_the_run_naming_it(tmp_path):
    from bamboo.control.state import Stop
    from bamboo.protocol.messages import LayerParams
    sim = _finished_sim(tmp_path)
    with pytest.raises(Stop, match=r"^the trained model was not saved \(model.pt not written\): "
                                   r"could not write layer 2 to .*: No space left on device$"):
        sim.core.results.on_params(LayerParams(rank=1, layers=[], error=(
            "could not write layer 2 to /x/final-00000003: No space left on device")))
