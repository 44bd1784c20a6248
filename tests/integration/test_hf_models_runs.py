"""Hugging Face models trained by the pipeline, with processes: each ends equal to the
single-process model, through a kill."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bamboo.config import JobConfig
from support.hf_models import GPT2, HF_MODELS
from support.procs import REPO
from support.reference import train_reference
from support.runs import assert_close, run_in_process

# SHARED: BERT, GPT2, HF_MODELS, LLAMA

pytestmark = pytest.mark.procs  # every test here starts processes


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", HF_MODELS)
def test_pipelined_training_equals_the_single_process_loop(tmp_path: Path, kind: str) -> None:
    name = HF_MODELS[kind][0]
    cfg = JobConfig.of(model=name, nodes=2, stages=2, steps=3).validate()
    summary = run_in_process(cfg, tmp_path / "run")  # the launcher here, its fork server warm
    assert summary["status"] == "completed", summary["error"]
    ref_losses, ref_params = train_reference(cfg)
    assert summary["steps_completed"] == 3
    assert_close(summary["losses"], ref_losses, rel=1e-6)
    l2 = float(torch.sqrt(sum(t.double().square().sum() for t in ref_params.values())))
    assert_close(summary["param_l2"], l2, rel=1e-6)
    params = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert params.keys() == ref_params.keys()
    for key, tensor in ref_params.items():
        torch.testing.assert_close(params[key], tensor, rtol=1e-5, atol=1e-6)


BAD_NAMES = {
    "unknown key": (GPT2.replace("n_embd", "n_embed"), "unknown key 'n_embed'"),
    "dropout key": ("hf:gpt2:attn_pdrop=0.1", "dropout is fixed at 0"),
    "bad value": ("hf:bert:hidden_size=big", "hidden_size=big is not a positive integer"),
    "not key=value": ("hf:gpt2:n_layer", "'n_layer' is not KEY=VALUE"),
    "llama dropout": ("hf:llama:attention_dropout=0.1", "dropout is fixed at 0"),
    "llama gpt2 key": ("hf:llama:n_layer=2", "unknown key 'n_layer'"),
    "missing directory": ("hf:/no/such/model", "directory '/no/such/model' does not exist"),
    "stages past layers": (GPT2, "--stages 4 is more than the 3 layers"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", BAD_NAMES)
def test_bad_hf_names_fail_with_one_line(case: str, tmp_path: Path) -> None:
    name, expected = BAD_NAMES[case]
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "bamboo", "train", "--model", name, "--stages",
                           "4", "--nodes", "4", "--out", str(out)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert expected in lines[0] and "Traceback" not in proc.stderr
    assert not out.exists()
