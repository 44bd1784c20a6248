"""In-flight failover: the role maps the coordinator publishes, applied to the step under way.

A shadow adopts the lost stage (from its replica, with the eager FRC results, or restored
from a peer pipeline) and its instruction list grows by that stage's work, all of whose
backward passes it redoes; under `--redundancy reroute` the lost stage's data-parallel
peers take its micro-batches and every node starts the step under way again; the
transport (`bamboo.engine.transport`) makes the lost stage's successor get what it needs
again; peer restores send or receive a stage's whole state. Nothing restarts and the step
ends with the bits a failure-free step gives.

`recover` reads the node's facts (`context.NodeContext`), what it holds (`context.Held`)
and the step's buffers (`StepState`), and returns what the node holds under the newest
roles; the engine installs that. It writes neither the engine nor the step: as it goes it
yields what the step gets from it (`Restarted`, `Adopted`, `Settled`), which the engine
applies to the step at once, before the failover goes on.
"""
from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, replace

import torch

from bamboo.engine.comm import RESTORE, Interrupted, PeerLost
from bamboo.engine.context import Held, NodeContext
from bamboo.engine.stage import StageState
from bamboo.engine.step import Adopted, Restarted, Settled, StepChange, StepState
from bamboo.engine.transport import Transport
from bamboo.plan.roles import RoleMap, Takeover

__all__ = ["GenerationEnded", "Recovery", "recover"]

Changes = Generator[StepChange, None, None]


class GenerationEnded(Exception):
    """The coordinator abandoned this generation mid-step (a loss no copy covers in flight):
    the step under way is dropped and the node's state is that of the last commit.
    `held`: what the node held when the abandoning roles came (the engine installs it)."""

    def __init__(self, held: Held) -> None:
        super().__init__()
        self.held = held


@dataclass(frozen=True, kw_only=True, slots=True)
class Recovery:
    """What a failover works with besides the node's facts: the transport that carries the
    node's transfers, how to build a fresh stage (a peer restore's target), and how to wait
    for the eager FRC results a failover adopts."""

    transport: Transport
    build: Callable[[int], StageState]
    frc_results_complete: Callable[[], None]


def recover(ctx: NodeContext, r: Recovery, held: Held, s: StepState,
            wait: bool) -> Generator[StepChange, None, Held]:
    """Catch up with the roles: yields each change to the step as it happens, and returns
    what the node holds under the newest roles. A peer lost while applying them (a
    restore's source, a member of the group being formed) only means more roles to wait
    for. GenerationEnded when the coordinator abandons the generation."""
    catch_up = _CatchUp(ctx, r, held, s)
    while True:
        try:
            yield from catch_up.run(wait)
            return catch_up.held
        except PeerLost as lost:
            wait = lost.peer not in catch_up.held.roles.dead
        except Interrupted:
            wait = False  # newer roles are already published


class _CatchUp:
    """One recovery under way: `held` is what the node holds so far (each role map applied
    and each stage installed replaces it), the peer restores still to carry out and
    whether a re-route restarted the step since the transport last settled, kept across
    the retries of `recover` (a recovery returns with no restore left and settled)."""

    def __init__(self, ctx: NodeContext, r: Recovery, held: Held, s: StepState) -> None:
        self.ctx, self.r, self.held, self.s = ctx, r, held, s
        self.restores: list[tuple[str, Takeover]] = []
        """Peer restores of the latest role change still to carry out: ("send" | "recv",
        move); a re-route keeps them (a peer restore moves a stage's state, not the step's)."""
        self.restarted = False
        """A re-route restarted the step since the transport last settled: nothing of it
        was sent or received under the new roles, so there is nothing to settle."""

    def run(self, wait: bool) -> Changes:
        """Apply every role map the coordinator published since ours, then let the
        transport settle the step's transfers, then carry out restores."""
        ctx, s, transport = self.ctx, self.s, self.r.transport
        maps = ctx.link.next_epochs(self.held.roles.epoch, wait)
        if maps:
            transport.roles_arriving()
        for roles in maps:
            yield from self._apply_roles(roles)
        before = transport.p2p
        received = transport.settle(s, self.held.roles, self.restarted)
        if transport.p2p is not before:  # a new group: the restarted step is settled
            self.restarted = False
        if received:
            yield Settled(received)
        p2p = transport.p2p
        for action, t in [r for r in self.restores if r[0] == "send"]:
            state = self.held.stages[t.stage].state_vector()
            p2p.send(state, t.new_holder, (RESTORE, t.stage, 0))
            self.restores.remove((action, t))
        while self.restores:
            _, t = self.restores[0]
            st = self.r.build(t.stage)
            buf = torch.empty(st.state_size(), dtype=torch.uint8, device=ctx.device)
            # A lost source raises PeerLost: the coordinator, seeing the source gone
            # mid-restore, abandons the generation (and this node never claims the stage).
            work = p2p.post_recv(buf, t.source, (RESTORE, t.stage, 0))
            p2p.wait_interruptible(work, t.source, ctx.interrupted(self.held.roles))
            st.load_state_vector(buf)
            yield from self._install(t, st)
            self.restores.pop(0)

    def _apply_roles(self, new: RoleMap) -> Changes:
        ctx, s = self.ctx, self.s
        if new.abandon:
            raise GenerationEnded(self.held)
        first_reroute = not self.held.roles.reroutes
        self.held = replace(self.held, roles=new)
        self.r.transport.roles_applied(new)
        # `--redundancy reroute`: the step runs again, whole, under these roles; but at one
        # stage no node sent another anything of it, and a generation's first re-route moves
        # no micro-batch a survivor served: each keeps what it finished and adds the lost
        # slot's share
        if new.rerouted and (ctx.P > 1 or not first_reroute):
            for st in self.held.stages.values():
                st.reset_grads()
            self.restarted = True
            yield Restarted()
        for t in new.takeovers:
            if t.pipeline == ctx.pipeline and t.new_holder == ctx.rank:
                yield from self._adopt(t)
            else:
                self.r.transport.takeover(s, t, self.held.stages)
            if t.source == ctx.rank:
                self.restores.append(("send", t))
        replica = self.held.replica
        if replica is not None and new.replica_of(ctx.rank) != replica.stage:
            self.held = replace(self.held, replica=None)

    def _adopt(self, t: Takeover) -> Changes:
        """Take over stage `t.stage` for the rest of this step and after: at once from the
        replica, or once its state has arrived from `t.source` (`restores`)."""
        if t.kind == "failover":
            st = self.held.replica
            assert st is not None and st.stage == t.stage
            self.held = replace(self.held, replica=None)
            promotion_s = st.promote()  # to the device, its pending step first
            self.r.frc_results_complete()
            yield from self._install(t, st, promotion_s)
        else:
            self.restores.append(("recv", t))

    def _install(self, t: Takeover, st: StageState, promotion_s: float = 0.0) -> Changes:
        """Make `st` this node's stage `t.stage`; the engine sets up the step's work on it."""
        self.held = replace(self.held, stages={**self.held.stages, t.stage: st})
        yield Adopted(t.stage, from_replica=t.kind == "failover", promotion_s=promotion_s)
