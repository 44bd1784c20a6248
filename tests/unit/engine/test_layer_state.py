"""A layer's state in the form derived from its optimizer (bamboo.engine.layer_state): the
same layout on every side that builds the same layer and optimizer, exact round trips of
named and packed states for optimizers of every kind of state, stages of layers without
parameters, and the one-line refusals. (Processes killed with these optimizers:
tests/integration/test_parameterless_runs.py.)"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from bamboo.config.presets import preset
from bamboo.data.sizing import SIZING
from bamboo.engine import layer_state as ls
from bamboo.engine.layer_state import HEADER, Kind, group_options, layer_layout, read_state
from bamboo.engine.optim import bytes_per_parameter, check_optimizer, make_optimizer
from bamboo.engine.stage import StageOptimizer, StageState
from bamboo.run.checkpoint import load_layers, write_layers
from support.tabular import MODEL, PARAMETERLESS, TRIPLE

OPTIMIZERS = {
    "adamw": None,  # the default
    "amsgrad": "torch.optim:AdamW(amsgrad=True)",
    "adafactor": "torch.optim:Adafactor(lr=0.01)",
    "triple": TRIPLE,
    "sgd": "torch.optim:SGD(lr=0.1)",
    "momentum": "torch.optim:SGD(lr=0.1, momentum=0.9)",
}


def _layer(seed: int = 0) -> nn.Module:
    """Parameters of one, two and four dimensions, one in float64."""
    torch.manual_seed(seed)
    layer = nn.ModuleDict({"fc": nn.Linear(5, 3), "conv": nn.Conv2d(2, 4, 3)})
    layer.register_parameter("scale", nn.Parameter(torch.randn(3, dtype=torch.float64)))
    return layer


def _built(spec: str | None, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer,
                                                     ls.LayerLayout]:
    layer = _layer(seed)
    optimizer = make_optimizer(layer, lr=0.01, weight_decay=0.1, spec=spec)
    return layer, optimizer, layer_layout(list(layer.named_parameters()), optimizer,
                                          group_options(optimizer))


def _step(layer: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in layer.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _state(layer: nn.Module, optimizer: torch.optim.Optimizer,
           layout: ls.LayerLayout) -> ls.LayerState:
    return read_state(layout, list(layer.parameters()), optimizer, "layer 0")


def _load(layer: nn.Module, optimizer: torch.optim.Optimizer, layout: ls.LayerLayout,
          state: ls.LayerState) -> None:
    ls.write_state(layout, list(layer.parameters()), optimizer, state,
                   lambda t: t.to("cpu", copy=True))


def _same_bits(a: ls.LayerState, b: ls.LayerState) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_packed_or_stored_state_carries_every_bit_and_steps_on_equally(
        name: str, tmp_path) -> None:
    """Two independent builds agree on the layout; after two steps one's state, packed
    (as a peer sends it) or written and read back (as a checkpoint), loaded into the
    other, gives the same bits at the next step, optimizer state included."""
    a, opt_a, layout_a = _built(OPTIMIZERS[name], seed=0)
    b, opt_b, layout_b = _built(OPTIMIZERS[name], seed=1)
    c, opt_c, _ = _built(OPTIMIZERS[name], seed=2)
    assert layout_a == layout_b and layout_a.nbytes % ls.ALIGN == 0
    for seed in (1, 2):
        _step(a, opt_a, seed)
    state = _state(a, opt_a, layout_a)
    _load(b, opt_b, layout_b, layout_b.unpack(layout_a.pack(state, torch.device("cpu")), "x"))
    write_layers(tmp_path / "step-00000002", {0: ls.snapshot(state)})
    stored = load_layers(tmp_path / "step-00000002", [0])[0]
    layout_a.check(stored, "layer 0")
    _load(c, opt_c, layout_a, stored)
    for layer, optimizer in ((a, opt_a), (b, opt_b), (c, opt_c)):
        _step(layer, optimizer, 3)
    after = _state(a, opt_a, layout_a)
    _same_bits(after, _state(b, opt_b, layout_b))
    _same_bits(after, _state(c, opt_c, layout_a))
    for pa, pb in zip(opt_a.state.values(), opt_b.state.values()):
        assert {k: type(v) for k, v in pa.items()} == {k: type(v) for k, v in pb.items()}


def test_the_layout_names_what_each_optimizer_keeps() -> None:
    kinds = {name: {e.name: (e.kind, e.shape, e.dtype) for e in _built(spec)[2].entries}
             for name, spec in OPTIMIZERS.items()}
    assert kinds["sgd"] == {
        "param.fc.weight": (Kind.PARAM, (3, 5), torch.float32),
        "param.fc.bias": (Kind.PARAM, (3,), torch.float32),
        "param.conv.weight": (Kind.PARAM, (4, 2, 3, 3), torch.float32),
        "param.conv.bias": (Kind.PARAM, (4,), torch.float32),
        "param.scale": (Kind.PARAM, (3,), torch.float64),
        **{f"held.{n}": (Kind.HELD, (), torch.uint8)
           for n in ("fc.weight", "fc.bias", "conv.weight", "conv.bias", "scale")}}
    assert kinds["amsgrad"]["optim.fc.weight.max_exp_avg_sq"] == (Kind.TENSOR, (3, 5),
                                                                   torch.float32)
    assert kinds["amsgrad"]["optim.scale.exp_avg"] == (Kind.TENSOR, (3,), torch.float64)
    assert kinds["adafactor"]["optim.fc.weight.row_var"][1:] == ((3, 1), torch.float32)
    assert kinds["adafactor"]["optim.fc.weight.col_var"][1:] == ((1, 5), torch.float32)
    assert kinds["adafactor"]["optim.fc.bias.variance"][1:] == ((3,), torch.float32)
    assert kinds["triple"]["optim.fc.weight.count"] == (Kind.INT, (), torch.int64)
    assert kinds["triple"]["optim.fc.weight.correction"] == (Kind.FLOAT, (), torch.float64)
    assert {k.rsplit(".", 1)[1] for k in kinds["triple"] if k.startswith("optim.fc.bias.")} == \
        {"count", "correction", "mean", "peak", "last"}
    # the parameter and AdamW's two moments, and its step count over 256 elements
    assert bytes_per_parameter(None, 0.01) == 12.0 + 4 / 256
    assert bytes_per_parameter("torch.optim:SGD(lr=0.1)", 0.01) == 4.0


def test_a_state_before_the_first_step_clears_a_stepped_one() -> None:
    a, opt_a, layout = _built(TRIPLE)
    b, opt_b, _ = _built(TRIPLE)
    _step(b, opt_b, 1)
    fresh = _state(a, opt_a, layout)
    assert all(int(t) == 0 for k, t in fresh.items() if k.startswith("held."))
    _load(b, opt_b, layout, fresh)
    assert not opt_b.state and all(torch.equal(p, q) for p, q in zip(a.parameters(),
                                                                     b.parameters()))


def test_a_stage_of_layers_without_parameters_holds_only_headers() -> None:
    """ReLU and Dropout of the tabular model: no optimizer, an empty gradient, a state of
    one header a layer, which round-trips; its step is a no-op."""
    st = StageState(preset=preset(MODEL, SIZING), stage=1, layer_indices=range(1, 3), seed=0,
                    device=torch.device("cpu"), optim=StageOptimizer(0.1, 0.0, TRIPLE))
    assert set(st.layer_indices) <= set(PARAMETERLESS)
    assert (st.optimizer, st.numel, st.grad_sum.numel()) == (None, 0, 0)
    assert st.state_size() == 2 * HEADER and st.layer_state(1) == {}
    st.load_state_vector(st.state_vector())
    st.apply(st.grad_sum.clone(), 1.0, 0.1)
    assert st.layer_sq_norms(st.grad_sum) == [(1, 0.0), (2, 0.0)]
    assert st.memory() == (0, 0)


class Listing(torch.optim.SGD):
    """Keeps a list in a parameter's state."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["history"] = [1.0]


class Growing(torch.optim.SGD):
    """Adds a key to a parameter's state at its second step."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                s = self.state[p]
                s["late" if "early" in s else "early"] = torch.zeros(1)


@pytest.mark.parametrize("spec, expected", [
    (f"{__name__}:Listing(lr=0.1)", "Listing keeps a list in its per-parameter state "
                                    "('history'): only tensors and numbers can be carried"),
    (f"{__name__}:Growing(lr=0.1)", "Growing's per-parameter state changes after its first "
                                    "step (['early'] then ['early', 'late'])"),
    ("torch.optim:LBFGS()", "LBFGS could not step a probe parameter (TypeError"),
])
def test_an_optimizer_whose_state_cannot_be_carried_is_refused_in_one_line(
        spec: str, expected: str) -> None:
    with pytest.raises(ValueError) as e:
        check_optimizer(spec, None, 0.01, 4)
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_state_of_another_layout_is_refused_in_one_line() -> None:
    _, _, adamw = _built(None)
    layer, opt, sgd = _built("torch.optim:SGD(lr=0.1, momentum=0.9)")
    _step(layer, opt, 1)
    packed = sgd.pack(_state(layer, opt, sgd), torch.device("cpu"))
    with pytest.raises(ValueError, match="expected .* bytes"):
        adamw.unpack(packed, "layer 3")
    forged = torch.cat([packed[:HEADER].flip(0), packed[HEADER:]])
    with pytest.raises(ValueError, match="layer 3: the state was packed by another layout"):
        sgd.unpack(forged, "layer 3")
    named = _state(layer, opt, sgd)
    with pytest.raises(ValueError, match=r"layer 3: its state has 5 entries \(optim.conv.bias."
                                         r"momentum_buffer, .*, \.\.\.\) this model and "
                                         r"optimizer do not keep and lacks 15 entries"):
        adamw.check(named, "layer 3")
    named["param.scale"] = named["param.scale"].float()
    with pytest.raises(ValueError, match=r"param.scale is torch.float32 \[3\], this model and "
                                         r"optimizer keep torch.float64 \[3\]"):
        sgd.check(named, "layer 3")
    opt.state[next(iter(opt.state))]["extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match="SGD holds state \\['extra', 'momentum_buffer'\\]"):
        _state(layer, opt, sgd)
