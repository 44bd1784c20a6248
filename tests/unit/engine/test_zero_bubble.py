"""ZB-H1 (`--schedule zb-h1`): the backward split into the input gradient and the weight
gradient, the weight gradients deferred into what 1F1B leaves idle.

Without processes: the lists are complete and bounded in memory, the timeline model gives
the closed form, and the split gradients are the whole backward's bits. (With processes,
runs equal to 1F1B's and kills of every stage survived:
tests/integration/test_zero_bubble_runs.py.)
(The deadlock proof over random cut points covers both schedules:
`tests/test_failover_schedules.py`; so does the random-kill property test.)
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from bamboo.config.presets import preset
from bamboo.engine.split_backward import (
    Tape,
    Taping,
    deferred_linears,
    input_gradient,
    weight_gradient,
)
from bamboo.model import build_layers, layer_param_counts, loss_fn
from bamboo.plan import schedule as S
from bamboo.plan.partition import partition
from bamboo.plan.timeline import Costs, simulate_step


@pytest.mark.parametrize("P", range(1, 7))
@pytest.mark.parametrize("M", range(1, 9))
def test_zb_h1_lists_are_complete_ordered_and_bounded(P: int, M: int) -> None:
    for stage in range(P):
        lst = S.zb_h1(stage, P, M)
        for kind in (S.Forward, S.BackwardInput, S.BackwardWeight):
            assert sorted(i.mb for i in lst if isinstance(i, kind)) == list(range(M)), kind
        assert not any(isinstance(i, S.Backward) for i in lst)
        position = {i: n for n, i in enumerate(lst)}
        for mb in range(M):
            assert position[S.Forward(stage, mb)] < position[S.BackwardInput(stage, mb)] \
                < position[S.BackwardWeight(stage, mb)]
        in_flight = peak = 0  # forward done, weight gradient not yet: what activations hold
        for i in lst:
            in_flight += isinstance(i, S.Forward) - isinstance(i, S.BackwardWeight)
            peak = max(peak, in_flight)
        assert peak <= P  # 1F1B's peak (its stage 0's)
    S.simulate([S.zb_h1(s, P, M) for s in range(P)])  # raises on a deadlock


@pytest.mark.parametrize("P", range(1, 6))
@pytest.mark.parametrize("M", range(1, 9))
def test_zb_h1_cuts_the_bubble_to_a_third(P: int, M: int) -> None:
    """Forward, input gradient and weight gradient of one unit each: 1F1B's micro-batch
    phase takes 3(M + P - 1), ZB-H1's 3M + P - 1 (once M >= P), never more."""
    costs = Costs.uniform(P, 1.0, 2.0, weight_share=0.5)
    one = simulate_step(P, M, "off", costs).phase_a_s
    zb = simulate_step(P, M, "off", costs, schedule="zb-h1").phase_a_s
    assert one == pytest.approx(3 * (M + P - 1))
    assert zb <= one + 1e-9
    if M >= P:
        assert zb == pytest.approx(3 * M + P - 1)


def _stage(model: str, stage: int, stages: int) -> nn.Sequential:
    p = preset(model)
    parts = partition(layer_param_counts(p), stages)
    return nn.Sequential(*build_layers(p, parts[stage], seed=3))


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_split_gradients_are_the_whole_backwards(model: str, stage: int, precision: str) -> None:
    """Input gradient, then the linear layers' weight gradients from the tape: the very
    bits of one `backward()` in fp32 (and under bf16 autocast, the forward's arithmetic)."""
    p = preset(model)
    torch.manual_seed(0)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" \
        else contextlib.nullcontext
    whole, split = _stage(model, stage, 2), _stage(model, stage, 2)
    if stage == 0:
        x = torch.randint(0, p.vocab, (4, p.context))
    else:
        with torch.no_grad():
            x = _stage(model, 0, 2)(torch.randint(0, p.vocab, (4, p.context)))
    targets = torch.randint(0, p.vocab, (4, p.context))

    def run(module: nn.Module, inp: torch.Tensor) -> torch.Tensor:
        with autocast():
            out = module(inp)
        return loss_fn(p)(out.float(), targets) if stage == 1 else out.float().square().mean()

    x_whole = x.clone().requires_grad_(x.is_floating_point())
    run(whole, x_whole).backward()
    taping, tape = Taping(split), Tape()
    assert taping.linears  # the blocks' projections are deferred
    x_split = x.clone().requires_grad_(x.is_floating_point())
    with taping.recording(tape):
        loss = run(split, x_split)
    assert tape.layers() == taping.linears
    dx = input_gradient(loss, None, x_split if stage else None,
                        Taping.other_params(list(split.parameters()), tape), tape)
    deferred = {id(q) for m in taping.linears for q in m.parameters()}
    assert all(q.grad is None for q in split.parameters() if id(q) in deferred)
    weight_gradient(tape, autocast)
    if stage:
        assert torch.equal(dx, x_whole.grad)
    for (name, a), b in zip(whole.named_parameters(), split.parameters()):
        assert a.grad is not None and b.grad is not None, name
        assert torch.equal(a.grad, b.grad), name


def test_a_tied_linear_stays_in_the_first_half() -> None:
    """A linear layer sharing its weight with another module is not deferred: autograd sees
    both uses, and the gradients are the whole backward's."""
    embed = nn.Embedding(11, 6)
    head = nn.Linear(6, 11, bias=False)
    head.weight = embed.weight
    body = nn.Linear(6, 6)
    module = nn.Sequential(embed, body, head)
    assert deferred_linears(module) == {body}
    tokens = torch.randint(0, 11, (3, 5))
    module(tokens).square().mean().backward()
    expected = [q.grad.clone() for q in module.parameters()]
    module.zero_grad(set_to_none=True)
    taping, tape = Taping(module), Tape()
    with taping.recording(tape):
        out = module(tokens).square().mean()
    input_gradient(out, None, None, Taping.other_params(list(module.parameters()), tape), tape)
    weight_gradient(tape, contextlib.nullcontext)
    assert all(torch.equal(a, q.grad) for a, q in zip(expected, module.parameters()))


class _Odd(nn.Module):
    """Linear layers used in the ways a model written by hand may use them: one twice in a
    forward, one on a 2-D input, one whose weight is used without its forward (as
    `nn.MultiheadAttention` uses `out_proj`), one on a constant off the input's path."""

    def __init__(self) -> None:
        super().__init__()
        self.twice = nn.Linear(6, 6)
        self.flat = nn.Linear(6, 3)
        self.unused_forward = nn.Linear(6, 6)
        self.on_constant = nn.Linear(6, 6, bias=False)
        self.register_buffer("constant", torch.randn(5, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.twice(self.twice(x).tanh())
        h = torch.nn.functional.linear(h, self.unused_forward.weight, self.unused_forward.bias)
        h = h + self.on_constant(self.constant)
        return self.flat(h.mean(1))  # a 2-D input


def test_linear_layers_used_oddly_get_the_whole_backwards_gradients() -> None:
    torch.manual_seed(1)
    whole, split = _Odd(), _Odd()
    split.load_state_dict(whole.state_dict())
    x = torch.randn(4, 5, 6)
    x_whole = x.clone().requires_grad_()
    whole(x_whole).square().sum().backward()
    taping, tape = Taping(split), Tape()
    x_split = x.clone().requires_grad_()
    with taping.recording(tape):
        out = split(x_split).square().sum()
    assert split.unused_forward not in tape.layers()  # its weight is the first half's
    assert sum(e.layer is split.twice for e in tape.entries) == 2
    dx = input_gradient(out, None, x_split, Taping.other_params(list(split.parameters()), tape),
                        tape)
    weight_gradient(tape, contextlib.nullcontext)
    assert torch.equal(dx, x_whole.grad)
    for (name, a), b in zip(whole.named_parameters(), split.parameters()):
        assert b.grad is not None, name
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7), name
        if not name.startswith("twice"):  # one use each: the very bits
            assert torch.equal(a.grad, b.grad), name


def test_only_stages_that_defer_their_weights_split_the_backward() -> None:
    """Under ZB-H1 stage 0 runs each weight gradient right after its input gradient, so
    its backward stays whole; every later stage defers, and so splits."""
    from bamboo.plan.schedule import BackwardInput, BackwardWeight, defers_weight, zb_h1
    for P in (2, 3, 4):
        for s in range(P):
            order = zb_h1(s, P, 4)
            right_after = all(order[k + 1] == BackwardWeight(s, i.mb) for k, i in enumerate(order)
                              if isinstance(i, BackwardInput))
            assert defers_weight("zb-h1", s) == (not right_after), (P, s)
    assert not defers_weight("1f1b", 1)
