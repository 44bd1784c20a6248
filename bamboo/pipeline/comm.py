"""Point-to-point transfers between stages over torch.distributed.

Sends are posted with `isend` and never block the schedule (a gloo send otherwise
waits for its receiver); they are completed at the end of the step. Receives wait
with the process group's timeout, so no call blocks forever. Tags keep transfers
apart: each (kind, stage, micro-batch) has its own. A failed call raises PeerLost,
so callers can tell a lost peer from a bug of their own.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

__all__ = ["PeerLost", "P2P", "tag_for"]

ACTIVATION, GRADIENT = 0, 1


class PeerLost(RuntimeError):
    """A transfer failed because a peer is gone or stopped answering."""


def tag_for(kind: int, stage: int, mb: int) -> int:
    """A distinct tag for each transfer of a step (stages < 4096, micro-batches < 65536)."""
    return (stage * 65536 + mb) * 2 + kind


class P2P:
    """Posts sends and receives; counts the seconds spent waiting."""

    def __init__(self) -> None:
        self.pending: list[tuple[dist.Work, torch.Tensor, int]] = []
        self.wait_s = 0.0
        self.bytes_sent = 0

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.contiguous()
        try:
            work = dist.isend(tensor, dst=dst, tag=tag)
        except RuntimeError as e:
            raise PeerLost(f"send to rank {dst} failed: {e}") from e
        self.pending.append((work, tensor, dst))
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def recv(self, buffer: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        start = time.perf_counter()
        try:
            dist.irecv(buffer, src=src, tag=tag).wait()
        except RuntimeError as e:
            raise PeerLost(f"receive from rank {src} failed: {e}") from e
        finally:
            self.wait_s += time.perf_counter() - start
        return buffer

    def flush(self) -> None:
        """Wait for every posted send."""
        start = time.perf_counter()
        try:
            for work, _, dst in self.pending:
                try:
                    work.wait()
                except RuntimeError as e:
                    raise PeerLost(f"send to rank {dst} failed: {e}") from e
        finally:
            self.pending.clear()
            self.wait_s += time.perf_counter() - start
