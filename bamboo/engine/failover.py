"""In-flight failover: the role maps the coordinator publishes, applied to the step under way.

A shadow adopts the lost stage (from its replica, with the eager FRC results, or restored
from a peer pipeline) and its instruction list grows by that stage's work, all of whose
backward passes it redoes; under `--redundancy reroute` the lost stage's data-parallel
peers take its micro-batches and every node starts the step under way again; the transport (`bamboo.engine.transport`) makes the lost
stage's successor get what it needs again; peer restores send or receive a stage's whole
state. Nothing restarts and the step ends with the bits a failure-free step gives.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from bamboo.plan import schedule as S
from bamboo.engine.comm import RESTORE, Interrupted, PeerLost
from bamboo.engine.stage import StageState
from bamboo.engine.step import StepState
from bamboo.plan.roles import RoleMap, Takeover

if TYPE_CHECKING:
    from bamboo.engine.engine import NodeEngine

__all__ = ["GenerationEnded", "recover"]


class GenerationEnded(Exception):
    """The coordinator abandoned this generation mid-step (a loss no copy covers in flight):
    the step under way is dropped and the node's state is that of the last commit."""


def recover(e: NodeEngine, s: StepState, wait: bool) -> None:
    """Catch up with the roles; a peer lost while applying them (a restore's source, a
    member of the group being formed) only means more roles to wait for."""
    while True:
        try:
            _catch_up(e, s, wait)
            return
        except PeerLost as lost:
            wait = lost.peer not in e.roles.dead
        except Interrupted:
            wait = False  # newer roles are already published


def _catch_up(e: NodeEngine, s: StepState, wait: bool) -> None:
    """Apply every role map the coordinator published since ours, then let the transport
    settle the step's transfers, then carry out restores."""
    maps = e.link.next_epochs(e.roles.epoch, wait)
    if maps:
        e.transport.roles_arriving()
    for roles in maps:
        _apply_roles(e, s, roles)
    e.transport.settle(s)
    p2p = e.transport.p2p
    for action, t in [r for r in s.restores if r[0] == "send"]:
        state = e.stages[t.stage].state_vector()
        p2p.send(state, t.new_holder, (RESTORE, t.stage, 0))
        s.restores.remove((action, t))
    while s.restores:
        _, t = s.restores[0]
        st = e.build(t.stage)
        buf = torch.empty(st.state_size(), dtype=torch.float32, device=e.device)
        # A lost source raises PeerLost: the coordinator, seeing the source gone
        # mid-restore, abandons the generation (and this node never claims the stage).
        work = p2p.post_recv(buf, t.source, (RESTORE, t.stage, 0))
        p2p.wait_interruptible(work, t.source, e.interrupted)
        st.load_state_vector(buf)
        _install(e, s, t, st)
        s.restores.pop(0)


def _apply_roles(e: NodeEngine, s: StepState, new: RoleMap) -> None:
    if new.abandon:
        raise GenerationEnded()
    e.roles = new
    e.transport.roles_applied(new)
    if new.rerouted:  # `--redundancy reroute`: the step runs again, whole, under these roles
        e.restart_step(s)
    for t in new.takeovers:
        if t.pipeline == e.pipeline and t.new_holder == e.rank:
            _adopt(e, s, t)
        else:
            e.transport.takeover(s, t)
        if t.source == e.rank:
            s.restores.append(("send", t))
    if e.replica is not None and new.replica_of(e.rank) != e.replica.stage:
        e.replica = None


def _adopt(e: NodeEngine, s: StepState, t: Takeover) -> None:
    """Take over stage `t.stage` for the rest of this step and after: at once from the
    replica, or once its state has arrived from `t.source` (`s.restores`)."""
    if t.kind == "failover":
        assert e.replica is not None and e.replica.stage == t.stage
        st, e.replica = e.replica, None
        st.to_device_optimizer()  # --frc-offload kept its AdamW moments in host memory
        e.frc_results_complete()
        _install(e, s, t, st)
    else:
        s.restores.append(("recv", t))


def _install(e: NodeEngine, s: StepState, t: Takeover, st: StageState) -> None:
    """Make `st` this node's stage `t.stage` and set up the step's work on it."""
    stage = t.stage
    e.stages[stage] = st
    s.adopted.add(stage)
    for mb in e.global_mbs:
        key = (stage, mb)
        if stage > 0 and (stage - 1, mb) in s.saved_out:
            s.inputs[key] = s.saved_out[(stage - 1, mb)].detach().requires_grad_()
            s.done.add(S.RecvActivation(stage, mb))
        if mb in s.frc and t.kind == "failover":
            x, out, loss = s.frc.pop(mb)
            s.inputs[key], s.outputs[key] = x, out
            if mb in s.frc_tapes:
                s.tapes[key] = s.frc_tapes.pop(mb)
            if loss is not None:
                s.losses[mb] = loss
            else:
                s.saved_out[key] = out.detach()
            s.done.update({S.RecvActivation(stage, mb), S.Forward(stage, mb)})
            s.report.frc_reused += 1
        sent_grads = s.transfers.sent_grads
        if (stage + 1, mb) in sent_grads and not e.backward_begun(s, stage, mb):
            s.out_grads[key] = sent_grads[(stage + 1, mb)]  # this node is also the successor
    s.frc.clear()
    s.frc_tapes.clear()
    s.frc_pending.clear()
