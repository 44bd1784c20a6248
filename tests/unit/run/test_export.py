"""`bamboo export RUN_DIR --hf DIR`: a trained run, loaded back by transformers.

What is checked is what a user relies on: `AutoModelForCausalLM.from_pretrained(DIR)` holds
the run's parameters and computes the logits bamboo's own model computes from model.pt,
the tokenizer of a prepared data directory comes along, and a wrong run directory, model
or output directory is one line and a non-zero exit, leaving nothing behind.

Its tests that start processes: tests/integration/test_export_runs.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bamboo import cli


def _fake_run(path: Path, model: str) -> Path:
    path.mkdir()
    (path / "summary.json").write_text(json.dumps({"config": {"model": model, "data": None}}))
    return path


EXPORT_ERRORS = {
    "missing run dir": (lambda t: t / "nope", "does not exist"),
    "no summary": (lambda t: (t / "empty").mkdir() or t / "empty", "has no summary.json"),
    "no model.pt": (lambda t: _fake_run(t / "r", "gpt2-tiny"), "has no model.pt"),
    "bert": (lambda t: _fake_run(t / "r", "bert-tiny"),
             "is a bert model; export writes causal language models"),
    "cnn": (lambda t: _fake_run(t / "r", "cnn-tiny"), "is a cnn model"),
    "custom": (lambda t: _fake_run(t / "r", "examples.custom_model:build"), "is a custom model"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", EXPORT_ERRORS)
def test_export_errors_are_one_line(tmp_path: Path, capsys, case: str) -> None:
    make, expected = EXPORT_ERRORS[case]
    run = make(tmp_path)
    out = tmp_path / "hf"
    assert cli.main(["export", str(run), "--hf", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines
    assert lines[0].startswith("bamboo export: error: ")
    assert not out.exists()


@pytest.mark.timeout(60)
def test_export_never_writes_into_a_non_empty_directory(tmp_path: Path, capsys) -> None:
    run = _fake_run(tmp_path / "r", "gpt2-tiny")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli.main(["export", str(run), "--hf", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert [f.name for f in out.iterdir()] == ["keep.txt"]
    assert cli.main(["export", str(run), "--hf", str(out / "keep.txt")]) == 2
    assert "is not a directory" in capsys.readouterr().err
