"""The four transfer instructions of a node's list (`SendActivation`, `RecvActivation`,
`SendGrad`, `RecvGrad`): a boundary's tensors packed into one message, kept until the peer
has them (a failed send is retried), or passed in memory when the peer is this node. Each
returns what the node's step gets from it (an input, a gradient), which the engine puts in
the step's buffers; they write only the step's transfer log."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bamboo.engine.comm import ACTIVATION, GRADIENT, P2P
from bamboo.engine.context import NodeContext
from bamboo.engine.step import StepState
from bamboo.model.structure import detach
from bamboo.plan import schedule as S

__all__ = ["send_activation", "recv_activation", "send_grad", "recv_grad"]


def send_activation(ctx: NodeContext, p2p: P2P, s: StepState, i: S.SendActivation,
                    peer: int) -> Any | None:
    """Stage `i.stage`'s output of `i.mb` to `peer`, which runs the next stage; when that is
    this node, the next stage's input (None: nothing to put, or it was sent)."""
    out = detach(s.outputs[(i.stage, i.mb)])
    spec = ctx.boundary_spec(i.stage, input_side=False)
    if peer != ctx.rank:
        key = (ACTIVATION, i.stage, i.mb)
        if key not in s.transfers.peer_has:
            wire = spec.pack(out)  # a tuple or dict of tensors: one message
            p2p.send(wire, peer, key)
            s.transfers.sent[key] = wire
    elif S.Forward(i.stage + 1, i.mb) not in s.done:
        return spec.as_input(out)
    return None


def recv_activation(ctx: NodeContext, p2p: P2P, s: StepState, i: S.RecvActivation, peer: int,
                    interrupted: Callable[[], bool], idle: Callable[[], bool]) -> Any | None:
    """Stage `i.stage`'s input of `i.mb` from `peer`; `idle` runs while it waits."""
    if peer == ctx.rank:
        return None  # passed in memory by this node's own SendActivation, earlier in the list
    key = (i.stage, i.mb)
    spec = ctx.boundary_spec(i.stage, input_side=True)
    buf = p2p.recv_interruptible(spec.shape, spec.dtype, ctx.device, peer,
                                 (ACTIVATION, i.stage - 1, i.mb), interrupted, idle=idle)
    s.transfers.received_acts.add(key)
    return spec.as_input(spec.unpack(buf))


def send_grad(ctx: NodeContext, p2p: P2P, s: StepState, i: S.SendGrad, peer: int) -> Any | None:
    """The gradient of stage `i.stage`'s input of `i.mb` to `peer`, which ran the stage
    before; when that is this node, that stage's output gradient (else None). The engine
    then drops the input gradient."""
    grad = s.in_grads[(i.stage, i.mb)]  # kept until sent: a failed send is retried
    if peer != ctx.rank:
        key = (GRADIENT, i.stage, i.mb)
        wire = ctx.boundary_spec(i.stage, input_side=True).pack_grad(grad)
        if key not in s.transfers.peer_has:
            p2p.send(wire, peer, key)
            s.transfers.sent[key] = wire
        s.transfers.sent_grads[(i.stage, i.mb)] = wire
    elif not s.backward_begun(i.stage - 1, i.mb):
        return grad
    return None


def recv_grad(ctx: NodeContext, p2p: P2P, s: StepState, i: S.RecvGrad, peer: int,
              interrupted: Callable[[], bool], idle: Callable[[], bool]) -> Any | None:
    """The gradient of stage `i.stage`'s output of `i.mb` from `peer`, which ran the next."""
    if peer == ctx.rank:
        return None  # passed in memory by this node's own SendGrad
    spec = ctx.boundary_spec(i.stage, input_side=False)
    return spec.unpack_grad(p2p.recv_interruptible(
        spec.grad_shape, spec.grad_dtype, ctx.device, peer, (GRADIENT, i.stage + 1, i.mb),
        interrupted, idle=idle))
