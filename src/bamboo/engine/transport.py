"""How a node's transfers survive a lost peer: the two contracts the engine can run under.

- `StrictTransport` (`--comm strict`, the default; NCCL's rules on every backend): no tags,
  messages matched by posting order. On every role change the group is abandoned (NCCL:
  aborted); the survivors form a new one, and at each stage boundary the two sides swap
  manifests of what they sent and received in this step and send again what is missing.
  Gradients get a group of their own (the gradient lane), so the two directions of a
  boundary never wait on each other.
- `TaggedTransport` (`--comm tagged`, gloo only): tagged transfers on a group that outlives
  lost peers. The successor of a lost stage sends its gradients of this step again to the
  new holder and takes every activation again from it.

The engine calls, in this order: `prepare(roles)` before a step's instructions; on new
roles `roles_arriving()`, `roles_applied(new)` then `takeover(step, t, stages)` for each
takeover the node does not adopt itself; and `settle(step, roles, restarted)` once every
role map is applied, which returns what it received (the engine puts it in the step's
buffers). A transport knows the node by its `NodeContext`, never the engine; of the step
it writes only the transfer log, and it counts its own work (`TransportCounts`, which the
step's report takes).
"""
from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

import torch

from bamboo.engine.comm import ACTIVATION, GRADIENT, MANIFEST, P2P, form_interruptibly
from bamboo.engine.context import NodeContext
from bamboo.engine.step import Received, StepState
from bamboo.plan import schedule as S
from bamboo.plan.roles import RoleMap, Takeover

__all__ = ["Transport", "StrictTransport", "TaggedTransport", "make_transport",
           "TransportCounts"]

@dataclass(slots=True)
class TransportCounts:
    """What a transport did since it was made (the engine takes each step's difference)."""

    rebuilds: int = 0
    """strict: process groups formed among the survivors."""
    rebuild_s: float = 0.0
    """strict: seconds those formations took, with settling the step's transfers."""
    resent_grads: int = 0
    """Gradients sent again to a lost stage's new holder."""


class Transport(Protocol):
    p2p: P2P
    counts: TransportCounts

    def prepare(self, roles: RoleMap) -> None: ...

    def roles_arriving(self) -> None: ...

    def roles_applied(self, new: RoleMap) -> None: ...

    def takeover(self, s: StepState, t: Takeover, stages: Collection[int]) -> None: ...

    def settle(self, s: StepState, roles: RoleMap, restarted: bool) -> Received: ...


def make_transport(ctx: NodeContext, comm: str, group: object) -> Transport:
    """The transport of `--comm` (strict | tagged) over the generation's `group`."""
    cls = StrictTransport if comm == "strict" else TaggedTransport
    return cls(ctx, group)


class TaggedTransport:
    def __init__(self, ctx: NodeContext, group: object) -> None:
        self.ctx, self.counts = ctx, TransportCounts()
        self.p2p = P2P(group, strict=False, device=ctx.device, former=ctx.former, name="g")

    def prepare(self, roles: RoleMap) -> None:
        pass

    def roles_arriving(self) -> None:
        pass

    def roles_applied(self, new: RoleMap) -> None:
        self.p2p.forget(set(new.dead))
        if new.rerouted:
            # The step starts again: a transfer of the dropped attempt still in flight on
            # this group would match the same key of the new one, so it gets a new group.
            self.p2p.abandon()

    def takeover(self, s: StepState, t: Takeover, stages: Collection[int]) -> None:
        """As the lost stage's successor (holding `stages`): send this step's gradients
        again, take every activation again (the new holder sends all of them)."""
        e = self.ctx
        if t.pipeline != e.pipeline or (t.stage + 1) % e.P not in stages or t.stage == e.P - 1:
            return
        log, successor = s.transfers, t.stage + 1
        for (st, mb), grad in sorted(log.sent_grads.items()):
            if st == successor:
                self.p2p.send(grad, t.new_holder, (GRADIENT, st, mb))
                self.counts.resent_grads += 1
        spec = e.boundary_spec(successor, input_side=True)
        for st, mb in sorted(log.received_acts):
            if st == successor:
                buf = torch.empty(spec.shape, dtype=spec.dtype, device=e.device)
                work = self.p2p.post_recv(buf, t.new_holder, (ACTIVATION, t.stage, mb))
                log.dup_recvs.append((work, t.new_holder))

    def settle(self, s: StepState, roles: RoleMap, restarted: bool) -> Received:
        """After a re-route: the survivors' new group (tags as before); nothing received."""
        if not self.p2p.abandoned:
            return []
        e = self.ctx
        start = time.perf_counter()
        members = roles.active_ranks()
        assert e.former is not None, "a re-route needs a group former"
        group = form_interruptibly(e.former, f"e{roles.epoch}", members, e.interrupted(roles))
        self.p2p = P2P(group, strict=False, ranks=members, device=e.device, former=e.former,
                       name=f"e{roles.epoch}")
        e.link.on_epoch = self.p2p.wake.set
        self.counts.rebuild_s += time.perf_counter() - start
        self.counts.rebuilds += 1
        return []


class StrictTransport:
    def __init__(self, ctx: NodeContext, group: object) -> None:
        self.ctx, self.counts = ctx, TransportCounts()
        self.p2p = P2P(group, strict=True, device=ctx.device, former=ctx.former, name="g")

    def prepare(self, roles: RoleMap) -> None:
        """The generation's group carries activations and control messages; gradients get a
        group of their own among the active nodes, formed before the first step."""
        if self.p2p.gradient_group is not None:
            return
        e = self.ctx
        assert e.former is not None, "strict communication needs a group former"
        members = roles.active_ranks()
        self.p2p.gradient_group = form_interruptibly(e.former, "g.grad", members,
                                                     e.interrupted(roles))
        self.p2p.gradient_ranks = members

    def roles_arriving(self) -> None:
        self.p2p.abandon()  # a member is gone: nothing more is sent on this group

    def roles_applied(self, new: RoleMap) -> None:
        pass

    def takeover(self, s: StepState, t: Takeover, stages: Collection[int]) -> None:
        pass  # what the successor must receive again is settled on the new group

    def settle(self, s: StepState, roles: RoleMap, restarted: bool) -> Received:
        """Form the survivors' group for the current roles and settle the step's transfers
        on it (unless a re-route `restarted` the step since the last settle: nothing of it
        is in flight); what that received. Interrupted when newer roles come first (a
        member was lost meanwhile: the next catch-up forms that epoch's group)."""
        if not self.p2p.abandoned:
            return []
        e = self.ctx
        start = time.perf_counter()
        members = roles.active_ranks()
        name = f"e{roles.epoch}"
        interrupted = e.interrupted(roles)
        assert e.former is not None, "strict communication needs a group former"
        group = form_interruptibly(e.former, name, members, interrupted)
        gradients = form_interruptibly(e.former, f"{name}.grad", members, interrupted)
        self.p2p = P2P(group, strict=True, gradient_group=gradients, ranks=members,
                       device=e.device, former=e.former, name=name)
        e.link.on_epoch = self.p2p.wake.set
        received = [] if restarted else self._settle_transfers(s, roles)
        self.counts.rebuild_s += time.perf_counter() - start
        self.counts.rebuilds += 1
        return received

    def _boundaries(self, roles: RoleMap) -> list[tuple[int, int, bool]]:
        """(t, peer, upstream) for each stage boundary t|t+1 of this node's pipeline that this
        node shares with another: upstream when this node holds t (it sends activations and
        receives gradients there). In boundary order, which both sides share."""
        e = self.ctx
        row = roles.holders[e.pipeline]
        out = []
        for t in range(e.P - 1):
            a, b = row[t], row[t + 1]
            if a != b and e.rank in (a, b):
                out.append((t, b if a == e.rank else a, a == e.rank))
        return out

    def _settle_transfers(self, s: StepState, roles: RoleMap) -> Received:
        """After a rebuild, what was in flight on the dropped group is gone. At each shared
        boundary the two nodes swap manifests (one batch: which activations and gradients of
        this step each has sent and has received there), then the sender sends again, in
        micro-batch order, what it sent and the receiver lacks; what the receiver already has
        (from the lost node, say) is not sent again. The schedule then goes on, with what
        this node received."""
        e, log, M = self.ctx, s.transfers, self.ctx.M
        mbs = e.global_mbs
        boundaries = self._boundaries(roles)
        mine, theirs = [], []
        for t, peer, upstream in boundaries:
            acts = [(ACTIVATION, t, mb) for mb in mbs]
            grads = [(GRADIENT, t + 1, mb) for mb in mbs]
            if upstream:
                flags = [k in log.sent for k in acts] + \
                    [S.RecvGrad(t, mb) in s.done for mb in mbs]
            else:
                flags = [S.RecvActivation(t + 1, mb) in s.done for mb in mbs] + \
                    [k in log.sent for k in grads]
            mine.append((torch.tensor(flags, dtype=torch.int32, device=e.device), peer,
                         (MANIFEST, t, 0)))
            theirs.append((torch.zeros(2 * M, dtype=torch.int32, device=e.device), peer,
                           (MANIFEST, t, 0)))
        self._exchange(mine, theirs, roles)
        log.peer_has = set()
        sends, recvs, sinks = [], [], []
        for (t, peer, upstream), (flags, _, _) in zip(boundaries, theirs):
            flags = flags.tolist()
            out_kind, out_stage, in_kind, in_stage = (ACTIVATION, t, GRADIENT, t + 1) if upstream \
                else (GRADIENT, t + 1, ACTIVATION, t)
            spec = e.boundary_spec(t, input_side=False)
            for i, mb in enumerate(mbs):
                key = (out_kind, out_stage, mb)
                if flags[i if upstream else M + i] == 0 and key in log.sent:
                    sends.append((log.sent[key], peer, key))
                    self.counts.resent_grads += out_kind == GRADIENT
                elif flags[i if upstream else M + i]:
                    log.peer_has.add(key)
            for i, mb in enumerate(mbs):
                instr = S.RecvGrad(t, mb) if upstream else S.RecvActivation(t + 1, mb)
                if flags[M + i if upstream else i] and instr not in s.done:
                    shape, dtype = (spec.grad_shape, spec.grad_dtype) if upstream else \
                        (spec.shape, spec.dtype)
                    buf = torch.empty(shape, dtype=dtype, device=e.device)
                    recvs.append((buf, peer, (in_kind, in_stage, mb)))
                    sinks.append((instr, spec))
        self._exchange(sends, recvs, roles)
        return [(instr, spec.unpack_grad(buf) if isinstance(instr, S.RecvGrad)
                 else spec.as_input(spec.unpack(buf)))
                for (instr, spec), (buf, _, _) in zip(sinks, recvs)]

    def _exchange(self, sends: list, recvs: list, roles: RoleMap) -> None:
        interrupted = self.ctx.interrupted(roles)
        for work, peer in self.p2p.exchange(sends, recvs):
            self.p2p.wait_interruptible(work, peer, interrupted)
