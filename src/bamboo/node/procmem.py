"""Real memory of this process, as the operating system and the CUDA allocator see it.

Tensor accounting (`bamboo.engine.memory`) counts what the engine knows it holds; this
module reads what the process actually holds, so memory the engine lost track of (a
reference cycle through autograd's graph, an allocator cache that only grows) shows up:

- `rss`: resident set size now (`VmRSS`);
- `rss_peak`: the process's high-water mark (`VmHWM`), both from one read of
  `/proc/self/status`;
- on CUDA, the caching allocator's peak allocated bytes since the last sample and its
  reserved bytes now (the peak is reset at each sample, so each sample is one step's).

Off Linux, `rss` falls back to `resource.getrusage` (a peak, not the current size).
"""
from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass

__all__ = ["MemorySample", "sample", "rss_bytes", "rss_peak_bytes", "open_fds"]

@dataclass(frozen=True, slots=True)
class MemorySample:
    rss: int
    rss_peak: int
    cuda_peak: int = 0
    cuda_reserved: int = 0


def _maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes, Linux: KiB


def _resident() -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes, from one read of /proc/self/status (the peak where the
    file is not there)."""
    try:
        with open("/proc/self/status", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        return int(fields[b"VmRSS"].split()[0]) * 1024, int(fields[b"VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, IndexError, ValueError):
        peak = _maxrss_bytes()
        return peak, peak


def rss_bytes() -> int:
    """This process's resident memory now, in bytes."""
    return _resident()[0]


def rss_peak_bytes() -> int:
    """This process's peak resident memory so far, in bytes."""
    return _resident()[1]


def open_fds() -> int | None:
    """File descriptors this process has open (None where /proc is not there)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def sample(cuda_device: object | None = None) -> MemorySample:
    """One sample; with a CUDA device also its allocator's figures (peak since the last
    sample, then reset)."""
    cuda_peak = cuda_reserved = 0
    if cuda_device is not None:
        import torch

        cuda_peak = int(torch.cuda.max_memory_allocated(cuda_device))
        cuda_reserved = int(torch.cuda.memory_reserved(cuda_device))
        torch.cuda.reset_peak_memory_stats(cuda_device)
    rss, peak = _resident()
    return MemorySample(rss=rss, rss_peak=peak, cuda_peak=cuda_peak, cuda_reserved=cuda_reserved)
