"""`--layer-costs`: stages cut by measured seconds per layer (`bamboo profile --layers-only`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bamboo.cli import main
from bamboo.config.layer_costs import SCHEMA, LayerCosts, load_layer_costs, save_layer_costs
from bamboo.engine.layer_costs import measure_layer_costs

from support.procs import run_events
from support.runs import assert_equals_failure_free, config, run_in_process


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


def _write(path: Path, **fields) -> Path:
    path.write_text(json.dumps({"schema": SCHEMA, "model": "gpt2-tiny", "micro_batch_size": 8,
                                "layer_s": [1.0] * 8, **fields}))
    return path


@pytest.mark.parametrize("fields,text", [
    (dict(model="llama-tiny"), "was measured for llama-tiny, not gpt2-tiny"),
    (dict(layer_s=[1.0] * 7), "has 7 layers; gpt2-tiny has 8"),
    (dict(layer_s=[1.0] * 7 + [0.0]), "layer_s must be a non-empty list of positive seconds"),
    (dict(schema="bamboo.costs/1"), "is not a layer-costs file"),
])
def test_a_wrong_file_is_one_line(fields: dict, text: str, tmp_path: Path, capsys) -> None:
    path = _write(tmp_path / "c.json", **fields)
    assert main(["train", "--layer-costs", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert text in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_stages_follow_the_measured_costs_and_a_kill_ends_equal(tmp_path: Path) -> None:
    """Costs that make the last three layers dear give them a stage each (parameter counts
    would cut 2/2/2/2); the math does not change: a kill still ends equal to the
    failure-free run."""
    costs = _write(tmp_path / "c.json", layer_s=[1.0] * 5 + [5.0] * 3)
    cfg = config(dict(steps=6, kills=["0:2@3"], layer_costs=str(costs)))
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equals_failure_free(summary, cfg)
    events = run_events(tmp_path / "run")
    ready = next(e for e in events if e["event"] == "generation_ready")
    assert ready["parts"] == [[0, 5], [5, 6], [6, 7], [7, 8]]
    assert summary["failovers"] == 1


def test_loaded_costs_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_layer_costs(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        load_layer_costs(tmp_path / "bad.json")
    assert LayerCosts("m", 1, [1.0]).schema == SCHEMA
