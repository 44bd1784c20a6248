"""Tied weights (bamboo.model.ties): checked when the model is made, every copy starting as
the first use, one parameter within a stage, and a gradient norm that counts the tied
weight once whatever the stages. The commit round's sum of the copies' gradients runs in
tests/integration/test_ties_runs.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from bamboo.config.presets import custom_preset
from bamboo.data.sizing import SIZING
from bamboo.engine.stage import StageOptimizer, StageState
from bamboo.model import build_layer, build_layers, model_ties
from bamboo.model.api import ModelError, PipelineModel, TensorSpec, load_model
from bamboo.model.ties import Tie, TieError, param_path, share_within
from support.models import TIED, write_module


def _layers() -> list:
    return [lambda: nn.Embedding(10, 4), lambda: nn.Linear(4, 4), lambda: nn.Linear(4, 10)]


@pytest.mark.parametrize("ties, expected", [
    ({"e": [(0, "weight")]}, "tie 'e' has 1 use: a tie joins two uses or more"),
    ({"e": [(0, "weight"), (3, "weight")]}, "tie 'e': layer 3 is not one of the model's 3 layers"),
    ({"e": [(0, "weight"), "weight"]}, "tie 'e': use 'weight' is not a (layer index, attribute "
                                       "path) pair such as (0, 'weight')"),
    ({"e": [(0, "weight"), (2, "weight")], "f": [(2, "weight"), (1, "weight")]},
     "tie 'f': layer 2's 'weight' is already a use of tie 'e'"),
    ({"e": "weight"}, "tie 'e': its uses must be a list of (layer index, attribute path) pairs"),
    ({"e": [(2, "weight"), (2, "bias")]}, "tie 'e' names layer 2 twice: a tie joins parameters "
                                          "of different layers"),
    ({1: [(0, "weight"), (2, "weight")], "1": [(1, "weight"), (2, "bias")]},
     "two ties are named '1': give each tie its own key"),
    ([(0, "weight")], "ties must be a dict of key -> [(layer index, attribute path), ...]"),
])
def test_a_tie_is_checked_when_the_model_is_made(ties: object, expected: str) -> None:
    with pytest.raises(ModelError) as e:
        PipelineModel(layers=_layers(), context=3, vocab_size=10,
                      boundary=TensorSpec((3, 4)), ties=ties)
    assert str(e.value) == f"PipelineModel {expected}" or expected in str(e.value), e.value
    assert "\n" not in str(e.value)


def test_ties_are_kept_sorted_by_key_with_their_uses_in_layer_order() -> None:
    model = PipelineModel(layers=_layers(), context=3, vocab_size=10,
                          boundary=TensorSpec((3, 4)),
                          ties={"z": [(2, "weight"), (0, "weight")], "a": [(1, "bias"),
                                                                           (2, "bias")]})
    assert [(t.key, t.uses) for t in model.ties] == [
        ("a", ((1, "bias"), (2, "bias"))), ("z", ((0, "weight"), (2, "weight")))]


@pytest.fixture
def tied(tmp_path: Path) -> str:
    return f"{write_module(tmp_path, 'tied_model_unit', TIED)}:build"


def test_every_copy_starts_as_the_first_use_and_one_stage_shares_one_parameter(
        tied: str) -> None:
    p = custom_preset(tied, 256, sizer=SIZING.model)
    assert [(t.key, t.uses) for t in model_ties(p)] == [("embed", ((0, "weight"), (3, "weight")))]
    embedding, head = build_layer(p, 0, seed=1), build_layer(p, 3, seed=1)
    assert torch.equal(head.weight, embedding.weight)
    assert not torch.equal(build_layer(p, 3, seed=2).weight, embedding.weight)
    whole = build_layers(p, range(4), seed=1)
    assert whole[3].weight is whole[0].weight and torch.equal(whole[0].weight, embedding.weight)
    assert len(list(nn.Sequential(*whole).parameters())) == \
        sum(len(list(layer.parameters())) for layer in whole) - 1
    late = build_layers(p, [2, 3], seed=1)
    assert torch.equal(late[1].weight, embedding.weight)
    assert torch.equal(late[1].ln.weight, head.ln.weight)  # the rest is the layer's own


def test_a_use_of_another_shape_or_no_such_parameter_is_refused_in_one_line(
        tmp_path: Path) -> None:
    wrong = TIED.replace('ties={"embed": [(0, "weight"), (3, "weight")]}',
                         'ties={"embed": [(0, "weight"), (1, "fc.weight")]}')
    name = f"{write_module(tmp_path, 'tied_wrong_shape', wrong)}:build"
    with pytest.raises(ModelError, match=r"^model '.*': tie 'embed': layer 1's 'fc.weight' is "
                                         r"\[8, 8\] torch.float32, but layer 0's 'weight' is "
                                         r"\[256, 8\] torch.float32: tied parameters have one "
                                         r"shape and dtype$"):
        load_model(name)
    missing = TIED.replace('(3, "weight")', '(3, "scale")')
    name = f"{write_module(tmp_path, 'tied_missing', missing)}:build"
    with pytest.raises(ModelError, match=r"^model '.*': Head has no parameter 'scale' to tie$"):
        load_model(name)


def _stage(p: object, layers: range) -> StageState:
    return StageState(preset=p, stage=0, layer_indices=layers, seed=1,  # type: ignore[arg-type]  # a preset built in the test
                      device=torch.device("cpu"), optim=StageOptimizer(1e-3, 0.0),
                      accumulate_dtype=torch.float64)


def _flat(st: StageState, grads: dict[tuple[int, str], torch.Tensor]) -> torch.Tensor:
    """A stage's flat gradient from one gradient per (layer, parameter name); a tied
    parameter shared within the stage appears once, under its first layer."""
    seen, parts = set(), []
    for layer, module in zip(st.layer_indices, st.module):
        for name, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                parts.append(grads[(layer, name)].reshape(-1))
    return torch.cat(parts).to(torch.float64)


def test_the_norm_counts_a_tied_weight_once_whatever_the_stages(tied: str) -> None:
    """Each layer's squared norm has the same bits whether the tie's uses share a stage or
    not; the tied weight is counted under layer 0 only; each stage names its copy's slice."""
    p = custom_preset(tied, 256, sizer=SIZING.model)
    torch.manual_seed(0)
    whole = build_layers(p, range(4), seed=1)
    grads = {(i, n): torch.randn_like(t) for i, layer in enumerate(whole)
             for n, t in layer.named_parameters(remove_duplicate=False)}
    grads[(3, "weight")] = grads[(0, "weight")]  # the copies' summed gradient is one
    one = _stage(p, range(4))
    first, second = _stage(p, range(2)), _stage(p, range(2, 4))
    by_layer = dict(one.layer_sq_norms(_flat(one, grads)))
    split = dict(first.layer_sq_norms(_flat(first, grads)) +
                 second.layer_sq_norms(_flat(second, grads)))
    assert by_layer == split  # bit for bit
    head_own = sum(float(grads[(3, n)].to(torch.float64).square().sum())
                   for n in ("ln.weight", "ln.bias"))
    assert by_layer[3] == pytest.approx(head_own, rel=1e-12)
    size = 256 * 8
    assert [(k, w.stop - w.start) for k, w in one.tied.items()] == [("embed", size)]
    assert torch.equal(_flat(second, grads)[second.tied["embed"]],
                       grads[(0, "weight")].reshape(-1).double())
    assert one.numel == second.numel + first.numel - size
    assert one.state_size() == first.state_size() + second.state_size()


class _Embedding(nn.Module):
    """An embedding whose weight is also reachable as a property (Megatron-DeepSpeed's
    `word_embeddings_weight`), the attribute a TiedLayerSpec may name."""

    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(10, 4)

    @property
    def word_embeddings_weight(self) -> nn.Parameter:
        return self.word_embeddings.weight


def test_a_property_that_returns_a_parameter_ties_that_parameter() -> None:
    tie = Tie("embed", ((0, "word_embeddings_weight"), (1, "word_embeddings_weight")))
    first, second = _Embedding(), _Embedding()
    assert param_path(first, "word_embeddings_weight") == "word_embeddings.weight"
    share_within([first, second], [0, 1], [tie])
    assert second.word_embeddings.weight is first.word_embeddings.weight
    assert second.word_embeddings_weight is first.word_embeddings_weight
    with pytest.raises(TieError, match=r"^_Embedding has no parameter 'training' to tie$"):
        param_path(first, "training")  # an attribute, not a parameter
