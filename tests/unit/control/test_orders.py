"""A step-by-step run's orders (bamboo.plan.orders, bamboo.control.orders) without processes:
their text form, the scale in force at a step, what the coordinator writes for the nodes,
when it marks an order done, when it tells waiting nodes of new roles, and what it forgets."""
from __future__ import annotations

from pathlib import Path

import pytest

from bamboo.config import JobConfig
from bamboo.control.orders import Orders
from bamboo.control.state import RunContext
from bamboo.plan.orders import Order, OrderKind, scale_at
from bamboo.plan.roles import RoleMap
from bamboo.protocol.messages import order_done_key, order_key
from coordinator_sim import DictStore, ListEvents, QuietDisplay


@pytest.mark.parametrize("order", [Order(OrderKind.STEP, 0.25), Order(OrderKind.EVAL),
                                   Order(OrderKind.SAVE), Order(OrderKind.FINISH),
                                   Order(OrderKind.CATCH_UP)])
def test_an_order_reads_back_as_written(order: Order) -> None:
    assert Order.decode(order.encode()) == order


@pytest.mark.parametrize("scale", [-1.0, float("nan"), float("inf")])
def test_a_scale_that_is_no_learning_rate_factor_is_refused(scale: float) -> None:
    with pytest.raises(ValueError, match="lr_scale"):
        Order(OrderKind.STEP, scale)


def test_the_scale_in_force_is_the_last_change_at_or_before_the_step() -> None:
    changes = [[3, 0.5], [6, 0.25]]
    assert [scale_at(changes, k) for k in range(8)] == [1, 1, 1, .5, .5, .5, .25, .25]
    assert scale_at([], 10) == 1.0


def _orders(tmp_path: Path) -> tuple[Orders, RunContext]:
    ctx = RunContext(cfg=JobConfig.of(steps=20).validate(), store=DictStore(),
                     events=ListEvents(), display=QuietDisplay(), run_path=tmp_path,
                     param_counts=[1, 1], stepwise=True, end_step=20)
    ctx.roles = RoleMap.initial(stages=2, pipelines=1, redundancy=True)
    return Orders(ctx), ctx


def test_orders_are_numbered_per_boundary_and_a_step_or_finish_closes_it(
        tmp_path: Path) -> None:
    orders, ctx = _orders(tmp_path)
    assert orders.give(Order(OrderKind.EVAL)) == 0
    assert not orders.closed(0)
    assert orders.give(Order(OrderKind.STEP)) == 1
    assert orders.closed(0)
    assert ctx.store.data[order_key(0, 1)] == Order(OrderKind.STEP).encode()
    with pytest.raises(RuntimeError, match="closed"):
        orders.give(Order(OrderKind.SAVE))
    ctx.committed = 1
    assert orders.give(Order(OrderKind.FINISH)) == 0
    assert ctx.end_step == 1
    assert [e["kind"] for e in ctx.events.of("order")] == ["eval", "step", "finish"]


def test_a_scale_is_recorded_from_the_boundary_it_was_set_at(tmp_path: Path) -> None:
    orders, ctx = _orders(tmp_path)
    ctx.committed = 3
    orders.set_scale(0.5)
    assert ctx.lr_scales == [[3, 0.5]]  # recorded before any step runs with it
    orders.set_scale(1.0)  # set back before a step ran with it: no change at all
    assert ctx.lr_scales == []
    orders.give(Order(OrderKind.STEP, 0.5))
    ctx.committed = 4
    orders.give(Order(OrderKind.STEP, 0.5))
    assert ctx.lr_scales == [[3, 0.5]] and orders.lr_scale == 0.5


def test_an_evaluation_or_checkpoint_is_marked_done_once_recorded(tmp_path: Path) -> None:
    orders, ctx = _orders(tmp_path)
    ctx.committed = 2
    orders.give(Order(OrderKind.EVAL))
    orders.give(Order(OrderKind.SAVE))
    orders.follow(evaluated=set(), checkpointed=0)
    assert order_done_key(2, 0) not in ctx.store.data and not orders.done(OrderKind.EVAL, 2)
    orders.follow(evaluated={2}, checkpointed=0)
    assert ctx.store.data[order_done_key(2, 0)] == "1" and orders.done(OrderKind.EVAL, 2)
    assert not orders.done(OrderKind.SAVE, 2)
    orders.follow(evaluated={2}, checkpointed=2)
    assert order_done_key(2, 1) in ctx.store.data and orders.done(OrderKind.SAVE, 2)


def test_roles_that_change_while_the_nodes_wait_are_a_catch_up_order(tmp_path: Path) -> None:
    """Nodes at a boundary learn of roles published after the step they committed by an
    order; roles a step committed under need none; a step under way needs none."""
    orders, ctx = _orders(tmp_path)
    orders.follow(set(), 0)  # the first plan's roles
    orders.give(Order(OrderKind.STEP))
    ctx.roles.epoch = 1  # changed during step 0, which then commits under it
    orders.committed(1)
    ctx.committed = 1
    orders.follow(set(), 0)
    assert order_key(1, 0) not in ctx.store.data
    ctx.roles.epoch = 2  # a node lost while the others wait at the boundary after step 1
    orders.follow(set(), 0)
    assert Order.decode(ctx.store.data[order_key(1, 0)]).kind is OrderKind.CATCH_UP
    orders.give(Order(OrderKind.STEP))
    ctx.roles.epoch = 3  # during step 1: the step itself takes them on
    orders.follow(set(), 0)
    assert order_key(1, 2) not in ctx.store.data


def test_orders_before_the_newest_checkpoint_are_forgotten(tmp_path: Path) -> None:
    """A restore never goes back before the newest whole checkpoint: older orders leave the
    store, later ones stay (a step redone from it runs with the scale it first had)."""
    orders, ctx = _orders(tmp_path)
    for step in range(4):
        ctx.committed = step
        orders.give(Order(OrderKind.STEP, 0.5))
    orders.follow(set(), checkpointed=2)
    assert sorted(ctx.store.data) == [order_key(2, 0), order_key(3, 0)]
