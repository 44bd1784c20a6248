"""Your model as it is (bamboo.model.forms, bamboo.model.spec_text): shapes from a Dataset's
first sample for a model with no bamboo attribute, every process deriving the same from the
job; a build function called with only the keywords it declares; a first sample that does
not pass named by layer and shapes in one line that says nothing of context or vocab_size;
transformers objects bamboo cannot cut refused naming hf:DIR; a PipelineModule built for
several stages refused by value."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

import bamboo
from bamboo.config import ConfigError, JobConfig
from bamboo.data.sizing import SIZING
from bamboo.data.user import first_inputs
from bamboo.model.api import PipelineModel, TensorSpec, model_of
from bamboo.model.spec_text import Unreadable, spec_of_text, spec_text
from support.models import write_module
from support.your_model import IMAGES, TABULAR, TOKENS, image_model, tabular_model

SHAPE = dict(nodes=2, stages=2, micro_batches=2, micro_batch_size=4, steps=2)


@pytest.mark.parametrize("spec", [
    TensorSpec((20,)), TensorSpec((3, 8, 8), torch.float16),
    (TensorSpec((6,), torch.int64), TensorSpec((6,), torch.bool)),
    {"x": TensorSpec((5,)), "pair": (TensorSpec((2, 2), torch.int32),)},
])
def test_a_spec_travels_as_text_and_back(spec: object) -> None:
    assert spec_of_text(spec_text(spec)) == spec


def test_what_a_datasets_first_sample_hands_layer_0_is_read_per_sample() -> None:
    assert spec_of_text(first_inputs(TABULAR, None)) == TensorSpec((20,))
    assert spec_of_text(first_inputs(IMAGES, None)) == TensorSpec((3, 8, 8))
    assert spec_of_text(first_inputs(TOKENS, None)) == TensorSpec((8,), torch.int64)
    broken = spec_of_text(first_inputs("torch.utils.data:TensorDataset()", None))
    assert isinstance(broken, Unreadable) and "len() of the Dataset failed" in broken.reason


@pytest.mark.parametrize("make, dataset, boundaries", [
    (tabular_model, TABULAR, (TensorSpec((64,)), TensorSpec((32,)), TensorSpec((2,)))),
    (image_model, IMAGES, (TensorSpec((8, 8, 8)), TensorSpec((8, 4, 4)), TensorSpec((3,)))),
])
def test_a_plain_sequential_gets_its_shapes_from_the_dataset(make, dataset: str,
                                                              boundaries: tuple) -> None:
    """No context, vocab_size or inputs on it: the job's preset carries the first sample's
    inputs, so every process that reads the job builds the same model."""
    model = make()
    job = bamboo.Job(model=model, dataset=dataset, **SHAPE)
    p = job.config.model_preset(SIZING)
    assert spec_of_text(p.inputs) == spec_of_text(first_inputs(dataset, None))
    again = JobConfig.of(**job.options()).model_preset(SIZING)  # as a worker reads the job
    assert again == p
    built = model_of(p)
    assert built.boundaries == boundaries and built.vocab_size is None
    assert built.inputs == spec_of_text(p.inputs) and built.context == 1
    first = built.layers[0]()
    assert torch.equal(first.weight, model[0].weight) and first.weight is not model[0].weight


def test_a_build_function_is_called_with_only_the_keywords_it_declares(tmp_path: Path) -> None:
    source = ("from torch import nn\n\n\ndef build():\n"
              "    return nn.Sequential(nn.Linear(20, 8), nn.Linear(8, 2))\n")
    name = f"{write_module(tmp_path, 'no_keywords', source)}:build"
    cfg = JobConfig.of(model=name, dataset=TABULAR, **SHAPE).validate(SIZING)
    assert model_of(cfg.model_preset(SIZING)).boundaries == (TensorSpec((8,)), TensorSpec((2,)))


def test_a_first_sample_that_does_not_pass_names_the_layer_and_the_shapes(
        tmp_path: Path) -> None:
    """In the words of each interface, and of the model: no context, no vocab_size."""
    with pytest.raises(bamboo.JobError) as e:
        bamboo.Job(model=nn.Sequential(nn.Linear(20, 64), nn.Linear(32, 2)), dataset=TABULAR,
                   **SHAPE)
    assert str(e.value) == (
        "Job: model=Sequential, the Dataset's first sample (float32 [20] per sample) does not "
        "pass through it: layer 1 (Linear) got float32 [1, 64] and raised RuntimeError: mat1 "
        "and mat2 shapes cannot be multiplied (1x64 and 32x2)")
    source = ("from torch import nn\n\n\ndef build():\n"
              "    return [nn.Conv2d(3, 4, 3), nn.Linear(7, 2)]\n")
    name = f"{write_module(tmp_path, 'bad_images', source)}:build"
    with pytest.raises(ConfigError) as c:
        JobConfig.of(model=name, dataset=IMAGES, **SHAPE).validate(SIZING)
    text = str(c.value)
    assert text.startswith(f"--model '{name}': build() returned list, the Dataset's first "
                           f"sample (float32 [3, 8, 8] per sample) does not pass through it: "
                           f"layer 1 (Linear) got float32 [1, 4, 6, 6] and raised "
                           f"RuntimeError: "), text
    for message in (str(e.value), text):
        assert "\n" not in message and "context" not in message and "vocab" not in message


def test_a_dataset_that_cannot_be_read_is_said_by_a_model_that_needs_its_shapes() -> None:
    with pytest.raises(bamboo.JobError) as e:
        bamboo.Job(model=tabular_model(), dataset="torch.utils.data:TensorDataset()", **SHAPE)
    assert str(e.value).startswith(
        "Job: model=Sequential, its shapes come from the Dataset's first sample, which cannot "
        "be read: --dataset torch.utils.data:TensorDataset(): len() of the Dataset failed")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed")
def test_a_transformers_model_bamboo_cannot_cut_names_hf_dir_and_save_pretrained() -> None:
    from transformers import GPT2Config, GPT2Model
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=64)
    with pytest.raises(bamboo.JobError) as e:
        bamboo.Job(model=GPT2Model(config), **SHAPE)
    assert str(e.value) == (
        "Job: model=GPT2Model, bamboo trains a gpt2 model as GPT2LMHeadModel, not GPT2Model: "
        "save it with model.save_pretrained(DIR) and give model='hf:DIR', which bamboo trains "
        "as GPT2LMHeadModel, LlamaForCausalLM, BertForMaskedLM")


class _TwoStagePipelineModule(nn.Module):
    """DeepSpeed's PipelineModule as rank 0 of two stages builds it: layer 0 only."""

    def __init__(self) -> None:
        super().__init__()
        self._layer_specs = [nn.Linear(20, 4), nn.Linear(4, 2)]
        self.add_module("0", self._layer_specs[0])
        self.loss_fn = None


_TwoStagePipelineModule.__module__ = "deepspeed.runtime.pipe.module"


def test_a_pipeline_module_built_for_several_stages_is_refused_by_value() -> None:
    with pytest.raises(bamboo.JobError) as e:
        bamboo.Job(model=_TwoStagePipelineModule(), dataset=TABULAR, **SHAPE)
    assert str(e.value) == (
        "Job: model=_TwoStagePipelineModule, it was built for several stages and holds only "
        "its own stage's layers (not layer 1), so its parameters cannot all be sent: build it "
        "with num_stages=1 (bamboo cuts the stages), or give a function that builds it")


def test_a_pipeline_model_that_declares_only_its_layers_gets_its_shapes_from_the_dataset(
        ) -> None:
    """No boundary, context, vocab_size, inputs or output: open until the job's Dataset
    gives the first sample; its factories still build each layer under (seed, layer)."""
    model = PipelineModel(layers=[lambda: nn.Linear(20, 8), lambda: nn.Linear(8, 2)],
                          loss=nn.functional.cross_entropy)
    assert model.is_open and model.boundaries == ()
    p = bamboo.Job(model=model, dataset=TABULAR, **SHAPE).config.model_preset(SIZING)
    built = model_of(p)
    assert built.boundaries == (TensorSpec((8,)), TensorSpec((2,)))
    assert built.inputs == TensorSpec((20,)) and built.loss is not None and not built.is_open
    with pytest.raises(bamboo.JobError, match=r"^Job: model=PipelineModel, no context for the "
                                              r"token ids it is fed without a Dataset: "):
        bamboo.Job(model=model, **SHAPE)
