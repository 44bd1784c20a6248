"""A damaged manifest.json or layer.json is refused in words: the file, and every missing or
mistyped key (`bamboo.run.checkpoint_integrity` with `bamboo.util.json_shape`), never a bare
KeyError or TypeError. Checkpoints written and published as a run does (support.checkpoints)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bamboo.run.checkpoint import FORMAT, CheckpointError, load_checkpoint, load_latest
from bamboo.util.json_shape import ListOf, MapOf, Record, problems
from support.checkpoints import save, states, two_checkpoints


def _edit(path: Path, change) -> None:
    value = json.loads(path.read_text())
    path.write_text(json.dumps(change(value)))


def _refusal(folder: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder)
    text = str(e.value)
    assert "\n" not in text and "KeyError" not in text and "TypeError" not in text
    return text


def test_every_missing_manifest_key_is_named(tmp_path: Path) -> None:
    folder = save(tmp_path, 5, states(0))
    (folder / "manifest.json").write_text(json.dumps({"format": FORMAT}))
    assert _refusal(folder) == ("manifest.json is damaged: 'step' is missing; 'layers' is "
                                "missing; 'sidecars' is missing; 'checksum' is missing")


def test_mistyped_manifest_keys_say_what_they_are_and_should_be(tmp_path: Path) -> None:
    folder = save(tmp_path, 5, states(0))

    def damage(m: dict) -> dict:
        m["layers"][2] = "2"
        m["layers"][3] = True  # a boolean is not a layer number
        m["checksum"] = None
        m["meta"] = []
        return m
    _edit(folder / "manifest.json", damage)
    assert _refusal(folder) == (
        "manifest.json is damaged: 'layers[2]' is a string, not an integer; 'layers[3]' is a "
        "boolean, not an integer; 'checksum' is null, not a string; 'meta' is a list, not an "
        "object")


def test_a_manifest_that_is_not_an_object_or_not_json(tmp_path: Path) -> None:
    folder = save(tmp_path, 5, states(0))
    (folder / "manifest.json").write_text("[1, 2]")
    assert _refusal(folder) == "manifest.json is damaged: it is a list, not an object"
    (folder / "manifest.json").write_bytes(b"\xff\xfe{")
    assert _refusal(folder) == "manifest.json is damaged: it is not UTF-8 text"


def test_many_problems_name_the_first_four_and_count_the_rest(tmp_path: Path) -> None:
    folder = save(tmp_path, 5, states(0))
    layer = folder / "layer-0002" / "layer.json"

    def damage(s: dict) -> dict:
        for entry in s["tensors"]:
            entry.pop("key")
            entry["shape"] = "13"
            entry["dtype"] = 32
        s["files"] = {name: str(size) for name, size in s["files"].items()}
        return s
    _edit(layer, damage)
    text = _refusal(folder)
    # One tensor (`state`) and two files (.metadata, the data): five problems, four named.
    assert text == ("layer-0002/layer.json is damaged: 'tensors[0].key' is missing; "
                    "'tensors[0].shape' is a string, not a list of integers; "
                    "'tensors[0].dtype' is an integer, not a string; "
                    "'files[\".metadata\"]' is a string, not an integer; and 1 more")


def test_a_sidecar_without_digests_is_named_in_the_fallback_warning(tmp_path: Path) -> None:
    """The newest checkpoint's sidecar lacks a key: `load_latest` takes the older one and
    its one-line warning names the step, the file and the key."""
    two_checkpoints(tmp_path)
    _edit(tmp_path / "step-00000020" / "layer-0005" / "layer.json",
          lambda s: {k: v for k, v in s.items() if k != "digests"})
    got = load_latest(tmp_path, quiet=True)
    assert got.step == 10
    assert got.warning == ("checkpoint step-00000020: layer-0005/layer.json is damaged: "
                           "'digests' is missing; resuming from step-00000010 instead")


def test_shapes_in_words() -> None:
    shape = Record({"files": MapOf(int), "runs": ListOf(ListOf(float))}, optional={"n": int})
    assert problems({"files": {"a": 1}, "runs": [[1, 2.5]]}, shape) == []
    assert problems({"files": {"a": 1.5}, "runs": [[None]], "n": "x"}, shape) == [
        "'files[\"a\"]' is a number, not an integer", "'runs[0][0]' is null, not a number",
        "'n' is a string, not an integer"]
    assert problems({"files": [], "runs": {}}, shape) == [
        "'files' is a list, not an object of integers",
        "'runs' is an object, not a list of lists of numbers"]
