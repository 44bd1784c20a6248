"""The fork server that hands out ready workers.

Importing torch costs seconds per process, and the first optimizer built in a
process pulls in torch's compiler stack (seconds more). The fork server pays both
once, in `bamboo.cluster.preload`, and forks every worker from that warm state:
the initial workers, and later replacements and joins. `start()` is cheap and
torch-free, so the coordinator can start the server before importing torch itself
and the two imports overlap.
"""
from __future__ import annotations

import multiprocessing as mp
from multiprocessing import forkserver
from multiprocessing.context import BaseContext

__all__ = ["context", "start"]

_PRELOAD = ["bamboo.cluster.preload"]


def context() -> BaseContext:
    """The forkserver context, with the preload set."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def start() -> None:
    """Start the fork server now (it imports torch in the background)."""
    context()
    forkserver.ensure_running()
