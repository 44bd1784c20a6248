"""gloo's and NCCL's error texts in the project's words.

A worker reports the exception that stopped it as one line (`WorkerError.error`). When that
line is the communication backend's own (a gloo `pair.cc` read error, an NCCL watchdog
timeout, a store socket timeout), the user is told what happened in terms of nodes, the
network and the flags that govern it; the raw text stays in `events.jsonl`
(`worker_error`, with its traceback) for whoever debugs the backend.

The NCCL patterns follow the texts of PyTorch's ProcessGroupNCCL and NCCL's
`ncclGetErrorString` (not yet seen on a machine here: this project's tests run gloo).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["describe", "is_backend_text", "peer_rank"]


@dataclass(frozen=True, slots=True)
class _Case:
    pattern: re.Pattern[str]
    words: str


def _case(pattern: str, words: str) -> _Case:
    return _Case(re.compile(pattern, re.IGNORECASE), words)


# First match wins: the specific before the general.
_CASES = (
    _case(r"CUDA (error: )?out of memory|OutOfMemoryError",
          "the GPU ran out of memory (fewer micro-batches per step, a smaller "
          "--micro-batch-size, --activation-checkpointing or --frc-offload need less)"),
    _case(r"Watchdog caught collective operation timeout|ran for \d+ milliseconds before "
          r"timing out",
          "an NCCL collective did not complete within --comm-timeout-s: a peer stopped "
          "answering (frozen, or its host cut off)"),
    _case(r"ncclRemoteError|remote process exited",
          "NCCL lost a peer: its process exited or the network to it failed"),
    _case(r"NCCL communicator was aborted|ncclSystemError|ncclInternalError",
          "NCCL aborted the communicator (a peer lost, or a system call failed on this "
          "host)"),
    _case(r"ncclUnhandledCudaError|CUDA error",
          "a CUDA call failed on this node's GPU"),
    _case(r"ncclInvalidUsage|ncclInvalidArgument",
          "NCCL refused a call as invalid (a bug: please report it with events.jsonl)"),
    _case(r"Connection reset by peer|Connection closed by peer|Read error|Write error|"
          r"Broken pipe|ECONNRESET|EPIPE",
          "the connection to a peer broke: its process died or its host went away"),
    _case(r"Connection refused|ECONNREFUSED|No route to host|Network is unreachable",
          "a peer could not be reached: its process is gone or its host is cut off"),
    _case(r"Timed out waiting \d+ ?ms for (recv|send)|Timed out waiting|operation timed out",
          "a peer did not answer within --comm-timeout-s (frozen, overloaded, or its host cut "
          "off)"),
    _case(r"Socket Timeout|DistStoreError|TCPStore|Failed to recv, got 0 bytes|"
          r"wait timeout after",
          "the coordinator's store did not answer in time (the coordinator is gone or its "
          "host is unreachable)"),
)

_BACKEND_MARKS = re.compile(r"gloo|nccl|pair\.cc|ProcessGroup|TCPStore|c10d|"
                            r"/pytorch/|third_party", re.IGNORECASE)
_PEER = re.compile(r"(?:rank|peer) (\d+)")


def is_backend_text(text: str) -> bool:
    """Whether `text` carries the backend's own wording (a source path, its names)."""
    return bool(_BACKEND_MARKS.search(text)) or any(c.pattern.search(text) for c in _CASES)


def describe(error: str) -> str:
    """`error` (a worker's one-line exception) in the project's words when it is the
    backend's text; any other error is returned unchanged."""
    for case in _CASES:
        if case.pattern.search(error):
            return f"{case.words}; the backend's own text is in events.jsonl (worker_error)"
    if _BACKEND_MARKS.search(error):
        return ("the communication backend failed; its own text is in events.jsonl "
                "(worker_error)")
    return error


def peer_rank(error: str) -> int | None:
    """The rank a backend-or-transport error names, if it names one."""
    m = _PEER.search(error)
    return int(m[1]) if m else None
