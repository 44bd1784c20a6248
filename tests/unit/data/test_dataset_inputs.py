"""A Dataset's inputs against what the model's layer 0 takes (`PipelineModel(inputs=...)`),
checked before any worker starts, in one line naming both: always when the model declares
its inputs; for a model that does not (`[context]` int64 token ids), when the Dataset's
inputs are token ids (one integer tensor)."""
from __future__ import annotations

import pytest
import torch

from bamboo.config import ConfigError, JobConfig
from bamboo.data.sizing import SIZING
from bamboo.data.user import check_job_data, job_task
from support.models import write_module

SOURCE = """
import torch
from torch import nn
from torch.utils.data import Dataset

from bamboo.model.api import PipelineModel, TensorSpec


class Samples(Dataset):
    \"\"\"8 samples of `kind`'s inputs, label i % 3.\"\"\"

    def __init__(self, kind: str = "images", length: int = 6) -> None:
        self.kind, self.length = kind, length

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        ids = torch.arange(self.length) % 10
        inputs = {"images": torch.full((3, 8, 8), i / 8.0), "ids": ids,
                  "int32": ids.to(torch.int32), "pairs": (ids, ids > 0)}[self.kind]
        return inputs, torch.tensor(i % 3)


class Pool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, x):
        ids, mask = x
        return self.embed(ids) * mask[..., None]


def images():
    return PipelineModel(layers=[lambda: nn.Flatten(), lambda: nn.Linear(192, 3)],
                         inputs=TensorSpec((3, 8, 8)), boundary=TensorSpec((192,)),
                         output=TensorSpec((3,)), context=1)


def tokens(vocab_size: int = 10):
    return PipelineModel(layers=[lambda: nn.Embedding(vocab_size, 4),
                                 lambda: nn.Sequential(Pool(), nn.Linear(4, 3))],
                         boundary=TensorSpec((6, 4)), output=TensorSpec((3,)), context=6,
                         vocab_size=vocab_size)


def pairs(vocab_size: int = 10):
    return PipelineModel(layers=[Masked, lambda: nn.Sequential(Pool(), nn.Linear(4, 3))],
                         inputs=(TensorSpec((6,), torch.int64), TensorSpec((6,), torch.bool)),
                         boundary=TensorSpec((6, 4)), output=TensorSpec((3,)), context=6,
                         vocab_size=vocab_size)
"""


@pytest.fixture(scope="module")
def mine(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_module(tmp_path_factory.mktemp("inputs"), "dataset_inputs", SOURCE))


def _job(mine: str, model: str, dataset: str, **flags: object) -> JobConfig:
    base = dict(model=f"{mine}:{model}", dataset=f"{mine}:{dataset}", nodes=2, stages=2,
                micro_batches=2, micro_batch_size=4, steps=2)
    return JobConfig.of(**(base | flags)).validate(SIZING)


@pytest.mark.parametrize("model, dataset", [
    ("images", "Samples(kind='images')"),
    ("tokens", "Samples(kind='ids')"),
    ("pairs", "Samples(kind='pairs')"),
    ("tokens", "Samples(kind='images')"),  # not token ids, no inputs declared: not checked
])
def test_inputs_that_match_pass(mine: str, model: str, dataset: str) -> None:
    check_job_data(_job(mine, model, dataset, loss="torch.nn.functional:cross_entropy"))


@pytest.mark.parametrize("model, dataset, expected", [
    ("images", "Samples(kind='ids')", "--dataset {mine}:Samples(kind='ids'): a sample's inputs "
     "are int64 [6] but the model's layer 0 takes float32 [3, 8, 8] (PipelineModel(inputs=...))"),
    ("tokens", "Samples(kind='ids', length=8)", "--dataset {mine}:Samples(kind='ids', length=8):"
     " a sample's inputs are int64 [8] but the model's layer 0 takes int64 [6] (token ids, the "
     "default: declare what it takes with PipelineModel(inputs=...))"),
    ("tokens", "Samples(kind='int32')", "a sample's inputs are int32 [6] but the model's layer 0 "
     "takes int64 [6] (token ids, the default"),
    ("pairs", "Samples(kind='ids')", "a sample's inputs are int64 [6] but the model's layer 0 "
     "takes (int64 [6], bool [6]) (PipelineModel(inputs=...))"),
    ("images", "Samples(kind='pairs')", "a sample's inputs are (int64 [6], bool [6]) but the "
     "model's layer 0 takes float32 [3, 8, 8]"),
])
def test_inputs_that_do_not_match_are_one_line_naming_both(mine: str, model: str, dataset: str,
                                                           expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_job_data(_job(mine, model, dataset))
    text = str(e.value)
    assert expected.format(mine=mine) in text and "\n" not in text, text


def test_the_held_out_dataset_is_checked_too(mine: str) -> None:
    cfg = _job(mine, "images", "Samples(kind='images')", eval_dataset=f"{mine}:Samples(kind='ids')",
               eval_every=1)
    with pytest.raises(ConfigError, match=r"^--eval-dataset .*Samples\(kind='ids'\): a sample's "
                                          r"inputs are int64 \[6\] but the model's layer 0 takes "
                                          r"float32 \[3, 8, 8\]"):
        check_job_data(cfg)


def test_a_tuple_of_inputs_reaches_layer_0_as_a_tuple(mine: str) -> None:
    """torch's default_collate makes a sample's tuple a list; layer 0 gets the tuple the
    model declares."""
    batch = job_task(_job(mine, "pairs", "Samples(kind='pairs')"), None).batch(0, 0)
    assert isinstance(batch.inputs, tuple) and len(batch.inputs) == 2
    ids, mask = batch.inputs
    assert (ids.shape, ids.dtype, mask.dtype) == ((4, 6), torch.int64, torch.bool)
    assert torch.equal(mask, ids > 0)


def test_float_inputs_reach_layer_0_unchanged(mine: str) -> None:
    task = job_task(_job(mine, "images", "Samples(kind='images')"), None)
    batch = task.batch(1, 0)
    indices = task.sample_indices(1, 0)
    assert batch.inputs.dtype == torch.float32 and batch.inputs.shape == (4, 3, 8, 8)
    assert torch.equal(batch.inputs[:, 0, 0, 0], torch.tensor(indices) / 8.0)
