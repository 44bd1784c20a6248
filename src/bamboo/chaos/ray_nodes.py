"""A Ray machine lost on purpose: a raylet of a `ray.cluster_utils.Cluster` SIGKILLed with
every process under it at once (its workers, actors and their children), as a spot machine
vanishes; the tests and the Ray benchmarks kill nodes only through here."""
from __future__ import annotations

import contextlib
import signal
from typing import Any

__all__ = ["kill_ray_node", "processes_under"]


def processes_under(node: Any) -> int:
    """How many processes run under `node`'s raylet (0 when it is gone)."""
    import psutil
    try:
        raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
        return len(raylet.children(recursive=True))
    except psutil.NoSuchProcess:
        return 0


def kill_ray_node(cluster: Any, node: Any, wait_s: float = 10.0) -> list[int]:
    """SIGKILL `node`'s raylet and every process under it at once, wait up to `wait_s` for
    them to be gone, then drop the node from `cluster` (a `ray.cluster_utils.Cluster`);
    returns the pids killed."""
    import psutil
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    victims = [raylet, *raylet.children(recursive=True)]
    for process in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
    psutil.wait_procs(victims, timeout=wait_s)
    with contextlib.suppress(Exception):  # its processes are gone: Ray's bookkeeping may lag
        cluster.remove_node(node, allow_graceful=False)
    return [process.pid for process in victims]
