"""`--layer-costs`: stages cut by measured seconds per layer (`bamboo profile --layers-only`).
(A run cut by such a file, with a kill: tests/integration/test_layer_costs_runs.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from bamboo.cli import main
from bamboo.config.layer_costs import SCHEMA, LayerCosts, load_layer_costs, save_layer_costs
from bamboo.engine.layer_costs import measure_layer_costs
from support.costs import write_layer_costs


def test_each_layer_is_timed_alone_and_the_file_round_trips(tmp_path: Path) -> None:
    costs = measure_layer_costs("gpt2-tiny", micro_batch_size=2, repeats=1)
    assert costs.model == "gpt2-tiny" and len(costs.layer_s) == 8
    assert all(t > 0 for t in costs.layer_s)
    save_layer_costs(costs, tmp_path / "c.json")
    assert load_layer_costs(tmp_path / "c.json") == costs


def test_profile_layers_only_writes_a_file_train_takes(tmp_path: Path, capsys) -> None:
    out = tmp_path / "layers.json"
    assert main(["profile", "--model", "llama-tiny", "--layers-only", "--repeats", "1",
                 "--micro-batch-size", "2", "--out", str(out)]) == 0
    assert len(load_layer_costs(out).layer_s) == 8
    capsys.readouterr()
    assert main(["profile", "--model", "llama-tiny", "--layers-only", "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err  # never overwritten


def test_a_model_of_image_inputs_is_timed_on_its_dataset(tmp_path: Path, capsys) -> None:
    """A model that takes images has no token data to time on: its --dataset gives the
    samples (without one, the line says to train on a --dataset)."""
    from support.user_data import IMAGE_MODEL, IMAGES
    out = tmp_path / "layers.json"
    assert main(["profile", "--model", IMAGE_MODEL, "--dataset", IMAGES, "--layers-only",
                 "--repeats", "1", "--micro-batch-size", "2", "--out", str(out)]) == 0
    costs = load_layer_costs(out)
    assert len(costs.layer_s) == 3 and all(t > 0 for t in costs.layer_s)
    capsys.readouterr()
    assert main(["profile", "--model", IMAGE_MODEL, "--layers-only",
                 "--out", str(tmp_path / "other.json")]) == 2
    assert "or train on a --dataset" in capsys.readouterr().err


@pytest.mark.parametrize("fields,text", [
    (dict(model="llama-tiny"), "was measured for llama-tiny, not gpt2-tiny"),
    (dict(layer_s=[1.0] * 7), "has 7 layers; gpt2-tiny has 8"),
    (dict(layer_s=[1.0] * 7 + [0.0]), "layer_s must be a non-empty list of positive seconds"),
    (dict(schema="bamboo.costs/1"), "is not a layer-costs file"),
])
def test_a_wrong_file_is_one_line(fields: dict, text: str, tmp_path: Path, capsys) -> None:
    path = write_layer_costs(tmp_path / "c.json", **fields)
    assert main(["train", "--layer-costs", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert text in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_loaded_costs_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_layer_costs(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        load_layer_costs(tmp_path / "bad.json")
    assert LayerCosts("m", 1, [1.0]).schema == SCHEMA
