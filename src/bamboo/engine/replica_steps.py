"""The thread a node's replica steps run on, off the step's critical path.

A replica kept in host memory takes its optimizer step after the commit, on one thread of
its own (`StageState.apply_later`), while the node goes on with its next work; every read
of the replica waits for that step first. Where the node has a processor of its own (a
GPU, or `--pin-cpus`), its waits (pipeline bubbles, peers' messages) leave that processor
idle, and the thread runs at a low priority (`yield_to_the_step`): it takes the idle time
rather than the node's own step's. On cores shared with other workers nothing is idle, so
it keeps the normal priority. A yielding thread still running a step when the next one is
due (a whole step later: other processes took the idle time it was meant to use) is
`behind`: the steps after it go to a thread of the normal priority, since a waiting node
must not depend on time other processes leave over.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

__all__ = ["submit", "wait", "behind", "yield_to_the_step", "yielding", "YIELDING_NICE",
           "TIMEOUT_S"]

TIMEOUT_S = 600.0
"""How long a read of a replica waits for its step before giving up."""
YIELDING_NICE = 10
"""The yielding thread's nice value: a tenth of a normal thread's share of a busy processor
(CFS weights 110 against 1024), all of an idle one. Not 19: a process may not lower a
thread's nice value again, and a step it is waiting for should not crawl."""

_log = logging.getLogger(__name__)
_executor: ThreadPoolExecutor | None = None
_yielding = False


def yield_to_the_step(on: bool) -> None:
    """Whether the replica-step thread, once started, runs at the low priority (the node
    has a processor of its own). Set before the first step of the process."""
    global _yielding
    _yielding = on


def yielding() -> bool:
    """Whether replica steps go to a thread at the low priority."""
    return _yielding


def behind() -> None:
    """A step was still running when the next was due: from now on steps run on a thread
    of the normal priority (the old thread ends after the step it is running)."""
    global _executor, _yielding
    if _yielding:
        _yielding = False
        _log.warning("the replica's optimizer step was still running a step later at a low "
                     "priority; it runs at the normal priority from now on")
        if _executor is not None:
            _executor.shutdown(wait=False)
            _executor = None


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: no native ids
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), YIELDING_NICE)


def submit(fn: Callable[..., Any], *args: Any) -> Future:
    """Run `fn(*args)` on the replica-step thread (one at a time: steps run in order)."""
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-step",
                                       initializer=_lower_priority if _yielding else None)
    return _executor.submit(fn, *args)


def wait(pending: Future, what: str) -> None:
    """Wait for `pending` (its error raised here), at most `TIMEOUT_S`."""
    try:
        pending.result(timeout=TIMEOUT_S)
    except FutureTimeout:
        raise RuntimeError(f"{what} did not finish in {TIMEOUT_S:.0f} s") from None
