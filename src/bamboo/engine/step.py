"""What a node keeps during one step: the step's buffers, and apart from them its transfer
log (what it sent and received, which a failover and a group rebuild read). Both are
dropped at the commit."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from bamboo.data.datasets import Batch
from bamboo.engine.comm import Key
from bamboo.engine.memory import StepMemory
from bamboo.plan import schedule as S
from bamboo.plan.roles import Takeover
from bamboo.protocol.votes import StepReport

__all__ = ["StepState", "TransferLog"]

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
    restores: list[tuple[str, Takeover]] = field(default_factory=list)
    """Peer restores of the latest role change still to carry out: ("send" | "recv", move)."""
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
    restarted: bool = False
    """A re-route restarted the step since the transport last settled: nothing of it was
    sent or received under the new roles, so there is nothing to settle."""
    report: StepReport | None = None

    def backward_begun(self, stage: int, mb: int) -> bool:
        """Whether this node has run the backward (1F1B) or input gradient (ZB-H1) of
        (`stage`, `mb`) in this step."""
        return S.Backward(stage, mb) in self.done or S.BackwardInput(stage, mb) in self.done

    def restart(self) -> None:
        """A stage was re-routed: drop everything of the step under way (its buffers, its
        transfer log) so it runs again, whole, under the new roles (the caller resets the
        stages' gradient sums). Peer restores still to carry out are kept: a peer restore
        moves a stage's state, not the step's."""
        self.done.clear()
        for buffers in (self.inputs, self.outputs, self.saved_out, self.out_grads, self.in_grads,
                        self.tapes, self.frc_tapes, self.weight_work, self.frc, self.losses,
                        self.metrics):
            buffers.clear()
        self.frc_pending.clear()
        self.adopted.clear()
        self.transfers = TransferLog()
        self.memory.release_all()
        self.restarted = True
        self.report.restarts += 1
