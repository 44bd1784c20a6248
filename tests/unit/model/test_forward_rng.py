"""Seeded randomness in a layer's forward (`bamboo.model.run_layers`): the same (seed, step,
micro-batch, layer) draws the same mask wherever and however often it runs, other keys
draw others, nothing outside the forward sees a draw, activation checkpointing recomputes
with the same mask, and a draw from a generator bamboo does not seed is refused at the
start-up check in one line.

The runs that kill a dropout model: tests/integration/test_dropout_runs.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bamboo.model import forward_seed, run_layers, seeded_randomness
from bamboo.model.api import ModelError, load_model
from support.models import HEADER, write_module


class Draw(nn.Module):
    """A layer that keeps the dropout mask it draws (on ones, whatever its input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mask = nn.functional.dropout(torch.ones_like(x), 0.5) != 0
        return x


def masks(step: int | str, mb: int, layers: int = 2, seed: int = 3) -> list[torch.Tensor]:
    """The mask each of `layers` layers draws in micro-batch `mb` of `step`."""
    model = nn.Sequential(*[Draw() for _ in range(layers)])
    run_layers(model, range(layers), torch.ones(64, 64), device="cpu",
               seed_of=lambda layer: forward_seed(seed, step, mb, layer))
    return [layer.mask for layer in model]


def test_the_same_key_draws_the_same_mask_and_every_other_key_another() -> None:
    base = masks(5, 2)
    assert all(torch.equal(a, b) for a, b in zip(base, masks(5, 2)))
    assert 0.3 < float(base[0].float().mean()) < 0.7  # dropout did draw
    assert not torch.equal(base[0], base[1])  # layer 0 and layer 1
    for other in (masks(6, 2), masks(5, 3), masks(5, 2, seed=4), masks("eval", 2)):
        assert not torch.equal(base[0], other[0])
        assert not torch.equal(base[1], other[1])
    assert len({forward_seed(0, s, m, i) for s in range(4) for m in range(4)
                for i in range(4)}) == 64


def test_a_layer_draws_the_same_whatever_ran_before_it_and_nothing_after_sees_it() -> None:
    """The second layer alone (a stage that starts there, or a redo) draws what it draws
    after the first; the global generator is where it was, as if nothing had run."""
    whole = masks(1, 0)
    layer = Draw()
    torch.manual_seed(123)
    torch.rand(7)  # a state of its own before
    state = torch.get_rng_state()
    run_layers([layer], [1], torch.ones(64, 64), device="cpu",
               seed_of=lambda i: forward_seed(3, 1, 0, i))
    assert torch.equal(layer.mask, whole[1])
    assert torch.equal(torch.get_rng_state(), state)


def test_reseed_sets_the_state_manual_seed_gives() -> None:
    with seeded_randomness("cpu") as reseed:
        reseed(42)
        seeded = torch.rand(5)
    torch.manual_seed(42)
    assert torch.equal(seeded, torch.rand(5))


def test_activation_checkpointing_recomputes_with_the_same_mask() -> None:
    """torch's checkpoint keeps the seeded state for the recompute: the gradients are the
    plain forward's (a recompute with another mask would give others)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3), nn.Tanh()),
                          nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3)))
    x = torch.randn(8, 16)

    def grads(call) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out = run_layers(model, range(2), x, device="cpu", call=call,
                         seed_of=lambda i: forward_seed(0, 7, 1, i))
        out.square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads(None)
    checkpointed = grads(lambda layer, h: checkpoint(layer, h, use_reentrant=False))
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))
    torch.manual_seed(1)  # unseeded, another mask: other gradients
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    assert not all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters()))


DRAWS = {
    # where: (the layer's source, what the line says)
    "numpy in a forward": (
        "class Noisy(nn.Module):\n    def forward(self, x):\n"
        "        import numpy\n        return x + float(numpy.random.rand())\n",
        "layer 1's forward draws from numpy's np.random"),
    "random in a forward": (
        "class Noisy(nn.Module):\n    def forward(self, x):\n"
        "        import random\n        return x * random.random()\n",
        "layer 1's forward draws from Python's random module"),
    "random in a factory": (
        "import random\nclass Noisy(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.k = random.random()\n"
        "    def forward(self, x):\n        return x * self.k\n",
        "layer 1's factory draws from Python's random module"),
}

MODEL = HEADER + """
CONTEXT, D = 8, 4
{layer}

def build(vocab_size: int = 256) -> PipelineModel:
    return PipelineModel(
        layers=[lambda: nn.Sequential(nn.Embedding(vocab_size, D), nn.Dropout(0.1)), Noisy,
                lambda: nn.Linear(D, vocab_size)],
        boundary=TensorSpec((CONTEXT, D)), context=CONTEXT, vocab_size=vocab_size)
"""


@pytest.mark.parametrize("case", DRAWS)
def test_a_draw_bamboo_does_not_seed_is_refused_in_one_line(case: str, tmp_path: Path) -> None:
    layer, expected = DRAWS[case]
    file = write_module(tmp_path, "draws_" + case.replace(" ", "_"), MODEL.format(layer=layer))
    with pytest.raises(ModelError) as e:
        load_model(f"{file}:build")
    assert expected in str(e.value) and "\n" not in str(e.value), e.value


def test_dropout_and_torch_draws_pass_the_check(tmp_path: Path) -> None:
    layer = ("class Noisy(nn.Module):\n    def forward(self, x):\n"
             "        return nn.functional.dropout(x + 0.01 * torch.randn_like(x), 0.2)\n")
    file = write_module(tmp_path, "torch_draws", MODEL.format(layer=layer))
    assert len(load_model(f"{file}:build").layers) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_on_cuda_the_device_generator_is_seeded_and_put_back() -> None:
    """The CUDA device's generator is seeded as `torch.manual_seed` seeds it, and is where
    it was after the forward (a worker's other draws do not move)."""
    device = torch.device("cuda")
    torch.cuda.manual_seed(5)
    before = torch.cuda.get_rng_state(device)
    with seeded_randomness(device) as reseed:
        reseed(42)
        seeded = torch.rand(5, device=device)
        mask = nn.functional.dropout(torch.ones(64, device=device), 0.5)
    assert torch.equal(torch.cuda.get_rng_state(device), before)
    torch.manual_seed(42)
    assert torch.equal(seeded, torch.rand(5, device=device))
    assert torch.equal(mask, nn.functional.dropout(torch.ones(64, device=device), 0.5))
