"""A node at a step boundary of a step-by-step run (`bamboo.Trainer`): its orders, in turn.

The coordinator writes the orders of the boundary after k steps under `order/<k>/<n>`
(bamboo.plan.orders); a node reads them in order, skips those marked done (an evaluation
or a checkpoint a node of an earlier generation completed here) and hands the rest back
to the worker, until a STEP or FINISH closes the boundary. A read waits in the store for
as long as the user's loop takes: the user may think between two steps. Roles that change
meanwhile (a node lost between steps) arrive as a CATCH_UP order of their own, so the wait
never needs to poll.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch.distributed as dist

from bamboo.plan.orders import Order
from bamboo.protocol.messages import SHUTDOWN_KEY, order_done_key, order_key

__all__ = ["BoundaryOrders", "RunOver"]


class RunOver(Exception):
    """The run shut down while this node waited for an order."""


class BoundaryOrders:
    """Reads the orders of each boundary from the coordinator's store."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def orders(self, step: int) -> Iterator[Order]:
        """The orders of the boundary after `step` steps still to carry out, in their
        order; the last one closes the boundary (STEP or FINISH)."""
        n = 0
        while True:
            order = Order.decode(self._wait(order_key(step, n)))
            if order.kind.closes_boundary:
                yield order
                return
            if not self.store.check([order_done_key(step, n)]):
                yield order
            n += 1

    def _wait(self, key: str) -> str:
        """The value of `key` once the coordinator wrote it (RunOver if the run ends first).
        `get` waits up to the store's timeout, then the run's end is checked and the wait
        goes on."""
        while True:
            try:
                return self.store.get(key).decode()
            except dist.DistStoreError:
                if self.store.check([SHUTDOWN_KEY]):
                    raise RunOver(f"the run ended while this node waited for {key}") from None
