"""Models made in Python and sent by value (bamboo.config.objects) trained by
`bamboo.train` with a node killed in flight: an `nn.Sequential` built here (its classes
defined in this function, so no worker can import them) ends bit-equal to its failure-free
run and equal to the single-process loop; a layer list of lambdas and closures too."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import bamboo
from bamboo.model.forms import pipeline_model
from support.reference import train_reference
from support.runs import REL, assert_close, param_l2

pytestmark = [pytest.mark.procs, pytest.mark.slow]  # every test here starts processes

SHAPE = dict(nodes=4, stages=2, steps=4, micro_batches=2, micro_batch_size=2)
D, CONTEXT = 16, 16


def _mix_class() -> type[nn.Module]:
    class Mix(nn.Module):  # defined in a function: pickled by value, with its dropout
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln, self.fc, self.drop = nn.LayerNorm(d), nn.Linear(d, d), nn.Dropout(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.drop(torch.tanh(self.fc(self.ln(x))))

    return Mix


def _equals_the_single_process_loop(result: bamboo.RunResult, job: bamboo.Job) -> None:
    losses, params = train_reference(job.config)
    assert_close(result.losses, losses, rel=REL)
    assert_close(result.param_l2, param_l2(params), rel=REL)


@pytest.mark.timeout(300)
def test_models_sent_by_value_killed_in_flight_end_equal_to_their_failure_free_run(
        tmp_path: Path) -> None:
    mix = _mix_class()
    torch.manual_seed(5)
    model = nn.Sequential(nn.Embedding(256, D), mix(D), mix(D), nn.Linear(D, 256))
    model.context, model.vocab_size = CONTEXT, 256  # type: ignore[assignment]
    clean = bamboo.train(bamboo.Job(model=model, **SHAPE), out=tmp_path / "clean")
    job = bamboo.Job(model=model, kill=["0:1@2"], **SHAPE)
    killed = bamboo.train(job, out=tmp_path / "killed")
    assert killed.failovers == 1 == killed.preemptions
    assert killed.losses == clean.losses and killed.param_sha256 == clean.param_sha256
    assert killed.config["model"] == clean.config["model"] == job.config.model.name
    _equals_the_single_process_loop(killed, job)

    def block(width: int):  # a closure: each call a factory of its own layer
        return lambda: mix(width)

    layers = [lambda: nn.Embedding(256, D), block(D), block(D), lambda: nn.Linear(D, 256)]
    listed = bamboo.Job(model=pipeline_model(layers, context=CONTEXT, vocab_size=256),
                        kill=["1:0@1"], **SHAPE)
    result = bamboo.train(listed, out=tmp_path / "listed")
    assert result.failovers == 1
    _equals_the_single_process_loop(result, listed)
