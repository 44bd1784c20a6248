"""What layer 0 takes, declared by the model (`PipelineModel(inputs=...)`,
`pipeline_model(obj, inputs=...)` or an `inputs` attribute): validated in one line, fed to
the start-up trace and to the forms' shape derivation as zeros of that structure, and
`[context]` int64 token ids when not declared, as before. A model with declared inputs
needs no vocabulary."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from bamboo.config import ConfigError, JobConfig
from bamboo.config.presets import custom_preset
from bamboo.data.sizing import SIZING
from bamboo.model import boundary_shapes, build_layer, layer_param_counts
from bamboo.model.api import ModelError, PipelineModel, TensorSpec, load_model
from bamboo.model.forms import pipeline_model
from bamboo.model.pipeline import describe_spec, zeros_of
from support.models import write_module

MODELS = """
import torch
from torch import nn

from bamboo.model.api import PipelineModel, TensorSpec

class Conv(nn.Module):
    \"\"\"[B, 3, 8, 8] float images -> [B, 4, 8] (4 rows of 8 features).\"\"\"

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 4:
            raise TypeError(f"images are float32 [B, C, H, W], not {x.dtype} {list(x.shape)}")
        return self.conv(x)[:, 0, :4, :]


class Masked(nn.Module):
    \"\"\"(ids [B, 6], mask [B, 6]) -> [B, 6, 4], zero where the mask is False.\"\"\"

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ids, mask = x
        return self.embed(ids) * mask[..., None]


class Features(nn.Module):
    \"\"\"{'x': [B, 5] float, 'keep': [B, 5] bool} -> [B, 5, 2].\"\"\"

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 2)

    def forward(self, x: dict) -> torch.Tensor:
        return self.fc((x["x"] * x["keep"])[..., None])


def images():
    return PipelineModel(layers=[Conv, lambda: nn.Flatten(), lambda: nn.Linear(32, 3)],
                         inputs=TensorSpec((3, 8, 8)),
                         boundary=[TensorSpec((4, 8)), TensorSpec((32,))],
                         output=TensorSpec((3,)), context=4)


def pairs(vocab_size: int = 10):
    return PipelineModel(layers=[Masked, lambda: nn.Linear(4, vocab_size)],
                         inputs=(TensorSpec((6,), torch.int64), TensorSpec((6,), torch.bool)),
                         boundary=TensorSpec((6, 4)), context=6, vocab_size=vocab_size)


def features():
    return PipelineModel(layers=[Features, lambda: nn.Linear(2, 3)],
                         inputs={"x": TensorSpec((5,)), "keep": TensorSpec((5,), torch.bool)},
                         boundary=TensorSpec((5, 2)), output=TensorSpec((5, 3)), context=5)


def wrong_images():
    return PipelineModel(layers=[Conv, lambda: nn.Flatten()], inputs=TensorSpec((1, 8, 8)),
                         boundary=TensorSpec((4, 8)), output=TensorSpec((32,)), context=4)


def tokens_into_conv(vocab_size: int = 256):
    return PipelineModel(layers=[Conv], output=TensorSpec((4, 8)), context=4,
                         vocab_size=vocab_size)


def regression_loss(output, targets):
    if not targets.dtype.is_floating_point:
        raise TypeError(f"targets are float values, not {targets.dtype}")
    return (output - targets).square().mean()


def per_position(vocab_size: int = 256):
    return PipelineModel(layers=[lambda: nn.Linear(1, 3)], inputs=TensorSpec((5, 1)),
                         output=TensorSpec((5, 3)), context=5, vocab_size=vocab_size,
                         loss=regression_loss)


class Samples(torch.utils.data.Dataset):
    \"\"\"Two blank images, class 0.\"\"\"

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return torch.zeros(3, 8, 8), 0


def sequential():
    model = nn.Sequential(Conv(), nn.Flatten(), nn.Linear(32, 3))
    model.context, model.inputs = 4, TensorSpec((3, 8, 8))
    return model
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_module(tmp_path_factory.mktemp("inputs"), "input_models", MODELS))


def test_the_default_is_token_ids_and_unchanged() -> None:
    model = PipelineModel(layers=[lambda: nn.Embedding(30, 4), lambda: nn.Linear(4, 30)],
                          boundary=TensorSpec((7, 4)), context=7, vocab_size=30)
    assert model.inputs is None
    assert model.input_spec == TensorSpec((7,), torch.int64)
    assert model.boundaries == (TensorSpec((7, 4)), TensorSpec((7, 30)))
    fed = zeros_of(model.input_spec)
    assert fed.shape == (1, 7) and fed.dtype == torch.int64 and not fed.any()


@pytest.mark.parametrize("inputs, expected", [
    (TensorSpec((3, 8, 8)), TensorSpec((3, 8, 8))),
    (TensorSpec((6,), torch.int64), TensorSpec((6,), torch.int64)),  # no float needed
    ((TensorSpec((6,), torch.int64), TensorSpec((6,), torch.bool)), None),
    ({"ids": TensorSpec((6,), torch.int64), "mask": (TensorSpec((6,), torch.bool),)}, None),
])
def test_inputs_of_any_dtype_and_structure_are_declared(inputs: object,
                                                        expected: object) -> None:
    model = PipelineModel(layers=[lambda: nn.Linear(2, 2)], output=TensorSpec((2,)),
                          context=6, inputs=inputs)
    assert model.input_spec == (expected or inputs) and model.vocab_size is None


@pytest.mark.parametrize("inputs, expected", [
    ([TensorSpec((3,))], "PipelineModel inputs is list, not a TensorSpec, or a tuple or a dict "
                         "of them"),
    ((3, 8, 8), "PipelineModel inputs (3, 8, 8) is a shape, not a TensorSpec: write "
                "TensorSpec((3, 8, 8)), with its dtype unless torch.float32"),
    ((TensorSpec((3,)), 3), "PipelineModel inputs must be a TensorSpec, or a tuple or a dict of "
                            "str to TensorSpecs (got int at [1] in "),
    ((), "PipelineModel inputs () holds no TensorSpec"),
    ({1: TensorSpec((3,))}, "PipelineModel inputs must be a TensorSpec, or a tuple or a dict"),
    ("ids", "PipelineModel inputs is str, not a TensorSpec"),
])
def test_bad_inputs_are_one_line(inputs: object, expected: str) -> None:
    with pytest.raises(ModelError) as e:
        PipelineModel(layers=[lambda: nn.Linear(2, 2)], output=TensorSpec((2,)), context=6,
                      inputs=inputs)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value), str(e.value)


def test_vocab_size_is_needed_only_for_the_default_next_token_output() -> None:
    """Without it the model is open (its output traced when it is loaded); fed token ids
    (no Dataset) it needs one, and the line says where to give it."""
    open_model = PipelineModel(layers=[lambda: nn.Embedding(10, 2)], context=6)
    assert open_model.is_open and open_model.boundaries == ()
    with pytest.raises(ModelError, match=r"^PipelineModel, no vocab_size for the token ids it "
                                         r"is fed without a Dataset: train it on a Dataset "
                                         r"\(dataset=, --dataset\), whose first sample gives "
                                         r"its shapes, or give PipelineModel\(vocab_size=N\)$"):
        pipeline_model(open_model)
    assert pipeline_model(open_model, vocab_size=10).boundaries == (TensorSpec((6, 2)),)
    with pytest.raises(ModelError, match=r"^PipelineModel vocab_size=0 is not a positive integer$"):
        PipelineModel(layers=[lambda: nn.Linear(2, 2)], context=6, vocab_size=0,
                      output=TensorSpec((2,)))


def test_the_trace_feeds_float_images(models: str) -> None:
    """Layer 0 raises on anything but float32 [B, C, H, W]: the trace fed it images."""
    model = load_model(f"{models}:images")
    assert model.vocab_size is None and model.input_spec == TensorSpec((3, 8, 8))
    layer = build_layer(custom_preset(f"{models}:images", sizer=SIZING.model), 0, seed=1)
    assert layer(zeros_of(model.input_spec, batch=2)).shape == (2, 4, 8)


@pytest.mark.parametrize("function, inputs", [
    ("pairs", (TensorSpec((6,), torch.int64), TensorSpec((6,), torch.bool))),
    ("features", {"x": TensorSpec((5,)), "keep": TensorSpec((5,), torch.bool)}),
])
def test_the_trace_feeds_tuples_and_dicts(models: str, function: str, inputs: object) -> None:
    model = load_model(f"{models}:{function}")
    assert model.input_spec == inputs
    x = zeros_of(inputs)
    layer = build_layer(custom_preset(f"{models}:{function}", sizer=SIZING.model), 0, seed=1)
    assert layer(x).shape == (1, *model.boundaries[0].shape)


def test_bool_inputs_are_fed_true_and_the_rest_zeros() -> None:
    x = zeros_of({"x": TensorSpec((5,)), "keep": (TensorSpec((5,), torch.bool),)}, batch=2)
    assert x["x"].shape == (2, 5) and x["x"].dtype == torch.float32 and not x["x"].any()
    assert isinstance(x["keep"], tuple) and x["keep"][0].dtype == torch.bool
    assert x["keep"][0].all()


def test_a_model_without_a_vocabulary_is_sized_with_none(models: str) -> None:
    p = custom_preset(f"{models}:images", sizer=SIZING.model)
    assert (p.vocab, p.context, p.layers) == (0, 4, 3)
    assert len(layer_param_counts(p)) == 3
    assert [s.shape for s in boundary_shapes(p, 2)] == [(2, 4, 8), (2, 32), (2, 3)]


@pytest.mark.parametrize("function, expected", [
    ("wrong_images", "layer 0 failed on its inputs, one sample of float32 [1, 8, 8]: "
                     "RuntimeError: "),
    ("tokens_into_conv", "layer 0 failed on its inputs, one sample of int64 [4] (token ids, "
                         "the default: declare what layer 0 takes with "
                         "PipelineModel(inputs=...)): TypeError: images are float32 [B, C, H, "
                         "W], not torch.int64 [1, 4]"),
])
def test_what_the_trace_fed_is_in_the_line(models: str, function: str, expected: str) -> None:
    with pytest.raises(ModelError) as e:
        load_model(f"{models}:{function}")
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_loss_is_not_tried_on_token_targets_when_the_inputs_are_declared(models: str) -> None:
    """Per-position outputs of a model with declared inputs take a Dataset's labels (float
    ones here), not `[1, context]` token targets."""
    model = load_model(f"{models}:per_position")
    assert model.boundaries == (TensorSpec((5, 3)),) and model.loss.__name__ == "regression_loss"


def test_forms_take_inputs_as_a_keyword_or_an_attribute(models: str) -> None:
    seq = nn.Sequential(nn.Conv2d(3, 2, 3, padding=1), nn.Flatten(), nn.Linear(128, 5))
    model = pipeline_model(seq, context=1, inputs=TensorSpec((3, 8, 8)))
    assert model.boundaries == (TensorSpec((2, 8, 8)), TensorSpec((128,)), TensorSpec((5,)))
    assert model.vocab_size is None and model.inputs == TensorSpec((3, 8, 8))
    by_attribute = load_model(f"{models}:sequential")
    assert by_attribute.inputs == TensorSpec((3, 8, 8)) and by_attribute.vocab_size is None
    assert by_attribute.boundaries[-1] == TensorSpec((3,))
    with pytest.raises(ModelError, match=r"^Sequential, no vocab_size for the token ids "):
        pipeline_model(nn.Sequential(nn.Embedding(30, 4)), context=3)  # token ids: needs one


def test_forms_say_what_they_fed_when_the_shapes_cannot_be_found() -> None:
    seq = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Linear(7, 5))
    with pytest.raises(ModelError) as e:
        pipeline_model(seq, context=1, inputs=TensorSpec((3, 8, 8)))
    assert ("Sequential, cannot find the tensors between layers on a batch of one sample of "
            "its inputs float32 [3, 8, 8] (layer 1 (Linear) got float32 [1, 2, 6, 6] and raised "
            "RuntimeError: ") in str(e.value)
    with pytest.raises(ModelError, match=r"^Sequential, PipelineModel inputs is list, not a "):
        pipeline_model(seq, context=1, inputs=[TensorSpec((3, 8, 8))])


def test_specs_and_samples_are_described_alike() -> None:
    assert describe_spec(TensorSpec((3, 32, 32))) == "float32 [3, 32, 32]"
    assert describe_spec((TensorSpec((6,), torch.int64), TensorSpec((6,), torch.bool))) == \
        "(int64 [6], bool [6])"
    assert describe_spec({"x": torch.zeros(2, 5)}) == "{'x': float32 [2, 5]}"
    assert describe_spec((torch.zeros((), dtype=torch.int64),)) == "(int64 [],)"


def _job(**flags: object) -> JobConfig:
    return JobConfig.of(**({"nodes": 1, "stages": 1, "steps": 1} | flags))


def test_a_dataset_job_needs_no_byte_vocabulary(models: str, tmp_path: Path) -> None:
    """Byte tokens 0..255 are the synthetic data's and a text file's: a model without a
    vocabulary (or a small one) is refused for them, in one line, and trains on a Dataset."""
    with pytest.raises(ConfigError) as e:
        _job(model=f"{models}:images").validate(SIZING)
    assert str(e.value) == (f"--model '{models}:images': has no vocab_size, and byte tokens "
                            f"0..255 need one (the synthetic data and text files): give "
                            f"vocab_size a default of 256 or more, or train on a --dataset")
    text = tmp_path / "text.txt"
    text.write_text("some text to train on " * 20)
    with pytest.raises(ConfigError, match=r"vocab_size=10 is too small for byte tokens 0\.\.255"):
        _job(model=f"{models}:pairs", data=str(text)).validate(SIZING)
    _job(model=f"{models}:images", dataset=f"{models}:Samples()").validate(SIZING)
    _job(model=f"{models}:pairs", dataset=f"{models}:Samples()").validate(SIZING)
