"""The communication contracts of `bamboo.engine.comm`, on real gloo groups.

strict (NCCL's rules) matches messages by posting order only, so a receiver that posts in
another order than its sender gets the other message: nothing may rely on tags. tagged
matches by key. An abandoned group refuses every further transfer, and a group formed
among the survivors addresses them by their old ranks.
"""
from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from bamboo.engine.comm import ACTIVATION, GRADIENT, P2P, PeerLost
from support.procs import free_port

pytestmark = pytest.mark.procs  # every test here starts processes


def _group(store: dist.Store, prefix: str, rank: int, size: int) -> dist.ProcessGroup:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=20)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)


def _peer(rank: int, port: int, strict: bool, out: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0,
                          timeout=timedelta(seconds=20))
    p2p = P2P(_group(store, "g", rank, 3), strict=strict)
    first, second = (ACTIVATION, 1, 0), (GRADIENT, 2, 0)
    if rank == 0:
        p2p.send(torch.full((4,), 1.0), 1, first)
        p2p.send(torch.full((4,), 2.0), 1, second)
        p2p.flush()
    elif rank == 1:  # posts the second key first
        b, a = torch.empty(4), torch.empty(4)
        p2p.recv(b, 0, second)
        p2p.recv(a, 0, first)
        out.put(("order", float(b[0]), float(a[0])))
    p2p.abandon()
    try:
        p2p.send(torch.ones(1), (rank + 1) % 3, first)
        out.put(("abandoned", rank, "sent"))
    except RuntimeError as e:
        out.put(("abandoned", rank, str(e)))
    if rank == 2:
        return  # "lost": the others form a group of their own
    survivors = P2P(_group(store, "e1", rank, 2), strict=strict, ranks=[0, 1], name="e1")
    if rank == 0:
        survivors.send(torch.full((2,), 7.0), 1, first)
        survivors.flush()
        try:
            survivors.send(torch.ones(1), 2, first)
        except PeerLost as e:
            out.put(("outside", e.peer))
    else:
        got = torch.empty(2)
        survivors.recv(got, 0, first)
        out.put(("survivors", float(got[0])))


def _run(strict: bool) -> list[tuple]:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_peer, args=(r, port, strict, out)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return sorted((out.get(timeout=5) for _ in range(6)), key=str)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "tagged"])
def test_matching_abandon_and_survivors_group(strict: bool) -> None:
    results = _run(strict)
    [order] = [r for r in results if r[0] == "order"]
    # strict: the first receive posted takes the first message sent, whatever its key
    assert order[1:] == ((1.0, 2.0) if strict else (2.0, 1.0))
    abandoned = [r for r in results if r[0] == "abandoned"]
    assert len(abandoned) == 3 and all("abandoned process group" in r[2] for r in abandoned)
    assert ("survivors", 7.0) in results
    assert ("outside", 2) in results
