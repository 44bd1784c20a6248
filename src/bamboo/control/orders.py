"""A step-by-step run's orders (bamboo.plan.orders), from the user's calls to the nodes.

The user's loop (`bamboo.Trainer`) asks for one thing at a time at the boundary the run
stands at (`ctx.committed` steps done): a step, an evaluation, a checkpoint, the end. Each
becomes the boundary's next order in the store, which every node carries out in turn.
This part writes them, marks an evaluation or a checkpoint done once it is recorded (so a
node that comes back to the boundary skips it), tells waiting nodes to take on roles that
changed between steps (a CATCH_UP order), and keeps what a resume must replay: the
learning-rate scale of every step (`ctx.lr_scales`) and the step the run ends at
(`ctx.end_step`). Orders stay in the store while a restore could take the run back to
their boundary: a step redone from a checkpoint runs with the scale it first had.
"""
from __future__ import annotations

from dataclasses import dataclass

from bamboo.control.state import RunContext
from bamboo.plan.orders import Order, OrderKind, scale_at
from bamboo.protocol.messages import order_done_key, order_key

__all__ = ["Orders"]


@dataclass(slots=True)
class _Open:
    """An evaluation or checkpoint order not yet complete."""

    step: int
    n: int
    kind: OrderKind


class Orders:
    """The orders of a step-by-step run: the one writer of `ctx.lr_scales`, `ctx.end_step`."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.issued: dict[int, list[Order]] = {}
        """Boundary (steps done) -> its orders, in order."""
        self.open: list[_Open] = []
        self.epoch_seen = -1
        """The role epoch the waiting nodes were last told of."""

    @property
    def lr_scale(self) -> float:
        """The scale the next step runs with unless the user sets another."""
        return scale_at(self.ctx.lr_scales, self.ctx.committed)

    def set_scale(self, scale: float) -> None:
        """The learning-rate scale from the current boundary on (recorded now, so that a
        checkpoint written here carries it to a resume)."""
        ctx = self.ctx
        if scale == self.lr_scale:
            return
        step = ctx.committed
        ctx.lr_scales[:] = [e for e in ctx.lr_scales if e[0] < step]
        if scale != scale_at(ctx.lr_scales, step):
            ctx.lr_scales.append([step, scale])

    def closed(self, step: int) -> bool:
        """Whether the boundary after `step` steps has its STEP or FINISH order."""
        orders = self.issued.get(step, [])
        return bool(orders) and orders[-1].kind.closes_boundary

    def give(self, order: Order) -> int:
        """Write `order` as the next one of the current boundary; its index there."""
        ctx = self.ctx
        step = ctx.committed
        if self.closed(step):
            raise RuntimeError(f"the boundary after {step} steps is closed")
        orders = self.issued.setdefault(step, [])
        n = len(orders)
        orders.append(order)
        if order.kind is OrderKind.STEP:
            self.set_scale(order.lr_scale)
        if order.kind is OrderKind.FINISH:
            ctx.end_step = step
        if order.kind in (OrderKind.EVAL, OrderKind.SAVE):
            self.open.append(_Open(step, n, order.kind))
        if ctx.roles is not None:
            self.epoch_seen = max(self.epoch_seen, ctx.roles.epoch)
        ctx.store.set(order_key(step, n), order.encode())
        ctx.events.write("order", step=step, n=n, kind=order.kind.value,
                         **({"lr_scale": order.lr_scale} if order.kind is OrderKind.STEP else {}))
        return n

    def committed(self, epoch: int) -> None:
        """A step committed under role epoch `epoch`: every node voted under it, so every
        node holds those roles at the boundary that follows."""
        self.epoch_seen = max(self.epoch_seen, epoch)

    def follow(self, evaluated: set[int], checkpointed: int) -> None:
        """From the core's tick: mark complete orders done (`evaluated`: the steps whose
        held-out loss is recorded; `checkpointed`: the newest published checkpoint's step),
        and give a CATCH_UP when the roles changed while the nodes wait at a boundary."""
        ctx = self.ctx
        for o in list(self.open):
            if (o.kind is OrderKind.EVAL and o.step in evaluated) or \
                    (o.kind is OrderKind.SAVE and checkpointed == o.step):
                ctx.store.set(order_done_key(o.step, o.n), "1")
                self.open.remove(o)
        if checkpointed > 0:
            self.forget_before(checkpointed)
        if ctx.roles is None:
            return
        if self.epoch_seen < 0:  # the first plan's roles: every node starts with them
            self.epoch_seen = ctx.roles.epoch
        if ctx.roles.epoch > self.epoch_seen and not self.closed(ctx.committed):
            self.give(Order(OrderKind.CATCH_UP))

    def done(self, kind: OrderKind, step: int) -> bool:
        """Whether every `kind` order given at boundary `step` is complete."""
        return not any(o.kind is kind and o.step == step for o in self.open)

    def forget_before(self, step: int) -> None:
        """Delete the orders of boundaries before `step` (no restore can go back past the
        newest whole checkpoint, at `step`)."""
        for k in [k for k in self.issued if k < step]:
            for n in range(len(self.issued.pop(k))):
                self.ctx.store.delete_key(order_key(k, n))
                self.ctx.store.delete_key(order_done_key(k, n))
