"""Transfers staged through host memory (gloo with accelerator tensors: several workers on
one GPU), on a real 2-process gloo group with staging forced on, CPU tensors standing in for
device ones. (The staging decision and the backend choice alone:
tests/unit/engine/test_comm_staging.py; the data-parallel buckets staged:
tests/unit/engine/test_buckets.py.)"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bamboo.engine.comm import ACTIVATION, GRADIENT, P2P, StagedWork
from support.gloo import gloo_options

REPO = Path(__file__).resolve().parents[2]


# -- a real 2-process gloo exchange with staging forced on ---------------------------------------

def side(rank: int, port: int) -> None:
    """One node's half of the exchange (rank 0 in the test, rank 1 in a subprocess)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=15))
    group = dist.ProcessGroupGloo(dist.PrefixStore("main", store), rank, 2, gloo_options())

    def former(name: str, ranks: list[int]) -> dist.ProcessGroup:
        return dist.ProcessGroupGloo(dist.PrefixStore(name, store), ranks.index(rank),
                                     len(ranks), gloo_options())

    peer, never = 1 - rank, (lambda: False)
    p2p = P2P(group, strict=True, former=former, staged=True)
    try:
        # Both directions in one batch; the sent tensor is changed right after it was
        # posted: the peer must still get the values it had (the host copy went out).
        sent = torch.arange(6.0).reshape(2, 3) + 100 * rank
        buf = torch.full((2, 3), -7.0)
        works = p2p.exchange([(sent, peer, (ACTIVATION, 0, 0))], [(buf, peer, (ACTIVATION, 0, 0))])
        sent.fill_(-1.0)
        assert len(works) == 1 and isinstance(works[0][0], StagedWork)
        assert works[0][0].host.data_ptr() != buf.data_ptr()
        assert p2p.pending[0][1].data_ptr() != sent.data_ptr()  # the host copy, kept
        for work, src in works:
            p2p.wait_interruptible(work, src, never)
        p2p.flush()
        expected = torch.arange(6.0).reshape(2, 3) + 100 * peer
        assert torch.equal(buf, expected), (buf, expected)

        # A receive into a fresh buffer, one way, then the other way in bf16.
        key = (ACTIVATION, 1, 0)
        if rank == 0:
            p2p.send(torch.tensor([5, -3, 2**40], dtype=torch.int64), 1, key)
            p2p.flush()
            got = p2p.recv_interruptible((3,), torch.bfloat16, torch.device("cpu"), 1,
                                         (GRADIENT, 1, 0), never)
            assert torch.equal(got, torch.tensor([0.5, -2.0, 3.0], dtype=torch.bfloat16)), got
        else:
            got = p2p.recv_interruptible((3,), torch.int64, torch.device("cpu"), 0, key, never)
            assert got.tolist() == [5, -3, 2**40], got
            p2p.send(torch.tensor([0.5, -2.0, 3.0], dtype=torch.bfloat16), 0, (GRADIENT, 1, 0))
            p2p.flush()

        # The default on the CPU: no staging, the caller's buffer is the wire's.
        plain = P2P(group, strict=True)
        buf = torch.zeros(2)
        works = plain.exchange([(torch.tensor([1.0, 2.0]) * (rank + 1), peer, (ACTIVATION, 2, 0))],
                               [(buf, peer, (ACTIVATION, 2, 0))])
        assert not isinstance(works[0][0], StagedWork)
        plain.wait(*works[0])
        plain.flush()
        plain.close()
        assert buf.tolist() == [float(peer + 1), float(2 * (peer + 1))], buf
    finally:
        p2p.close()


STARTED = "child-started"


def wait_for_child(store: dist.TCPStore, child: subprocess.Popen[str], limit_s: float) -> None:
    """Waits until the child has imported torch and reached the store (slow on a loaded
    machine), or fails naming why; the exchange itself then runs under the store's timeout."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise AssertionError(f"the second process ended ({child.returncode}) before the "
                                 f"exchange: {child.communicate()[1][-2000:]}")
        try:
            store.wait([STARTED], timedelta(seconds=1))
            return
        except dist.DistStoreError:
            continue
    raise AssertionError(f"the second process did not start in {limit_s:.0f} s")


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_staged_exchange_between_two_processes() -> None:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=15))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    child = subprocess.Popen([sys.executable, __file__, str(master.port)], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_child(master, child, limit_s=60.0)
        side(0, master.port)
        _, err = child.communicate(timeout=30)
        assert child.returncode == 0, err[-2000:]
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()


if __name__ == "__main__":  # the second process of test_staged_exchange_between_two_processes
    port = int(sys.argv[1])
    dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=15)).set(STARTED, "1")
    side(1, port)
