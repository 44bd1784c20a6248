"""Checkpoints made by hand for the tests: seeded layer states written and published as a
run does, compared bit for bit, and broken in each way a reader must refuse."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from bamboo.run.checkpoint import publish, step_dir, write_layers

LAYER_META = {"unit": "layer", "model": "gpt2-tiny", "seed": 0}
"""What the coordinator writes: one entry per layer of the model (gpt2-tiny has 8)."""


def states(seed: int, layers=range(8), size: int = 13) -> dict[int, torch.Tensor]:
    """A seeded state vector per layer."""
    torch.manual_seed(seed)
    return {i: torch.randn(size) for i in layers}


def save(root, step: int, vectors: dict[int, torch.Tensor], meta=None, *, keep: int = 2,
         layers=None):
    """What a run does: the holders write their layers, the coordinator publishes."""
    write_layers(step_dir(root, step), {i: {"state": v} for i, v in vectors.items()})
    return publish(root, step, sorted(vectors) if layers is None else layers,
                   LAYER_META if meta is None else meta, keep=keep)


def assert_same(a: dict, b: dict) -> None:
    """The same tensors, bit for bit and of the same dtype, under the same keys."""
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def state_vectors(loaded: dict[int, dict[str, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """The `state` tensor of each layer `load_layers` read (what `save` wrote)."""
    assert all(list(named) == ["state"] for named in loaded.values()), loaded
    return {i: named["state"] for i, named in loaded.items()}


def two_checkpoints(root) -> tuple[dict, dict]:
    """Checkpoints of steps 10 and 20 in `root`: their states (old, new)."""
    old, new = states(1), states(2)
    save(root, 10, old, LAYER_META | {"losses": [3.5]})
    save(root, 20, new, LAYER_META | {"losses": [3.5, 3.1]})
    return old, new


def damage_checkpoint(newest: Path, how: str) -> str:
    """Break the checkpoint `newest` as `how` names; the text its refusal must hold."""
    layer = newest / "layer-0003"
    data = layer / "__0_0.distcp"
    if how == "layer_missing":
        import shutil
        shutil.rmtree(layer)
        return "layer-0003 is missing"
    if how == "truncated":
        data.write_bytes(data.read_bytes()[:100])
        return "layer-0003/__0_0.distcp is truncated (100 of"
    if how == "no_metadata":
        (layer / ".metadata").unlink()
        return "layer-0003/.metadata is missing"
    if how == "no_sidecar":
        (layer / "layer.json").unlink()
        return "layer-0003/layer.json is missing"
    if how == "no_manifest":
        (newest / "manifest.json").unlink()
        return "manifest.json is missing"
    if how == "bad_manifest":
        (newest / "manifest.json").write_text('{"step": 20, "lay')
        return "manifest.json is damaged: not JSON ("
    if how == "manifest_keys":
        manifest = json.loads((newest / "manifest.json").read_text())
        manifest["step"] = "20"
        del manifest["sidecars"]
        (newest / "manifest.json").write_text(json.dumps(manifest))
        return ("manifest.json is damaged: 'step' is a string, not an integer; 'sidecars' is "
                "missing")
    if how == "sidecar_keys":
        sidecar = json.loads((layer / "layer.json").read_text())
        del sidecar["tensors"][0]["sha256"]
        sidecar["files"] = list(sidecar["files"])
        (layer / "layer.json").write_text(json.dumps(sidecar))
        return ("layer-0003/layer.json is damaged: 'tensors[0].sha256' is missing; 'files' is "
                "a list, not an object of integers")
    if how == "old_format":
        (newest / "manifest.json").write_text(json.dumps({"format": 1, "step": 20, "stages": [0],
                                                          "files": {}, "meta": {}}))
        return "manifest.json is of format 1; this version of bamboo reads format 4"
    if how == "format_3":  # written by the version that kept one float32 vector a layer
        manifest = json.loads((newest / "manifest.json").read_text())
        (newest / "manifest.json").write_text(json.dumps(manifest | {"format": 3}))
        return ("manifest.json is of format 3; this version of bamboo reads format 4 (format 3 "
                "kept a layer's state as one float32 vector: start afresh, or finish that run "
                "with the version of bamboo that wrote it)")
    raise AssertionError(how)
