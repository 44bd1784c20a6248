"""gloo's and NCCL's texts reach the user in the project's words; the raw text stays in
events.jsonl. (A real gloo error, from a peer killed in another process:
tests/integration/test_backend_errors_runs.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from bamboo.config import JobConfig
from bamboo.node.backend_errors import describe, is_backend_text, peer_rank
from bamboo.protocol.messages import WorkerError
from coordinator_sim import SimCluster

GLOO_RESET = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:"
              "537] Read error [127.0.0.1]:6838: Connection reset by peer")

# Texts in the forms PyTorch's ProcessGroupNCCL and NCCL print them.
CASES = {
    GLOO_RESET: "the connection to a peer broke",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:589] Connection closed by "
    "peer [10.0.0.2]:23456": "the connection to a peer broke",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
    "waiting 30000ms for recv operation to complete": "did not answer within --comm-timeout-s",
    "DistStoreError: wait timeout after 30000ms, keys: /go/3": "the coordinator's store",
    "DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, remote "
    "process exited or there was a network error, NCCL version 2.21.5": "NCCL lost a peer",
    "DistBackendError: [Rank 1] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1024) ran for 600026 milliseconds before "
    "timing out.": "an NCCL collective did not complete",
    "DistBackendError: NCCL communicator was aborted on rank 1.": "NCCL aborted the communicator",
    "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB": "the GPU ran out of memory",
    "DistBackendError: ncclUnhandledCudaError: Call to CUDA function failed.":
        "a CUDA call failed",
}


@pytest.mark.parametrize("raw", list(CASES))
def test_each_backend_text_is_worded(raw: str) -> None:
    assert is_backend_text(raw)
    worded = describe(raw)
    assert CASES[raw] in worded and "events.jsonl" in worded
    for mark in ("pair.cc", "NCCLUtils", "WorkNCCL", "/__w/", "c10d"):
        assert mark not in worded


def test_other_errors_are_left_as_they_are() -> None:
    for text in ("ValueError: shape mismatch in layer 3", "MemoryError: out of memory",
                 "OSError: [Errno 28] No space left on device"):
        assert not is_backend_text(text)
        assert describe(text) == text


def test_the_peer_of_a_failed_transfer() -> None:
    assert peer_rank(f"transfer with rank 4 failed: {GLOO_RESET}") == 4
    assert peer_rank(GLOO_RESET) is None


@pytest.mark.timeout(60)
def test_a_worker_stopped_by_backend_text_stops_the_run_in_our_words(tmp_path: Path) -> None:
    sim = SimCluster(JobConfig.of(nodes=2, stages=2, micro_batches=2, steps=4), tmp_path / "r")
    sim.settle()
    sim.step()
    worker = sim.workers[1]
    sim._send(worker, WorkerError(rank=1, step=1, error=GLOO_RESET, traceback="Traceback ...",
                                  peer_lost=False))
    assert sim.stopped is not None
    assert "failed in step 1: the connection to a peer broke" in sim.stopped
    assert "pair.cc" not in sim.stopped and "pair.cc" not in sim.failed["error"]
    [raw] = sim.events.of("worker_error")
    assert raw["error"] == GLOO_RESET and raw["traceback"] == "Traceback ..."
