"""A tuple or dict of tensors between layers (bamboo.model.structure): flattened and built
again, packed into one message and viewed back without a copy, gradients for the float
tensors only (zeros for one the next stage left unused), traced and checked at start-up,
and the refusals, each one line. Killed in flight with processes:
tests/integration/test_structured_boundaries_runs.py."""
from __future__ import annotations

import contextlib
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn

from bamboo.config.presets import custom_preset
from bamboo.data.sizing import SIZING
from bamboo.engine.layer_costs import measure_layer_costs
from bamboo.engine.memory import SavedTensors
from bamboo.engine.split_backward import Tape, Taping, input_gradient, weight_gradient
from bamboo.model import boundary_shapes
from bamboo.model.api import ModelError, PipelineModel, TensorSpec, load_model
from bamboo.model.pipeline import boundary_spec
from bamboo.model.structure import (
    BoundarySpec,
    StructuredSpec,
    StructureError,
    flatten,
    leaves,
    unflatten,
)
from support.models import HEADER, write_module
from support.structured_model import BOUNDARY, CONTEXT, NAME, D, Mix


@pytest.mark.parametrize("value", [
    torch.ones(2),
    (torch.ones(2), torch.zeros(3, dtype=torch.bool)),
    {"h": torch.ones(2), "ids": torch.arange(3)},
    {"a": (torch.ones(1), {"b": torch.zeros(2)}), "c": torch.ones(4)},
    (torch.ones(1),),
])
def test_flatten_then_unflatten_gives_the_value_back(value: object) -> None:
    items, treedef = flatten(value)
    again = unflatten(treedef, items)
    items_again, treedef_again = flatten(again)
    assert treedef_again == treedef and type(again) is type(value)
    assert all(a is b for a, b in zip(items, items_again))
    if isinstance(value, dict):
        assert list(again) == list(value)  # insertion order, as the layer built it


@pytest.mark.parametrize("value, named", [
    ([torch.ones(1)], "list"),
    ((torch.ones(1), 3), "int at [1]"),
    ({1: torch.ones(1)}, "the key 1"),
    (namedtuple("Pair", "a b")(torch.ones(1), torch.ones(1)), "Pair"),
])
def test_what_is_not_a_structure_of_tensors_is_named(value: object, named: str) -> None:
    with pytest.raises(StructureError, match=named.replace("[", r"\[").replace("]", r"\]")):
        flatten(value)


def _spec() -> StructuredSpec:
    spec = boundary_spec({"hidden": TensorSpec((3, 5)), "half": TensorSpec((7,), torch.bfloat16),
                          "mask": TensorSpec((3,), torch.bool), "ids": TensorSpec((1,), torch.int64)},
                         batch=2)
    assert isinstance(spec, StructuredSpec)
    return spec


def test_a_structure_travels_as_one_buffer_and_comes_back_as_views() -> None:
    spec = _spec()
    value = {"hidden": torch.randn(2, 3, 5), "half": torch.randn(2, 7).bfloat16(),
             "mask": torch.rand(2, 3) > 0.5, "ids": torch.randint(0, 99, (2, 1))}
    wire = spec.pack(value)
    assert wire.dtype == spec.dtype == torch.uint8 and tuple(wire.shape) == spec.shape
    assert spec.shape[0] % 16 == 0 and spec.shape[0] >= 2 * (15 * 4 + 7 * 2 + 3 + 8)
    back = spec.unpack(wire.clone())
    assert list(back) == list(value)
    for k in value:
        assert back[k].dtype == value[k].dtype and torch.equal(back[k], value[k]), k
    mine = spec.unpack(wire)
    start, end = wire.data_ptr(), wire.data_ptr() + wire.numel()
    assert all(start <= t.data_ptr() < end for t in mine.values())  # views: no copy
    x = spec.as_input(mine)
    assert [k for k, t in x.items() if t.requires_grad] == ["hidden", "half"]


def test_only_float_tensors_get_gradients_and_an_unused_one_gets_zeros() -> None:
    spec = _spec()
    assert spec.floats == (0, 1) and spec.grad_dtype == torch.uint8
    x = spec.as_input(spec.unpack(torch.zeros(spec.shape, dtype=torch.uint8)))
    (x["hidden"].sum() * 2).backward()  # "half" unused
    grads = spec.input_grads(x)
    assert torch.equal(grads[0], torch.full((2, 3, 5), 2.0)) and not grads[1].any()
    assert grads[1].dtype == torch.bfloat16
    back = spec.unpack_grad(spec.pack_grad(grads))
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(grads, back))
    dxs = [torch.ones(2, 3, 5)]  # autograd.grad for the one input that took a gradient
    x2 = spec.as_input(spec.unpack(torch.zeros(spec.shape, dtype=torch.uint8)))
    x2["half"].requires_grad_(False)
    assert spec.grad_inputs(x2) == [x2["hidden"]]
    grads2 = spec.grads_of(x2, dxs)
    assert grads2[0] is dxs[0] and not grads2[1].any()


def test_one_float_tensor_in_a_structure_goes_back_as_it_is() -> None:
    spec = boundary_spec((TensorSpec((4,)), TensorSpec((4,), torch.bool)), batch=3)
    assert spec.grad_shape == (3, 4) and spec.grad_dtype == torch.float32
    g = torch.randn(3, 4)
    assert spec.pack_grad((g,)) is g and spec.unpack_grad(g)[0] is g


def test_one_tensor_passes_as_it_is_no_copy_no_packing() -> None:
    spec = boundary_spec(TensorSpec((4, 8)), batch=2)
    assert isinstance(spec, BoundarySpec) and spec.shape == spec.grad_shape == (2, 4, 8)
    t = torch.randn(2, 4, 8)
    assert spec.pack(t) is t and spec.unpack(t) is t and spec.pack_grad(t) is t
    assert spec.unpack_grad(t) is t and spec.cast(t) is t
    assert spec.grad_pairs(t, t) == (t, t)


def test_the_example_model_is_traced_and_its_boundaries_sized() -> None:
    model = load_model(NAME)
    assert model.boundaries[:-1] == (BOUNDARY,) * 3
    specs = boundary_shapes(custom_preset(NAME, sizer=SIZING.model), 2)
    assert all(isinstance(s, StructuredSpec) for s in specs[:-1])
    assert specs[0].specs == (BoundarySpec((2, CONTEXT, D), torch.float32),
                              BoundarySpec((2, CONTEXT), torch.float32),
                              BoundarySpec((2, CONTEXT), torch.bool))
    assert specs[-1] == BoundarySpec((2, CONTEXT, 256), torch.float32)
    assert specs[0].floats == (0, 1)


def test_the_split_backward_of_a_structure_is_the_whole_backward() -> None:
    """zb-h1 on a stage whose input and output are dicts: the input gradients of both
    float tensors and every weight gradient are one `backward()`'s bits."""
    torch.manual_seed(0)
    whole, split = Mix().eval(), Mix().eval()
    split.load_state_dict(whole.state_dict())
    spec = boundary_spec(BOUNDARY, batch=3)
    value = {"hidden": torch.randn(3, CONTEXT, D), "gate": torch.rand(3, CONTEXT),
             "mask": torch.rand(3, CONTEXT) > 0.3}
    grad = (torch.randn(3, CONTEXT, D), torch.randn(3, CONTEXT))
    x_whole = spec.as_input(value)
    torch.autograd.backward(*spec.grad_pairs(whole(x_whole), grad))
    taping, tape = Taping(split), Tape()
    x_split = spec.as_input(value)
    with taping.recording(tape):
        out = split(x_split)
    outs, grads = spec.grad_pairs(out, grad)
    dxs = input_gradient(outs, grads, spec.grad_inputs(x_split),
                         Taping.other_params(list(split.parameters()), tape), tape)
    weight_gradient(tape, contextlib.nullcontext)
    mine, expected = spec.grads_of(x_split, dxs), spec.input_grads(x_whole)
    assert len(mine) == 2 and all(torch.equal(a, b) for a, b in zip(mine, expected))
    for (name, a), b in zip(whole.named_parameters(), split.parameters()):
        assert torch.equal(a.grad, b.grad), name


BAD = {
    "a list": ("return [x, x]", "BOUNDARY_ONE",
               "layer 0 returned list (list is not a tensor): a layer returns a tensor, or "
               "a tuple or a dict of str to tensors"),
    "another structure": ("return {'h': x}", "BOUNDARY_TWO",
                          "layer 0 returns {'h': tensor} but the model declares its boundary 0 "
                          "as {'h': tensor, 'mask': tensor}"),
    "a wrong dtype": ("return {'h': x, 'mask': idx}", "BOUNDARY_TWO",
                      "layer 0 outputs [B, 4] torch.int64 (tensor 1 of {'h': tensor, 'mask': "
                      "tensor}) but the model declares its boundary 0 as [B, 4] torch.bool"),
    "no float tensor": ("return idx", "{'ids': TensorSpec((4,), torch.int64)}",
                        "boundary holds no floating tensor (torch.int64 is not a floating "
                        "torch dtype)"),
    "not specs": ("return x", "(TensorSpec((4, 8)), 3)",
                  "boundary must be a TensorSpec, or a tuple or a dict of str to TensorSpecs "
                  "(got int at [1]"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_structure_is_refused_in_one_line(case: str, tmp_path: Path) -> None:
    body, boundary, expected = BAD[case]
    source = HEADER + f"""
BOUNDARY_ONE = TensorSpec((4, 8))
BOUNDARY_TWO = {{'h': TensorSpec((4, 8)), 'mask': TensorSpec((4,), torch.bool)}}


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(256, 8)

    def forward(self, idx):
        x = self.e(idx)
        {body}


def build(vocab_size: int = 256) -> PipelineModel:
    return PipelineModel(layers=[First, lambda: nn.Linear(8, vocab_size)],
                         boundary={boundary}, context=4, vocab_size=vocab_size)
"""
    file = write_module(tmp_path, "model_" + case.replace(" ", "_"), source)
    with pytest.raises(ModelError) as e:
        load_model(f"{file}:build")
    message = str(e.value)
    assert expected in message and "\n" not in message, message


def test_a_per_boundary_list_may_mix_one_tensor_and_structures() -> None:
    model = PipelineModel(layers=[nn.Identity] * 3, context=4, vocab_size=8,
                          boundary=[TensorSpec((4,)), (TensorSpec((4,)), TensorSpec((4,), torch.bool))])
    assert model.boundaries[1] == (TensorSpec((4,)), TensorSpec((4,), torch.bool))
    with pytest.raises(ModelError, match="boundary 1 holds no floating tensor"):
        PipelineModel(layers=[nn.Identity] * 3, context=4, vocab_size=8,
                      boundary=[TensorSpec((4,)), (TensorSpec((4,), torch.bool),)])


def test_a_structured_model_is_profiled_layer_by_layer() -> None:
    """`bamboo profile`'s per-layer timing hands each layer the previous one's dict."""
    costs = measure_layer_costs(NAME, micro_batch_size=2, repeats=1)
    assert len(costs.layer_s) == 4 and all(t > 0 for t in costs.layer_s)


def test_a_mask_held_in_the_input_is_not_counted_again_as_saved() -> None:
    """The memory accounting: a forward that saves the input's mask (a view of the received
    message) saves nothing the step does not hold already; its own activations count."""
    spec = boundary_spec(BOUNDARY, batch=2)
    x = spec.as_input(spec.unpack(torch.zeros(spec.shape, dtype=torch.uint8)))
    counted, plain = SavedTensors(held=leaves(x)), SavedTensors()
    for saved in (counted, plain):
        with saved.hooks():
            (x["hidden"] * 2.0).tanh() * x["mask"][..., None]
    assert counted.device_bytes == 2 * CONTEXT * D * 4  # tanh's output
    assert plain.device_bytes - counted.device_bytes == spec.shape[0]  # the whole message
