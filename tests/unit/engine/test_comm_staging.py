"""Transfers staged through host memory (gloo with accelerator tensors: several workers on
one GPU) and the backend choice (`BAMBOO_BACKEND`).

No GPU here: the staging decision is tested on its own (the staged path on a real 2-process
gloo group: tests/integration/test_comm_staging_runs.py)."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from bamboo.config import JobConfig
from bamboo.engine.comm import (
    ACTIVATION,
    P2P,
    BatchedWork,
    StagedWork,
    coalescing,
    needs_host_staging,
)
from bamboo.node.devices import choose_backend
from bamboo.node.devices import worker_device as _device
from support.gloo import gloo_options

# -- the decision ---------------------------------------------------------------------------------

def test_needs_host_staging_only_for_device_tensors_on_gloo() -> None:
    assert needs_host_staging("gloo", torch.device("cuda", 0))
    assert needs_host_staging("gloo", "cuda:1")
    assert not needs_host_staging("gloo", torch.device("cpu"))
    assert not needs_host_staging("nccl", torch.device("cuda", 0))
    assert not needs_host_staging("nccl", "cpu")


def test_p2p_detects_gloo_and_stages_only_device_tensors() -> None:
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, gloo_options())
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


# -- NCCL's batches (no NCCL here: a stand-in backend; the real one ran in gpu_check) ------------

class _NcclLikeBackend:
    """Behaves as a `dist.ProcessGroupNCCL` built directly (a backend, not a ProcessGroup):
    its coalescing calls take no device, and an operation inside a batch returns no Work."""

    def __init__(self) -> None:
        self.batching, self.calls, self.batch = False, [], _Work()

    def size(self) -> int:
        return 2

    def _start_coalescing(self, *args) -> None:
        self.calls.append(("start", args))
        self.batching = True

    def _end_coalescing(self, *args) -> _Work:
        self.calls.append(("end", args))
        self.batching = False
        return self.batch

    def send(self, tensors, peer, tag):
        self.calls.append(("send", peer))
        return None if self.batching else _Work()

    def recv(self, tensors, peer, tag):
        self.calls.append(("recv", peer))
        return None if self.batching else _Work()


def test_an_nccl_exchange_is_one_batch_and_each_operation_waits_for_the_batch() -> None:
    group = _NcclLikeBackend()
    p2p = P2P(group, device=torch.device("cpu"))
    p2p.backend = "nccl"  # what _backend_of says of a real ProcessGroupNCCL
    works = p2p.exchange([(torch.ones(2), 1, (ACTIVATION, 0, 0))],
                         [(torch.empty(2), 1, (ACTIVATION, 0, 1)),
                          (torch.empty(2), 1, (ACTIVATION, 0, 2))])
    assert group.calls == [("start", ()), ("send", 1), ("recv", 1), ("recv", 1), ("end", ())]
    assert len(works) == 2 and works[0][0] is not works[1][0]  # each is waited on once
    assert all(isinstance(w, BatchedWork) and w.batch is group.batch for w, _ in works)
    for work, peer in works:
        p2p.wait(work, peer)
    p2p.flush()
    assert group.batch.waits == 3 and not p2p.pending
    p2p.close()


def test_coalescing_passes_the_device_only_to_a_process_group() -> None:
    backend = _NcclLikeBackend()
    assert coalescing(backend, torch.device("cpu"), begin=True) is None
    assert coalescing(backend, torch.device("cpu"), begin=False) is backend.batch
    assert backend.calls == [("start", ()), ("end", ())]
    assert BatchedWork.of(None, backend.batch).batch is backend.batch
    real = _Work()
    assert BatchedWork.of(real, backend.batch) is real
