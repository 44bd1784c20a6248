"""`bamboo.Job(model=<object>)`: a model object, a lambda, a closure or a notebook's
function sent by value (bamboo.config.objects), loaded by every process from the same
bytes; what cannot be sent refused in one line before anything starts; the SHA-256 of the
bytes recorded in the job, and a resume with another model object refused."""
from __future__ import annotations

import sys
import tempfile
import threading
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import bamboo
from bamboo.api.start import check_same_job, launch
from bamboo.config import ConfigError, objects
from bamboo.model.api import PipelineModel, TensorSpec, load_model
from bamboo.model.forms import pipeline_model

SHAPE = dict(nodes=2, stages=2, steps=2, micro_batches=2, micro_batch_size=2)


@pytest.fixture(autouse=True)
def _machine_dir_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


def sequential(d: int = 8) -> nn.Sequential:
    torch.manual_seed(11)
    model = nn.Sequential(nn.Embedding(256, d), nn.Linear(d, d), nn.Tanh(), nn.Linear(d, 256))
    model.context, model.vocab_size = 8, 256  # type: ignore[assignment]  # attributes Bamboo reads off a plain module
    return model


def test_an_nn_sequential_is_sent_by_value_and_loaded_with_its_own_parameters() -> None:
    given = sequential()
    job = bamboo.Job(model=given, **SHAPE)
    ref = job.config.model.name
    assert objects.is_reference(ref)
    model = load_model(ref)
    assert isinstance(model, PipelineModel) and len(model.layers) == 4
    assert (model.context, model.vocab_size) == (8, 256)
    assert model.description == "Sequential sent by value"
    assert torch.equal(model.layers[0]().weight, given[0].weight)  # its parameters, not new ones
    assert model.layers[0]() is not given[0]
    assert repr(job).startswith(f"bamboo.Job(model='{objects.short(ref)}'")


def test_lambdas_closures_and_a_notebooks_function_are_sent_by_value(
        monkeypatch: pytest.MonkeyPatch) -> None:
    d = 8

    def block():
        return nn.Sequential(nn.Linear(d, d), nn.Tanh())

    layers = [lambda: nn.Embedding(256, d), block, block, lambda: nn.Linear(d, 256)]
    listed = bamboo.Job(model=pipeline_model(layers, context=8, vocab_size=256), **SHAPE)
    assert [s.shape for s in load_model(listed.config.model.name).boundaries] == \
        [(8, d)] * 3 + [(8, 256)]
    factory = bamboo.Job(model=lambda vocab_size=256: pipeline_model(
        [nn.Embedding(vocab_size, d), nn.Linear(d, vocab_size)], context=8,
        vocab_size=vocab_size), **SHAPE)
    assert load_model(factory.config.model.name).vocab_size == 256
    main = types.ModuleType("__main__")  # a notebook's or a REPL's: no file
    exec("from torch import nn\nfrom bamboo.model.forms import pipeline_model\n"
         "def build(vocab_size=256):\n"
         "    return pipeline_model([nn.Embedding(vocab_size, 4), nn.Linear(4, vocab_size)],"
         " context=8, vocab_size=vocab_size)\n", main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    notebook = bamboo.Job(model=main.build, **SHAPE)
    assert objects.is_reference(notebook.config.model.name)
    assert len(load_model(notebook.config.model.name).layers) == 2


def _generator_closure():
    batches = (i for i in range(3))
    return lambda vocab_size=256: next(batches)


@pytest.mark.parametrize("model, expected", [
    (nn.Sequential(nn.Embedding(256, 4), nn.Linear(4, 256)),
     "Job: model=Sequential, no context for the token ids it is fed without a Dataset: train "
     "it on a Dataset (dataset=, --dataset), whose first sample gives its shapes, or set its "
     "`context` attribute"),
    (nn.Linear(3, 3), "Job: model=Linear, one nn.Module, which bamboo cannot cut into layers"),
    (_generator_closure(), "Job: model: function cannot be sent by value (TypeError: cannot "
                           "pickle 'generator' object): define it at module level in a .py file"),
    (42, "Job: model= takes a preset name ('gpt2-mini'), 'MODULE:FUNCTION', a function that "
         "returns a model, or the model itself"),
])
def test_what_cannot_be_sent_is_refused_in_one_line(model: object, expected: str) -> None:
    with pytest.raises(bamboo.JobError) as e:
        bamboo.Job(model=model, **SHAPE)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value), str(e.value)


def test_a_model_over_8_mib_is_sent_by_value_with_its_parameters() -> None:
    """Once refused over 8 MiB: now any size travels (a file here, parts to an agent)."""
    big = nn.Sequential(nn.Embedding(256, 1500), nn.Linear(1500, 1500), nn.Linear(1500, 256))
    big.context, big.vocab_size = 4, 256  # type: ignore[assignment]  # attributes Bamboo reads off a plain module
    ref = bamboo.Job(model=big, **SHAPE).config.model.name
    assert len(objects.data_of(ref)) > 8 << 20
    middle = load_model(ref).layers[1]()
    assert torch.equal(middle.weight, big[1].weight) and middle.weight is not big[1].weight


def test_a_factorys_error_names_the_model_by_its_hash_not_its_whole_reference() -> None:
    with pytest.raises(bamboo.JobError) as e:
        bamboo.Job(model=lambda vocab_size=256: "not a model", **SHAPE)
    text = str(e.value)
    assert text.startswith("Job: model=the factory returned str"), text
    assert objects.PREFIX not in text


def test_the_run_directory_holds_the_bytes_and_a_resume_with_another_object_is_refused(
        tmp_path: Path) -> None:
    job = bamboo.Job(model=sequential(), out=tmp_path / "run", **SHAPE)
    ref = job.config.model.name
    start = launch(job.config, "test")
    saved = start.run.path / "objects" / f"{objects.digest_of(ref)}.pkl"
    assert saved.read_bytes() == objects.data_of(ref)
    assert job.options()["model"] == ref  # summary.json's config: by value, and its sha256
    check_same_job(job.config, {"model": ref}, "the run")
    other = bamboo.Job(model=sequential(d=4), **SHAPE).config.model.name
    for made_with, shown in ((other, objects.short(other)), ("gpt2-tiny", "'gpt2-tiny'")):
        with pytest.raises(ConfigError) as e:
            check_same_job(job.config, {"model": made_with}, "--resume R: its checkpoint")
        assert str(e.value) == (f"--resume R: its checkpoint was made with the model {shown}, "
                                f"this job gives {objects.short(ref)}: resume with the same "
                                f"model object (the same bytes), or use another --out for a "
                                f"new run")


class LayerSpec:
    """DeepSpeed's LayerSpec as bamboo.model.forms recognises it (by its interface)."""

    def __init__(self, typename: type, *module_args: object) -> None:
        self.typename, self.module_args = typename, module_args

    def build(self) -> nn.Module:
        return self.typename(*self.module_args)


class PipelineModule(nn.Module):
    """A DeepSpeed PipelineModule's shape (its type's module is deepspeed's), holding what
    cannot be pickled, as the real one holds its process groups."""

    def __init__(self, layers: list, loss_fn: object) -> None:
        super().__init__()
        self._layer_specs, self.loss_fn = layers, loss_fn
        self._grid = threading.Lock()
        self.context, self.vocab_size = 6, 256
        for i, layer in enumerate(layers):  # built on one stage, as DeepSpeed's _build does
            if isinstance(layer, (LayerSpec, nn.Module)):
                self.add_module(str(i), layer.build() if isinstance(layer, LayerSpec) else layer)


PipelineModule.__module__ = "deepspeed.runtime.pipe.module"


def test_a_pipeline_module_travels_as_its_layers_and_loss_without_its_groups() -> None:
    loss = nn.CrossEntropyLoss()
    module = PipelineModule([LayerSpec(nn.Embedding, 256, 4), nn.Tanh(),
                             LayerSpec(nn.Linear, 4, 256), lambda x: x.transpose(1, 2)], loss)
    model = load_model(bamboo.Job(model=module, **SHAPE).config.model.name)
    assert model.description == "PipelineModule sent by value" and len(model.layers) == 4
    assert isinstance(model.loss, nn.CrossEntropyLoss) and model.loss is not loss
    assert model.boundaries[-1] == TensorSpec((256, 6))
