"""Real memory of this process, as the operating system and the CUDA allocator see it.

Tensor accounting (`bamboo.pipeline.memory`) counts what the engine knows it holds; this
module reads what the process actually holds, so memory the engine lost track of (a
reference cycle through autograd's graph, an allocator cache that only grows) shows up:

- `rss`: resident set size now (`/proc/self/statm`, one read; `VmRSS`);
- `rss_peak`: the process's high-water mark (`VmHWM` in `/proc/self/status`);
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

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True, slots=True)
class MemorySample:
    rss: int
    rss_peak: int
    cuda_peak: int = 0
    cuda_reserved: int = 0


def _maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes, Linux: KiB


def rss_bytes() -> int:
    """This process's resident memory now, in bytes."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return _maxrss_bytes()


def rss_peak_bytes() -> int:
    """This process's peak resident memory so far, in bytes."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return _maxrss_bytes()


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
    return MemorySample(rss=rss_bytes(), rss_peak=rss_peak_bytes(), cuda_peak=cuda_peak,
                        cuda_reserved=cuda_reserved)
