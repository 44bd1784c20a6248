"""Transfers staged through host memory (gloo with accelerator tensors: several workers on
one GPU) and the backend choice (`BAMBOO_BACKEND`).

No GPU here: the staging decision is tested on its own, and the staged path runs on a real
2-process gloo group with staging forced on, CPU tensors standing in for device ones."""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bamboo.node.devices import choose_backend
from bamboo.node.devices import worker_device as _device
from bamboo.config import JobConfig
from bamboo.engine.comm import (ACTIVATION, GRADIENT, P2P, StagedWork, needs_host_staging)

REPO = Path(__file__).resolve().parents[3]


# -- the decision ---------------------------------------------------------------------------------

def test_needs_host_staging_only_for_device_tensors_on_gloo() -> None:
    assert needs_host_staging("gloo", torch.device("cuda", 0))
    assert needs_host_staging("gloo", "cuda:1")
    assert not needs_host_staging("gloo", torch.device("cpu"))
    assert not needs_host_staging("nccl", torch.device("cuda", 0))
    assert not needs_host_staging("nccl", "cpu")


def _gloo_options(timeout_s: float = 15.0) -> dist.ProcessGroupGloo._Options:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return options


def test_p2p_detects_gloo_and_stages_only_device_tensors() -> None:
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, _gloo_options())
    meta = torch.empty(3, device="meta")  # stands in for a CUDA tensor in the decision
    auto = P2P(group)
    assert auto.backend == "gloo"
    assert not auto._staged(torch.ones(3)) and auto._staged(meta)
    assert P2P(group, staged=True)._staged(torch.ones(3))
    assert not P2P(group, staged=False)._staged(meta)
    auto.close()

    class Fake:  # not a gloo group (NCCL, a stand-in): never staged by default
        def size(self) -> int:
            return 2
    other = P2P(Fake())
    assert other.backend == "" and not other._staged(meta)
    other.close()


class _Work:
    def __init__(self, result: bool | Exception = True) -> None:
        self.result, self.waits = result, 0

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        if isinstance(self.result, Exception):
            raise self.result
        return self.result

    def is_completed(self) -> bool:
        return True


def test_staged_work_copies_once_after_the_wire() -> None:
    host, into = torch.arange(4.0), torch.zeros(4)
    work = StagedWork(_Work(), host, into)
    assert work.is_completed()  # what it does not define comes from the wire's Work
    assert work.wait() is True and torch.equal(into, host) and into.data_ptr() != host.data_ptr()
    into.zero_()
    assert work.wait() is True and work.work.waits == 1 and not into.any()  # once only

    failing = StagedWork(_Work(RuntimeError("peer gone")), host, into)
    with pytest.raises(RuntimeError, match="peer gone"):
        failing.wait()
    assert not into.any()  # nothing copied from a failed transfer

    late = StagedWork(_Work(False), host, into)  # a wait whose timeout ran out
    assert late.wait(timedelta(seconds=1)) is False and not into.any() and not late.done


# -- a real 2-process gloo exchange with staging forced on ---------------------------------------

def side(rank: int, port: int) -> None:
    """One node's half of the exchange (rank 0 in the test, rank 1 in a subprocess)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=15))
    group = dist.ProcessGroupGloo(dist.PrefixStore("main", store), rank, 2, _gloo_options())

    def former(name: str, ranks: list[int]) -> dist.ProcessGroup:
        return dist.ProcessGroupGloo(dist.PrefixStore(name, store), ranks.index(rank),
                                     len(ranks), _gloo_options())

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

        # An all-reduce, staged: the sum lands in the caller's tensor.
        total = torch.full((4,), float(rank + 1))
        p2p.all_reduce(total, [0, 1], "dp", never)
        assert torch.equal(total, torch.full((4,), 3.0)), total

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


@pytest.mark.procs
@pytest.mark.timeout(20)
def test_staged_exchange_between_two_processes() -> None:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=15))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen([sys.executable, __file__, str(master.port)], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        side(0, master.port)
        _, err = child.communicate(timeout=15)
        assert child.returncode == 0, err[-2000:]
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()


# -- the backend -----------------------------------------------------------------------------------

def test_choose_backend() -> None:
    assert choose_backend(True, None) == "nccl"
    assert choose_backend(False, None) == "gloo"
    assert choose_backend(False, "") == "gloo"
    assert choose_backend(True, "gloo") == "gloo"
    assert choose_backend(True, " GLOO ") == "gloo"
    assert choose_backend(True, "nccl") == "nccl"
    assert choose_backend(False, "gloo") == "gloo"
    with pytest.raises(RuntimeError, match="BAMBOO_BACKEND=nccl needs CUDA") as e:
        choose_backend(False, "nccl")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="BAMBOO_BACKEND='mpi' is not one of nccl, gloo"):
        choose_backend(True, "mpi")


def test_device_takes_the_backend_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    try:
        monkeypatch.setenv("BAMBOO_BACKEND", "gloo")
        assert _device(JobConfig.of(device="cuda"), 0, 3) == (torch.device("cuda", 0), "gloo")
        assert _device(JobConfig.of(device="cpu"), 0, 0) == (torch.device("cpu"), "gloo")
        monkeypatch.setenv("BAMBOO_BACKEND", "nccl")
        assert _device(JobConfig.of(device="cuda"), 0, 0) == (torch.device("cuda", 0), "nccl")
        with pytest.raises(RuntimeError, match="needs CUDA"):
            _device(JobConfig.of(device="cpu"), 0, 0)
        monkeypatch.delenv("BAMBOO_BACKEND")
        assert _device(JobConfig.of(device="cuda"), 0, 0)[1] == "nccl"
        assert _device(JobConfig.of(device="cpu"), 0, 0)[1] == "gloo"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


if __name__ == "__main__":  # the second process of test_staged_exchange_between_two_processes
    side(1, int(sys.argv[1]))
