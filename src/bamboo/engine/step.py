"""What a node keeps during one step: the step's buffers, and apart from them its transfer
log (what it sent and received, which a failover and a group rebuild read), and what the
step's report will count (`StepTally`). All are dropped at the commit.

One writer: the engine (`engine.py`) writes a `StepState`, directly or through the
methods below, which only it calls. The transport, the transfers, a stage's forward and a
failover return what they produced or received, and the engine puts it here; only the
transfer log is written by the transfers that it logs (`transfers.py`, `transport.py`).
`tests/unit/control/test_writers.py` fails on another writer."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from bamboo.data.datasets import Batch
from bamboo.engine.comm import Key
from bamboo.engine.context import NodeContext
from bamboo.engine.memory import StepMemory
from bamboo.model.structure import detach
from bamboo.plan import schedule as S

__all__ = ["StepState", "StepTally", "TransferLog", "Forwarded", "Received", "StepChange",
           "Restarted", "Adopted", "Settled"]

Slot = tuple[int, int]
"""(stage, micro-batch)."""


@dataclass(slots=True)
class TransferLog:
    """The step's traffic, as a failover or a rebuilt group needs to know it."""

    sent: dict[Key, torch.Tensor] = field(default_factory=dict)
    """Every activation and gradient this node sent in this step, as sent (a structure
    packed into its one message; strict: resent to a peer that did not get it before the
    group was rebuilt)."""
    peer_has: set[Key] = field(default_factory=set)
    """Transfers their receiver already holds (strict, after a rebuild): not sent again."""
    sent_grads: dict[Slot, torch.Tensor] = field(default_factory=dict)
    """Input gradients sent upstream, as sent (a lost predecessor's shadow needs them again)."""
    received_acts: set[Slot] = field(default_factory=set)
    """Activations received from another node."""
    dup_recvs: list[tuple[Any, int]] = field(default_factory=list)
    """(tagged) receives posted for activations a new holder sends again: (work, peer)."""


Received = list[tuple[S.RecvActivation | S.RecvGrad, Any]]
"""What a transport's settle received, in order: each receive with its input or gradient."""


@dataclass(frozen=True, slots=True)
class Restarted:
    """A re-route: the step under way runs again, whole (`StepState.restart`)."""


@dataclass(frozen=True, slots=True)
class Adopted:
    """The node now holds `stage`: from its replica (a failover, with its eager FRC
    results) or restored from a peer (`StepState.adopt`)."""

    stage: int
    from_replica: bool
    promotion_s: float = 0.0
    """A failover: seconds to bring the replica to the device (`StageState.promote`)."""


@dataclass(frozen=True, slots=True)
class Settled:
    """What the transport received settling the step's transfers on a new group."""

    received: Received


StepChange = Restarted | Adopted | Settled
"""What a failover does to the step under way (`failover.recover` yields them)."""


@dataclass(slots=True)
class StepTally:
    """The step's timers, counters and optimizer figures, as its `StepReport` names them;
    the engine builds the report from them once, when the step commits."""

    compute_s: float = 0.0
    frc_s: float = 0.0
    reduce_s: float = 0.0
    optim_s: float = 0.0
    frc_forwards: int = 0
    frc_in_waits: int = 0
    frc_reused: int = 0
    brc: int = 0
    attempts: int = 1
    restarts: int = 0
    saved_bytes: int = 0
    frc_saved_bytes: int = 0
    bytes_replica: int = 0
    grad_norm: float = 0.0
    lr: float = 0.0
    skipped: bool = False
    loss_scale: float = 1.0
    promotion_s: list[float] = field(default_factory=list)

    def as_report(self) -> dict[str, Any]:
        """These figures as the report's fields."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class Forwarded:
    """What one stage forward produced (`forward.StageForward.run`)."""

    out: Any
    """Its output; for the last stage, its weighted loss."""
    loss: float | None
    """The last stage's loss value."""
    tape: Any
    """ZB-H1: what the weight gradient needs (`split_backward.Tape`), or None."""
    metrics: dict[str, float] | None
    """The last stage's `--metric` values."""
    device_bytes: int
    host_bytes: int
    """What autograd saved for the backward, on the device and (offloaded) on the host."""


@dataclass(slots=True)
class StepState:
    """The buffers of one step on one node."""

    step: int
    done: set = field(default_factory=set)
    """Instructions carried out (a failover's longer list skips them)."""
    inputs: dict[Slot, Any] = field(default_factory=dict)
    """A stage's input: a tensor, or a tuple or dict of them (`bamboo.model.structure`)."""
    outputs: dict[Slot, Any] = field(default_factory=dict)
    saved_out: dict[Slot, Any] = field(default_factory=dict)
    """Stage outputs kept for the whole step: a shadow's or FRC's input."""
    out_grads: dict[Slot, Any] = field(default_factory=dict)
    """A stage output's gradient: a tensor, or a tuple with one per float tensor."""
    in_grads: dict[Slot, Any] = field(default_factory=dict)
    tapes: dict[Slot, Any] = field(default_factory=dict)
    """ZB-H1: what each forward taped for its weight gradient (`split_backward.Tape`)."""
    frc_tapes: dict[int, Any] = field(default_factory=dict)
    """ZB-H1: the tapes of eager FRC forwards, by micro-batch (a failover adopts them)."""
    weight_work: dict[Slot, Any] = field(default_factory=dict)
    """ZB-H1: the tapes whose `BackwardInput` ran, for their `BackwardWeight`."""
    transfers: TransferLog = field(default_factory=TransferLog)
    memory: StepMemory = field(default_factory=StepMemory)
    """What the step holds on top of the stages' state (saved activations, kept outputs, FRC)."""
    frc: dict[int, tuple[Any, Any, float | None]] = field(default_factory=dict)
    """Eager FRC results by micro-batch: (input, output, loss value of the last stage)."""
    frc_pending: list[Any] = field(default_factory=list)
    """Eager FRC whose input is ready, kept for the node's next wait (`--frc-at waits`)."""
    losses: dict[int, float] = field(default_factory=dict)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    """The job's metrics (`--metric`) of each micro-batch whose last stage ran here (an eager
    FRC's too: the same values, taken once per micro-batch by the coordinator)."""
    batches: dict[int, Batch] = field(default_factory=dict)
    adopted: set[int] = field(default_factory=set)
    tally: StepTally = field(default_factory=StepTally)

    def backward_begun(self, stage: int, mb: int) -> bool:
        """Whether this node has run the backward (1F1B) or input gradient (ZB-H1) of
        (`stage`, `mb`) in this step."""
        return S.Backward(stage, mb) in self.done or S.BackwardInput(stage, mb) in self.done

    def restart(self) -> None:
        """A stage was re-routed: drop everything of the step under way (its buffers, its
        transfer log) so it runs again, whole, under the new roles (the caller resets the
        stages' gradient sums)."""
        self.done.clear()
        for buffers in (self.inputs, self.outputs, self.saved_out, self.out_grads, self.in_grads,
                        self.tapes, self.frc_tapes, self.weight_work, self.frc, self.losses,
                        self.metrics):
            buffers.clear()
        self.frc_pending.clear()
        self.adopted.clear()
        self.transfers = TransferLog()
        self.memory.release_all()
        self.tally.restarts += 1

    def apply(self, ctx: NodeContext, change: StepChange) -> None:
        """What a failover did to the step under way, into its buffers."""
        if isinstance(change, Restarted):
            self.restart()
        elif isinstance(change, Adopted):
            self.adopt(ctx, change.stage, change.from_replica, change.promotion_s)
        else:
            for instr, value in change.received:
                self.received(instr, value)

    def forwarded(self, stage: int, mb: int, f: Forwarded, frc: bool) -> None:
        """What a forward of (`stage`, `mb`) leaves besides its output: its metrics, its
        tape (an eager FRC's by micro-batch) and its saved bytes, held until the backward."""
        if f.metrics is not None:
            self.metrics[mb] = f.metrics
        if f.tape is not None:
            if frc:
                self.frc_tapes[mb] = f.tape
            else:
                self.tapes[(stage, mb)] = f.tape
        if frc:
            self.tally.frc_saved_bytes += f.device_bytes + f.host_bytes
        else:
            self.tally.saved_bytes += f.device_bytes
        self.memory.hold(("frc" if frc else "fwd", stage, mb), f.device_bytes, f.host_bytes)

    def received(self, instr: S.RecvActivation | S.RecvGrad, value: Any) -> None:
        """A transfer settled after a group rebuild arrived: `instr` is done."""
        key = (instr.stage, instr.mb)
        if isinstance(instr, S.RecvGrad):
            self.out_grads[key] = value
        else:
            self.inputs[key] = value
            self.transfers.received_acts.add(key)
        self.done.add(instr)

    def adopt(self, ctx: NodeContext, stage: int, from_replica: bool,
              promotion_s: float = 0.0) -> None:
        """This node took over `stage` (a failover adopting its replica, or a peer restore):
        set up the step's work on it. Inputs kept for a shadow are its inputs; a failover's
        eager FRC results are its forwards (its backward passes are all redone)."""
        self.adopted.add(stage)
        if from_replica:
            self.tally.promotion_s.append(round(promotion_s, 6))
        for mb in ctx.global_mbs:
            key = (stage, mb)
            if stage > 0 and (stage - 1, mb) in self.saved_out:
                self.inputs[key] = ctx.boundary_spec(stage, input_side=True).as_input(
                    self.saved_out[(stage - 1, mb)])
                self.done.add(S.RecvActivation(stage, mb))
            if mb in self.frc and from_replica:
                x, out, loss = self.frc.pop(mb)
                self.inputs[key], self.outputs[key] = x, out
                if mb in self.frc_tapes:
                    self.tapes[key] = self.frc_tapes.pop(mb)
                if loss is not None:
                    self.losses[mb] = loss
                else:
                    self.saved_out[key] = detach(out)
                self.done.update({S.RecvActivation(stage, mb), S.Forward(stage, mb)})
                self.tally.frc_reused += 1
            sent_grads = self.transfers.sent_grads
            if (stage + 1, mb) in sent_grads and not self.backward_begun(stage, mb):
                self.out_grads[key] = ctx.boundary_spec(stage, input_side=False).unpack_grad(
                    sent_grads[(stage + 1, mb)])  # this node is also the successor
        self.frc.clear()
        self.frc_tapes.clear()
        self.frc_pending.clear()
