"""Other model forms (bamboo.model.forms) trained by the pipeline with processes: a build
function returning an `nn.Sequential` (layers by value, with dropout) and one returning
DeepSpeed `LayerSpec`s with a loss_fn, each killed in flight and ending equal to its
failure-free run and to the single-process loop."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from support.models import write_module
from support.reference import train_reference
from support.runs import REL, assert_close, config, param_l2, run_in_process

pytestmark = [pytest.mark.procs, pytest.mark.slow]  # every test here starts processes

SEQUENTIAL = """
import torch
from torch import nn


class Mix(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc, self.drop = nn.LayerNorm(d), nn.Linear(d, d), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(self.ln(x))))


def build(vocab_size: int = 256, context: int = 16) -> nn.Sequential:
    d = 16
    return nn.Sequential(nn.Embedding(vocab_size, d), Mix(d), Mix(d), Mix(d),
                         nn.Linear(d, vocab_size))
"""

LAYER_SPECS = """
import torch
import torch.nn.functional as F
from torch import nn
from deepspeed.pipe import LayerSpec

from bamboo.model.forms import pipeline_model

CONTEXT, D = 16, 16


class Mix(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build(vocab_size: int = 256):
    specs = [LayerSpec(nn.Embedding, vocab_size, D), LayerSpec(Mix, D), LayerSpec(Mix, D),
             LayerSpec(nn.Linear, D, vocab_size)]
    return pipeline_model(specs, loss=loss_fn, context=CONTEXT, vocab_size=vocab_size)
"""


def _killed_equals_clean(name: str, tmp_path: Path) -> None:
    common = dict(model=name, nodes=4, stages=4, steps=5, micro_batches=2, micro_batch_size=2)
    clean = run_in_process(config(common), tmp_path / "clean")
    cfg = config(common, kills=["0:1@2"])
    killed = run_in_process(cfg, tmp_path / "killed")
    assert clean["status"] == killed["status"] == "completed", killed.get("error")
    assert killed["failovers"] == 1 == killed["preemptions"]
    assert killed["checkpoint_restores"] == killed["redone_steps"] == 0
    assert killed["param_sha256"] == clean["param_sha256"]
    assert killed["losses"] == clean["losses"]
    losses, params = train_reference(cfg)
    assert_close(killed["losses"], losses, rel=REL)
    assert_close(killed["param_l2"], param_l2(params), rel=REL)


@pytest.mark.timeout(300)
def test_an_nn_sequential_killed_in_flight_ends_equal_to_its_failure_free_run(
        tmp_path: Path) -> None:
    """Its children are sent by value: every worker calls build() and gets the same
    parameters, so a shadow's replica and the reference loop hold what the primary holds."""
    path = write_module(tmp_path, "sequential_model", SEQUENTIAL)
    _killed_equals_clean(f"{path}:build", tmp_path)


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (pip install 'bamboo-train[deepspeed]')")
def test_deepspeed_layer_specs_killed_in_flight_end_equal_to_their_failure_free_run(
        tmp_path: Path) -> None:
    path = write_module(tmp_path, "layer_spec_model", LAYER_SPECS)
    _killed_equals_clean(f"{path}:build", tmp_path)


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (pip install 'bamboo-train[deepspeed]')")
def test_a_deepspeed_pipeline_module_converts_with_its_loss_fn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real PipelineModule (its constructor needs torch.distributed: a group of one
    process here): its LayerSpecs are the layers, its loss_fn the loss. DeepSpeed's
    shared-memory all-reduce op is marked unavailable, as on a machine without a compiler:
    a group of one never reduces, and building it costs a minute and a half on two cores."""
    import deepspeed.comm
    import deepspeed.ops
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule
    from torch import nn

    from bamboo.model.api import TensorSpec
    from bamboo.model.forms import pipeline_model

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        loss = nn.CrossEntropyLoss()
        module = PipelineModule(layers=[LayerSpec(nn.Embedding, 40, 4), nn.Tanh(),
                                        LayerSpec(nn.Linear, 4, 40), lambda x: x.transpose(1, 2)],
                                num_stages=1, loss_fn=loss)
        model = pipeline_model(module, context=6, vocab_size=40)
    finally:
        dist.destroy_process_group()
    assert model.loss is loss and model.description == "DeepSpeed PipelineModule"
    assert model.boundaries == (TensorSpec((6, 4)), TensorSpec((6, 4)), TensorSpec((6, 40)),
                                TensorSpec((40, 6)))
    logits = torch.nn.Sequential(*(make() for make in model.layers))(torch.zeros(2, 6).long())
    assert float(model.loss(logits, torch.zeros(2, 6).long()).detach()) > 0
