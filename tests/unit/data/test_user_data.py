"""A user's Dataset, loss and metrics (`bamboo.data.user`, `bamboo.Job(dataset=...)`): built
by name as every worker builds them, and refused in one line before any worker starts."""
from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import bamboo
from bamboo.config import ConfigError, JobConfig
from bamboo.data.sizing import SIZING
from bamboo.data.user import (
    DatasetSamples,
    check_job_data,
    check_resume_position,
    data_position,
    job_task,
)
from support.models import write_module
from support.user_data import (
    DATASET,
    EVAL_DATASET,
    LOSS,
    METRIC,
    MODEL,
    SmoothedLoss,
    TokenClasses,
    accuracy,
    smoothed_loss,
)

SOURCE = """
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset


class Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(2), torch.zeros(())


def stream():
    return Stream()


def loader():
    return DataLoader([(torch.zeros(2), torch.zeros(()))])


class Pairs(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"x": torch.full((2,), float(i)), "mask": torch.ones(2, dtype=torch.bool)}, \\
            (torch.tensor(i), torch.tensor(-i))


class Broken(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise KeyError(i)


def firsts(samples):
    return samples[0]
"""


@pytest.fixture
def mine(tmp_path: Path) -> str:
    return str(write_module(tmp_path, "mydata", SOURCE))


def _job(**flags) -> JobConfig:
    base = dict(model=MODEL, nodes=2, stages=2, micro_batches=2, micro_batch_size=4, steps=4)
    return JobConfig.of(**(base | flags)).validate(SIZING)


def test_the_job_task_takes_its_dataset_loss_and_metrics_by_name() -> None:
    cfg = _job(dataset=DATASET, eval_dataset=EVAL_DATASET, loss=LOSS, metrics=[METRIC])
    task = job_task(cfg, cfg.model_preset(SIZING))
    batch = task.batch(1, 1)
    expected = [TokenClasses(40)[i] for i in task.sample_indices(1, 1)]
    assert torch.equal(batch.inputs, torch.stack([x for x, _ in expected]))
    assert torch.equal(batch.targets, torch.stack([y for _, y in expected]))
    held = task.eval_batch(1)  # the held-out set in order
    assert torch.equal(held.inputs, torch.stack([TokenClasses(16, seed=99)[i][0]
                                                 for i in range(4, 8)]))
    out = torch.randn(4, 8, 4)
    assert torch.equal(task.loss(out, batch.targets), smoothed_loss(out, batch.targets, 0.1))
    assert not torch.equal(task.loss(out, batch.targets), smoothed_loss(out, batch.targets))
    assert list(task.metrics) == ["accuracy"]
    assert torch.equal(task.metrics["accuracy"](out, batch.targets), accuracy(out, batch.targets))


def test_a_loss_class_is_made_with_its_arguments() -> None:
    cfg = _job(dataset=DATASET, loss="torch.nn:CrossEntropyLoss(label_smoothing=0.2)")
    loss = job_task(cfg, None).loss
    assert isinstance(loss, torch.nn.CrossEntropyLoss) and loss.label_smoothing == 0.2


def test_tuple_and_dict_samples_are_collated_as_torch_does(mine: str) -> None:
    cfg = _job(dataset=f"{mine}:Pairs")
    batch = job_task(cfg, None).batch(0, 0)
    assert set(batch.inputs) == {"x", "mask"} and batch.inputs["x"].shape == (4, 2)
    assert batch.inputs["mask"].dtype == torch.bool
    first, second = batch.targets
    assert torch.equal(first, -second) and first.shape == (4,)
    custom = job_task(_job(dataset=f"{mine}:Pairs", collate=f"{mine}:firsts"), None)
    assert custom.batch(0, 0).inputs["x"].shape == (2,)  # the user's collate: sample 0 only


@pytest.mark.parametrize("flags, expected", [
    ({"dataset": "{mine}:stream"}, "--dataset {mine}:stream gave an IterableDataset, which "
     "bamboo cannot replay (a step must be replayable: bamboo picks every step's sample "
     "indices itself, so any node can redo it after a failure): pass a map-style Dataset"),
    ({"dataset": "{mine}:loader"}, "gave a DataLoader, which bamboo cannot replay"),
    ({"dataset": "{mine}:Broken"}, "--dataset: its first micro-batch failed: KeyError: "),
    ({"dataset": "{mine}:nothing"}, "has no callable 'nothing'"),
    ({"dataset": "{mine}:Pairs", "eval_every": 2}, "--eval-every with --dataset needs "
                                                    "--eval-dataset"),
    ({"dataset": "{mine}:Pairs", "eval_dataset": "{mine}:Broken", "eval_every": 2},
     "--eval-dataset: its first micro-batch failed"),
    ({"loss": "{mine}:Stream(size=3)"}, "--loss {mine}:Stream(size=3): TypeError"),
    ({"dataset": DATASET, "loss": "torch.nn:CrossEntropyLoss"}, "--loss: the loss failed on "
     "the model's output [4, 8, 4] and the labels [4, 8]: RuntimeError: Expected target size"),
    ({"dataset": DATASET, "metrics": ["top=torch:argmax"]}, "--metric: the metric 'top' failed "
     "on the model's output [4, 8, 4]"),
    ({"dataset": DATASET, "metrics": ["per_token=torch.nn.functional:cross_entropy("
                                      "reduction='none')"]},
     "--metric: the metric 'per_token' failed on the model's output"),
])
def test_bad_data_is_one_line_before_any_worker(mine: str, flags: dict, expected: str) -> None:
    cfg = _job(**{k: v.format(mine=mine) if isinstance(v, str) else v
                  for k, v in flags.items()})
    with pytest.raises(ConfigError) as e:
        check_job_data(cfg)
    text = str(e.value)
    assert expected.format(mine=mine) in text and "\n" not in text, text


class _Stream(IterableDataset):
    def __iter__(self):
        yield 1


def _make() -> list:
    return []


@pytest.mark.parametrize("kwargs, expected", [
    ({"dataset": DataLoader([1, 2])}, "Job: dataset= is a DataLoader, which bamboo cannot "
     "replay (a step must be replayable"),
    ({"dataset": _Stream()}, "Job: dataset= is an IterableDataset, which bamboo cannot replay"),
    ({"dataset": 42}, "Job: dataset= takes a map-style Dataset, or a function or class that "
     "returns one, or 'MODULE:NAME(ARGS)' text (got int)"),
    ({"loss": "x"}, "Job: loss: 'x' is not MODULE:NAME"),
    ({"metrics": {"acc": functools.partial(accuracy, 3)}}, "positional arguments"),
])
def test_the_api_refuses_what_cannot_be_replayed_or_rebuilt(kwargs: dict, expected: str) -> None:
    with pytest.raises(bamboo.JobError) as e:
        bamboo.Job(**kwargs)
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_api_writes_the_flags_values() -> None:
    job = bamboo.Job(model=MODEL, dataset=TokenClasses, loss=smoothed_loss,
                     metrics={"accuracy": accuracy}, collate=_make, nodes=2, stages=2)
    here = "support.user_data"
    assert job.config.data.dataset == f"{here}:TokenClasses()"
    assert job.config.training.loss == f"{here}:smoothed_loss()"
    assert job.config.training.metrics == [f"accuracy={here}:accuracy()"]
    assert job.config.data.collate == f"{__name__}:_make()"
    partial = bamboo.Job(dataset=functools.partial(TokenClasses, n=12), eval_dataset=DATASET,
                         loss="torch.nn:CrossEntropyLoss(label_smoothing=0.1)")
    assert partial.config.data.dataset == f"{here}:TokenClasses(n=12)"
    assert partial.config.data.eval_dataset == DATASET


def test_objects_and_lambdas_are_sent_by_value() -> None:
    """A small Dataset object, a loss module and a lambda metric have no import path: they
    reach the workers pickled (`bamboo.config.objects`), named by their digest."""
    job = bamboo.Job(model=MODEL, dataset=TokenClasses(12), eval_dataset=TokenClasses(4, seed=5),
                     loss=SmoothedLoss(0.1),
                     metrics={"mean": lambda out, labels: out.mean()}, nodes=2, stages=2)
    cfg = job.config
    assert cfg.data.dataset.startswith("bamboo.config.objects:sha256_")
    assert cfg.training.metrics[0].startswith("mean=bamboo.config.objects:sha256_")
    task = job_task(cfg, None)
    assert task.samples.size == 12 and task.samples.eval_size == 4
    assert isinstance(task.loss, SmoothedLoss) and task.loss.smoothing == 0.1
    batch = task.batch(0, 0)
    assert torch.equal(batch.inputs[0], TokenClasses(12)[task.sample_indices(0, 0)[0]][0])
    assert float(task.metrics["mean"](torch.ones(2, 3), None)) == 1.0
    check_job_data(cfg)


def test_a_resume_checks_where_the_run_stands_in_its_dataset() -> None:
    cfg = _job(dataset=DATASET)
    here = data_position(cfg, 3)  # 3 steps of 2 x 4 samples over 40: epoch 0, 24
    assert here == {"dataset": DATASET, "epoch": 0, "position": 24, "samples": 24,
                    "dataset_size": 40}
    assert data_position(cfg, 6)["epoch"] == 1 and data_position(cfg, 6)["position"] == 8
    check_resume_position(cfg, {"losses": [1.0] * 3, "data": here}, 3, "ckpt")
    other = DATASET.replace("n=40", "n=41")
    with pytest.raises(ConfigError, match=r"ckpt stands at epoch 0 position 24 of a dataset of 40 "
                                          r"samples .*this job would be at epoch 0 position 24 "
                                          r"of 41"):
        check_resume_position(_job(dataset=other), {"losses": [], "data": here}, 3, "ckpt")
    with pytest.raises(ConfigError, match="was trained on bamboo's own data, this job on "
                                          "--dataset"):
        check_resume_position(cfg, {"losses": [], "data": None}, 3, "ckpt")
    assert data_position(_job(), 3) is None
    check_resume_position(_job(), {"losses": [], "data": None}, 3, "ckpt")


def test_dataset_samples_report_their_sizes() -> None:
    samples = DatasetSamples(TokenClasses(5), TokenClasses(3))
    assert (samples.size, samples.eval_size) == (5, 3)
    assert math.isclose(float(accuracy(torch.eye(4)[None], torch.arange(4)[None])), 1.0)
