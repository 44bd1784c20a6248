"""Other model forms (bamboo.model.forms): an nn.Sequential, a list of modules or of
factories, DeepSpeed LayerSpecs and a PipelineModule, converted to a PipelineModel with the
tensors between layers found on the meta device; what cannot be converted is one line.

Their runs killed in flight: tests/integration/test_model_forms_runs.py."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bamboo.config.presets import custom_preset
from bamboo.data.sizing import SIZING
from bamboo.model import boundary_shapes, build_layer, layer_param_counts, loss_fn
from bamboo.model.api import ModelError, PipelineModel, TensorSpec, load_model, next_token_loss
from bamboo.model.forms import pipeline_model
from bamboo.model.pipeline import boundary_spec
from support.models import write_module

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NO_DEEPSPEED = "deepspeed is not installed (pip install 'bamboo-train[deepspeed]')"

SEQUENTIAL = """
import torch
from torch import nn


def build(vocab_size: int = 256, context: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Embedding(vocab_size, 4), nn.Linear(4, 6), nn.Tanh(),
                         nn.Linear(6, vocab_size))
"""


STRUCTURED = """
import torch
from torch import nn


class Masked(nn.Module):
    def forward(self, h):
        return h, h[..., 0] > 0


class Apply(nn.Module):
    def forward(self, x):
        h, mask = x
        return h * mask[..., None]


def build(vocab_size: int = 30, context: int = 5) -> nn.Sequential:
    return nn.Sequential(nn.Embedding(vocab_size, 4), Masked(), Apply(),
                         nn.Linear(4, vocab_size))
"""


class LayerSpec:
    """A stand-in with DeepSpeed's LayerSpec interface (typename, module_args,
    module_kwargs, build()), for the duck-typed path without DeepSpeed."""

    def __init__(self, typename: type, *module_args: object, **module_kwargs: object) -> None:
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    def __init__(self, key: str, typename: type, *module_args: object) -> None:
        super().__init__(typename, *module_args)
        self.key, self.tied_weight_attr = key, ["weight"]


class PipelineModule(nn.Module):
    """A stand-in with DeepSpeed's PipelineModule attributes (`_layer_specs`, `loss_fn`), its
    type's module DeepSpeed's, built on one stage as DeepSpeed's `_build` builds it (layer
    i's module registered as `str(i)`, one module per tied key in `tied_modules`); the real
    one (it needs torch.distributed) is converted in
    tests/integration/test_model_forms_runs.py."""

    __module__ = "deepspeed.runtime.pipe.module"

    def __init__(self, layers: list, loss_fn: object) -> None:
        super().__init__()
        self._layer_specs, self.loss_fn = list(layers), loss_fn
        self.tied_modules = nn.ModuleDict()
        for i, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
            elif isinstance(layer, LayerSpec):
                self.add_module(str(i), layer.build())
            elif isinstance(layer, nn.Module):
                self.add_module(str(i), layer)


class Pairs(nn.Module):
    """Hands on a tuple: the hidden states and a bool mask of the even token ids."""

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h, h[..., 0] > 0


class Gated(nn.Module):
    """Takes the tuple and hands on a dict (hidden, mask, an int64 id per position)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        h, mask = x
        ids = torch.arange(h.shape[1], device=h.device).expand(h.shape[0], -1)
        return {"hidden": self.fc(h) * mask[..., None], "mask": mask, "ids": ids}


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(4, 30)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.out(x["hidden"])


class ReturnsList(nn.Module):
    def forward(self, h: torch.Tensor) -> list[torch.Tensor]:
        return [h, h]


class ReturnsNone(nn.Module):
    def forward(self, h: torch.Tensor) -> None:
        return None


class ReturnsCount(nn.Module):
    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        return x[0], 3


class MaskOnly(nn.Module):
    """A mask and ids, no floating tensor for the gradient to flow back through."""

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h[..., 0] > 0, h.argmax(-1)


def _sum_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return output.float().mean() + 0 * targets.float().mean()


def test_an_nn_sequential_is_one_layer_per_child_with_its_boundaries_found() -> None:
    seq = nn.Sequential(nn.Embedding(50, 4), nn.Linear(4, 6), nn.Linear(6, 50))
    model = pipeline_model(seq, context=5, vocab_size=50)
    assert isinstance(model, PipelineModel) and len(model.layers) == 3
    assert model.boundaries == (TensorSpec((5, 4)), TensorSpec((5, 6)), TensorSpec((5, 50)))
    assert model.loss is next_token_loss and model.description == "nn.Sequential"
    first, second = model.layers[1](), model.layers[1]()
    assert first is not second and first is not seq[1]  # a copy each time, by value
    assert torch.equal(first.weight, seq[1].weight) and torch.equal(second.weight, seq[1].weight)


def test_context_and_vocabulary_come_from_the_attributes_and_a_pipeline_model_stays() -> None:
    seq = nn.Sequential(nn.Embedding(30, 4), nn.Linear(4, 30))
    seq.context, seq.vocab_size = 7, 30
    model = pipeline_model(seq)
    assert (model.context, model.vocab_size, model.boundaries[0]) == (7, 30, TensorSpec((7, 4)))
    assert pipeline_model(model) is model


def test_given_boundaries_and_loss_are_kept() -> None:
    model = pipeline_model([nn.Embedding(30, 4), nn.Linear(4, 2)], context=3, vocab_size=30,
                           loss=_sum_loss, output=TensorSpec((3, 2)),
                           boundary=TensorSpec((3, 4)))
    assert model.boundaries == (TensorSpec((3, 4)), TensorSpec((3, 2)))
    assert model.loss is _sum_loss


def test_factories_are_built_under_the_seeded_stream_modules_by_value() -> None:
    """A factory draws its init from (seed, layer): another seed, other parameters. A module
    given by value is the same whatever the seed."""
    model = pipeline_model([lambda: nn.Embedding(30, 4), nn.Linear(4, 30)], context=3,
                           vocab_size=30)
    assert model.boundaries[-1] == TensorSpec((3, 30))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        a = model.layers[0]()
        torch.manual_seed(2)
        b = model.layers[0]()
        c, d = model.layers[1](), model.layers[1]()
    assert not torch.equal(a.weight, b.weight)
    assert torch.equal(c.weight, d.weight)


def test_every_process_builds_the_same_sequential(tmp_path: Path) -> None:
    """The build function runs in every process, whatever torch's generator holds there:
    two nodes (two loads from a different generator state) hold the same parameters, and
    the engine's layers, count and boundaries follow the Sequential."""
    name = f"{write_module(tmp_path, 'forms_sequential', SEQUENTIAL)}:build"
    params = []
    for node_seed in (11, 12):
        load_model.cache_clear()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(node_seed)
            p = custom_preset(name, 256, sizer=SIZING.model)
            params.append([build_layer(p, i, seed=3).state_dict() for i in range(p.layers)])
    for one, other in zip(*params, strict=True):
        assert one.keys() == other.keys()
        assert all(torch.equal(one[k], other[k]) for k in one)
    assert p.layers == 4 and p.context == 8
    assert layer_param_counts(p) == [256 * 4, 4 * 6 + 6, 0, 6 * 256 + 256]
    assert [s.shape for s in boundary_shapes(p, 2)] == [(2, 8, 4), (2, 8, 6), (2, 8, 6),
                                                        (2, 8, 256)]
    assert load_model(name, 300).boundaries[-1] == TensorSpec((8, 300))
    assert loss_fn(p) is next_token_loss


def test_layer_specs_are_built_per_layer_with_their_loss() -> None:
    specs = [LayerSpec(nn.Embedding, 30, 4), lambda x: x * 2, LayerSpec(nn.Linear, 4, 30)]
    model = pipeline_model(specs, context=3, vocab_size=30, loss=_sum_loss)
    assert model.description == "list of LayerSpecs" and model.loss is _sum_loss
    assert isinstance(model.layers[0](), nn.Embedding)
    double = model.layers[1]()  # a plain function in a DeepSpeed list is a forward
    assert isinstance(double, nn.Module) and torch.equal(double(torch.ones(2)), torch.full((2,), 2.))
    assert model.boundaries == (TensorSpec((3, 4)), TensorSpec((3, 4)), TensorSpec((3, 30)))


def test_a_pipeline_module_and_a_layer_list_declare_what_layer_0_takes() -> None:
    """DeepSpeed's PipelineModule by an `inputs` attribute, a list of LayerSpecs by the
    keyword: the layers are traced on zeros of it (float features here), and a model whose
    inputs are declared needs no vocabulary."""
    specs = [LayerSpec(nn.Linear, 6, 4), nn.Tanh(), lambda x: x.sum(dim=1)]
    module = PipelineModule(specs, loss_fn=_sum_loss)
    module.context, module.inputs = 3, TensorSpec((3, 6))
    model = pipeline_model(module)
    assert model.inputs == TensorSpec((3, 6)) and model.vocab_size is None
    assert model.boundaries == (TensorSpec((3, 4)), TensorSpec((3, 4)), TensorSpec((4,)))
    listed = pipeline_model(specs, context=3, inputs=TensorSpec((3, 6)), loss=_sum_loss)
    assert listed.boundaries == model.boundaries and listed.description == "list of LayerSpecs"


def test_a_pipeline_module_gives_its_layer_list_and_its_loss_fn() -> None:
    module = PipelineModule([LayerSpec(nn.Embedding, 30, 4), nn.Tanh(),
                             lambda x: x.transpose(1, 2)], loss_fn=_sum_loss)
    module.context, module.vocab_size = 3, 30
    model = pipeline_model(module)
    assert model.description == "DeepSpeed PipelineModule" and model.loss is _sum_loss
    assert model.boundaries == (TensorSpec((3, 4)), TensorSpec((3, 4)), TensorSpec((4, 3)))
    tanh = model.layers[1]()
    assert isinstance(tanh, nn.Tanh) and tanh is not module._layer_specs[1]


TUPLE_THEN_DICT = (TensorSpec((3, 4)), TensorSpec((3,), torch.bool))
DICT = {"hidden": TensorSpec((3, 4)), "mask": TensorSpec((3,), torch.bool),
        "ids": TensorSpec((3,), torch.int64)}


def test_layers_handing_on_a_tuple_or_a_dict_get_that_structure_of_specs() -> None:
    """The structure is found as the start-up trace checks it: a tuple of (hidden, mask),
    then a dict with an int64 id, each tensor's spec in its place; the model loads."""
    seq = nn.Sequential(nn.Embedding(30, 4), Pairs(), Gated(), Head())
    model = pipeline_model(seq, context=3, vocab_size=30)
    assert model.boundaries == (TensorSpec((3, 4)), TUPLE_THEN_DICT, DICT, TensorSpec((3, 30)))
    assert list(model.boundaries[2]) == ["hidden", "mask", "ids"]
    assert boundary_spec(model.boundaries[1], 2).specs[1].shape == (2, 3)
    x = torch.randint(0, 30, (2, 3))
    for make in model.layers:
        x = make()(x)
    assert x.shape == (2, 3, 30)


def test_a_layer_list_and_layer_specs_may_hand_on_structures_too() -> None:
    listed = pipeline_model([nn.Embedding(30, 4), Pairs, lambda: Gated()], context=3,
                            vocab_size=30, loss=_sum_loss)
    assert listed.boundaries[1:] == (TUPLE_THEN_DICT, DICT)
    specs = [LayerSpec(nn.Embedding, 30, 4), LayerSpec(Pairs), LayerSpec(Gated),
             LayerSpec(Head)]
    module = PipelineModule(specs, loss_fn=_sum_loss)
    module.context, module.vocab_size = 3, 30
    model = pipeline_model(module)
    assert model.boundaries == (TensorSpec((3, 4)), TUPLE_THEN_DICT, DICT, TensorSpec((3, 30)))
    assert model.loss is _sum_loss


def test_a_structured_sequential_by_name_passes_the_start_up_trace(tmp_path: Path) -> None:
    """load_model converts a build function's Sequential of layers handing on a tuple, then
    checks the derived specs against the layers' outputs (bamboo.model.api's trace)."""
    name = f"{write_module(tmp_path, 'forms_structured', STRUCTURED)}:build"
    model = load_model(name)
    assert model.boundaries == (TensorSpec((5, 4)), (TensorSpec((5, 4)),
                                                     TensorSpec((5,), torch.bool)),
                                TensorSpec((5, 4)), TensorSpec((5, 30)))
    assert model.description == "nn.Sequential"


CLASSIFIER = """
import torch
import torch.nn.functional as F
from torch import nn


class Pool(nn.Module):
    def forward(self, h):
        return h.mean(1)


def labels_loss(logits, labels):
    return F.cross_entropy(logits, labels)


def build(vocab_size: int = 30, context: int = 5):
    return nn.Sequential(nn.Embedding(vocab_size, 4), Pool(), nn.Linear(4, 3))


def per_token(vocab_size: int = 30, context: int = 5):
    return bamboo.model.forms.pipeline_model(
        nn.Sequential(nn.Embedding(vocab_size, 4), nn.Linear(4, 3)), context=context,
        vocab_size=vocab_size, loss=labels_loss)
"""


def test_a_classifier_s_loss_meets_its_labels_in_the_run_a_per_token_one_at_start(
        tmp_path: Path) -> None:
    """The start-up trace tries the loss on `[1, context]` token targets only for a per-token
    output: a classifier's `[B, classes]` meets a Dataset's labels (`[B]`), which the trace
    does not have; a per-token model whose loss cannot take token targets stays refused."""
    path = write_module(tmp_path, "forms_classifier", "import bamboo.model.forms\n" + CLASSIFIER)
    model = load_model(f"{path}:build")
    assert model.boundaries == (TensorSpec((5, 4)), TensorSpec((4,)), TensorSpec((3,)))
    assert model.loss is next_token_loss  # the job's loss= replaces it in the run
    with pytest.raises(ModelError, match=r"loss failed on the output of shape \[1, 5, 3\] and "
                                         r"targets \[1, 5\]: "):
        load_model(f"{path}:per_token")


@pytest.mark.parametrize("layers, expected", [
    ([], "list, the layer list is empty"),
    ([nn.Embedding(30, 4), 3], "list, layer 1 is int: a layer list holds nn.Modules"),
    ([nn.Embedding(30, 4), ReturnsList(), nn.Linear(4, 30)],
     "list, layer 1 returns list (list is not a tensor): a layer returns a tensor, or a "
     "tuple or a dict of str to tensors"),
    ([nn.Embedding(30, 4), ReturnsNone()],
     "list, layer 1 returns NoneType (NoneType is not a tensor)"),
    ([nn.Embedding(30, 4), Pairs(), ReturnsCount(), nn.Linear(4, 30)],
     "list, layer 2 returns tuple of (Tensor, int) (int at [1] is not a tensor)"),
    ([nn.Embedding(30, 4), MaskOnly()],
     "list, layer 1 outputs torch.bool, torch.int64, not floating point: gradients flow back "
     "through it (end the layer in a float, or add one)"),
    ([nn.Embedding(30, 4), nn.Linear(5, 30)],
     "list, cannot find the tensors between layers on a [1, 3] batch of token ids (layer 1 "
     "(Linear) got float32 [1, 3, 4] and raised RuntimeError: mat1 and mat2 shapes cannot be "
     "multiplied"),
    ([nn.Identity(), nn.Embedding(30, 4)], "list, layer 0 hands on torch.int64, not "
                                           "floating point"),
])
def test_what_cannot_be_converted_is_one_line(layers: list, expected: str) -> None:
    with pytest.raises(ModelError) as e:
        pipeline_model(layers, context=3, vocab_size=30)
    message = str(e.value)
    assert expected in message and "\n" not in message, message


def test_where_context_and_vocabulary_are_missing_the_line_says_what_to_add() -> None:
    with pytest.raises(ModelError, match=r"^list, no context for the token ids it is fed "
                                         r"without a Dataset: train it on a Dataset \(dataset=, "
                                         r"--dataset\), whose first sample gives its shapes, or "
                                         r"return bamboo\.model\.forms\.pipeline_model\(model, "
                                         r"context=N\)$"):
        pipeline_model([nn.Embedding(30, 4)], vocab_size=30)
    with pytest.raises(ModelError, match=r"^Sequential, no vocab_size for the token ids it is "
                                         r"fed without a Dataset: .* or set its `vocab_size` "
                                         r"attribute, "):
        pipeline_model(nn.Sequential(nn.Embedding(30, 4)), context=3)
    with pytest.raises(ModelError, match=r"^Linear, one nn.Module, which bamboo cannot cut"):
        pipeline_model(nn.Linear(2, 2), context=3, vocab_size=30)


def test_a_model_that_declares_its_inputs_needs_no_context() -> None:
    """An image classifier: `inputs` declared, no context and no vocabulary (context 1);
    a PipelineModel that declares no output still needs one, and the line says so."""
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1),
                        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5)))
    model = pipeline_model(cnn, inputs=TensorSpec((3, 6, 6)))
    assert (model.context, model.vocab_size) == (1, None)
    assert model.boundaries == (TensorSpec((4, 6, 6)), TensorSpec((5,)))
    direct = PipelineModel(layers=[lambda: nn.Linear(2, 3)], inputs=TensorSpec((2,)),
                           output=TensorSpec((3,)))
    assert direct.context == 1
    traced = PipelineModel(layers=[lambda: nn.Linear(2, 3)], inputs=TensorSpec((2,)),
                           vocab_size=3)  # no output: open, traced when it is loaded
    assert traced.is_open
    assert pipeline_model(traced).boundaries == (TensorSpec((3,)),)
    assert pipeline_model(traced).context == 1


def test_a_build_function_returning_another_form_is_refused_in_one_line(tmp_path: Path) -> None:
    source = "from torch import nn\n\ndef build(vocab_size: int = 256):\n" \
             "    return [nn.Embedding(vocab_size, 4), nn.Linear(4, vocab_size)]\n"
    name = f"{write_module(tmp_path, 'forms_no_context', source)}:build"
    with pytest.raises(ModelError, match=r"^model '.*': build\(\) returned list, no context "
                                         r"for the token ids it is fed without a Dataset: "):
        load_model(name)


def test_the_plain_forms_do_not_import_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
        monkeypatch.delitem(sys.modules, module)  # put back after the test
    pipeline_model(nn.Sequential(nn.Embedding(30, 4), nn.Linear(4, 30)), context=3,
                   vocab_size=30)
    pipeline_model([LayerSpec(nn.Embedding, 30, 4), lambda x: x * 2], context=3,
                   vocab_size=30)
    tied = pipeline_model([TiedLayerSpec("e", nn.Embedding, 30, 4), LayerSpec(nn.Linear, 4, 4),
                           TiedLayerSpec("e", nn.Linear, 4, 30)], context=3, vocab_size=30)
    assert [(t.key, t.uses) for t in tied.ties] == [("e", ((0, "weight"), (2, "weight")))]
    assert not [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]


@pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)
def test_deepspeed_layer_specs_convert_and_tied_ones_tie_their_attributes() -> None:
    from deepspeed.pipe import LayerSpec as DSLayerSpec
    from deepspeed.pipe import TiedLayerSpec as DSTied

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    specs = [DSLayerSpec(nn.Embedding, 30, 4), DSLayerSpec(nn.Linear, 4, 30)]
    model = pipeline_model(specs, context=3, vocab_size=30, loss=loss)
    assert model.boundaries == (TensorSpec((3, 4)), TensorSpec((3, 30))) and model.loss is loss
    assert isinstance(model.layers[1](), nn.Linear)
    def head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, embedding.weight)

    tied = pipeline_model([DSTied("embed", nn.Embedding, 30, 4), DSLayerSpec(nn.Linear, 4, 4),
                           DSTied("embed", nn.Embedding, 30, 4, forward_fn=head)], context=3,
                          vocab_size=30, loss=loss)
    assert [(t.key, t.uses) for t in tied.ties] == [
        ("embed", ((0, "weight"), (2, "module.weight")))]
    assert tied.boundaries[-1] == TensorSpec((3, 30))  # the head ran through its forward_fn
    alone = pipeline_model([DSTied("embed", nn.Embedding, 30, 4), *specs[1:]], context=3,
                           vocab_size=30)
    assert alone.ties == ()  # a key used once ties nothing
    two_attrs = pipeline_model([DSTied("lin", nn.Linear, 4, 4, tied_weight_attr=["weight",
                                                                                  "bias"]),
                                DSTied("lin", nn.Linear, 4, 4, tied_weight_attr=["weight",
                                                                                 "bias"])],
                               context=3, inputs=TensorSpec((3, 4)))
    assert [(t.key, t.uses) for t in two_attrs.ties] == [
        ("lin.bias", ((0, "bias"), (1, "bias"))), ("lin.weight", ((0, "weight"), (1, "weight")))]
    # as in DeepSpeed, the key's first spec says which attributes are tied; [] ties none
    first_says = pipeline_model([DSTied("lin", nn.Linear, 4, 4, tied_weight_attr=["weight",
                                                                                   "bias"]),
                                 DSTied("lin", nn.Linear, 4, 4, tied_weight_attr="weight")],
                                context=3, inputs=TensorSpec((3, 4)))
    assert [t.key for t in first_says.ties] == ["lin.bias", "lin.weight"]
    none = pipeline_model([DSTied("lin", nn.Linear, 4, 4, tied_weight_attr=[]),
                           DSTied("lin", nn.Linear, 4, 4)], context=3, inputs=TensorSpec((3, 4)))
    assert none.ties == ()


@pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)
def test_deepspeed_layer_specs_handing_on_a_tuple_and_a_dict_convert() -> None:
    """DeepSpeed's own LayerSpecs whose layers hand on (hidden, mask), then a dict with ids:
    the structures are found, each layer built by its spec."""
    from deepspeed.pipe import LayerSpec as DSLayerSpec

    specs = [DSLayerSpec(nn.Embedding, 30, 4), DSLayerSpec(Pairs), DSLayerSpec(Gated),
             DSLayerSpec(Head)]
    model = pipeline_model(specs, context=3, vocab_size=30, loss=_sum_loss)
    assert model.boundaries == (TensorSpec((3, 4)), TUPLE_THEN_DICT, DICT, TensorSpec((3, 30)))
    assert isinstance(model.layers[2](), Gated) and model.description == "list of LayerSpecs"
