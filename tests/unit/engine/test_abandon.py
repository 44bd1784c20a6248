"""A node learns that the coordinator abandoned its generation from the role maps published
on a real TCPStore (what the engine asks before each instruction): newer roles that only
re-assign work are not an abandon; an abandoning map among them is."""
from __future__ import annotations

import time
from datetime import timedelta
from multiprocessing import Pipe

import pytest
import torch
import torch.distributed as dist

from bamboo.engine.context import NodeContext
from bamboo.plan.roles import RoleMap
from bamboo.protocol.messages import epoch_key
from bamboo.wire.link import CoordinatorLink


def _context(port: int) -> NodeContext:
    def client() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    _, writer = Pipe(duplex=False)
    link = CoordinatorLink(rank=0, conn=writer, store=client(), timeout_s=5.0,
                           watch_store=client())
    return NodeContext(rank=0, pipeline=0, P=1, parts=[range(0, 2)], specs=[],
                       device=torch.device("cpu"), global_mbs=[0, 1], link=link, former=None)


def _publish(store: dist.TCPStore, epoch: int, *, abandon: bool) -> None:
    roles = RoleMap.initial(stages=1, pipelines=2, redundancy=True)
    roles.epoch, roles.abandon = epoch, abandon
    store.set(epoch_key(epoch), roles.to_json())


def _until_epoch(ctx: NodeContext, epoch: int) -> None:
    deadline = time.monotonic() + 5
    while ctx.link.latest_epoch < epoch:
        assert time.monotonic() < deadline, "the epoch watcher never saw the new roles"
        time.sleep(0.01)


@pytest.mark.timeout(30)
def test_only_an_abandoning_map_among_the_newer_roles_is_an_abandon() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    ctx = _context(store.port)
    current = RoleMap.initial(stages=1, pipelines=2, redundancy=True)  # epoch 0
    assert not ctx.abandoned(current)  # nothing newer published
    _publish(store, 1, abandon=False)  # a failover's roles: the step goes on under them
    _until_epoch(ctx, 1)
    assert not ctx.abandoned(current)
    _publish(store, 2, abandon=True)
    _until_epoch(ctx, 2)
    assert ctx.abandoned(current)
    newest = RoleMap.initial(stages=1, pipelines=2, redundancy=True)
    newest.epoch = 2
    assert not ctx.abandoned(newest)  # a node that already holds the newest roles
