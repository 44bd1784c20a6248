"""A real Ray cluster on this machine, as Ray's own tests make one (`ray.cluster_utils.Cluster`):
a head with no CPU and raylets of one CPU each, on loopback; a raylet and every process under
it SIGKILLed at once is a machine lost."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Any

import psutil

from bamboo.chaos.ray_nodes import kill_ray_node

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only, in drivers started here too

_ALIVE_ACTORS = """
import json, sys, ray
from ray._private import state
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
table = state.state.actor_table(None)
print(json.dumps(sorted(a["ActorClassName"] for a in table.values() if a["State"] != "DEAD")))
"""


class RayCluster:
    """A head (no CPU) and `raylets` raylets of one CPU each."""

    def __init__(self, raylets: int) -> None:
        from ray.cluster_utils import Cluster
        self.cluster = Cluster(initialize_head=True,
                               head_node_args={"num_cpus": 0, "include_dashboard": False})
        for _ in range(raylets):
            self.add()
        self.cluster.wait_for_nodes()

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def add(self, cpus: int = 1) -> Any:
        """One more raylet (a new machine joining)."""
        return self.cluster.add_node(num_cpus=cpus)

    def raylets(self) -> list[Any]:
        return [n for n in self.cluster.list_all_nodes() if n is not self.cluster.head_node]

    def node(self, node_id: str) -> Any:
        return next(n for n in self.raylets() if n.node_id == node_id)

    def kill(self, node: Any) -> list[int]:
        """SIGKILL the raylet and every process under it at once (the pids killed)."""
        return kill_ray_node(self.cluster, node)

    def keep(self, raylets: int) -> None:
        """Add raylets until there are `raylets` (after a test killed or drained some: a
        drained raylet exits once it has nothing left to run)."""
        for node in self.raylets():
            if node.all_processes["raylet"][0].process.poll() is not None:
                with contextlib.suppress(Exception):
                    self.cluster.remove_node(node, allow_graceful=False)
        while len(self.raylets()) < raylets:
            self.add()
        self.cluster.wait_for_nodes()

    def live_actors(self) -> list[str]:
        """The class names of the cluster's actors not dead yet (asked by a driver of its own)."""
        out = subprocess.run([sys.executable, "-c", _ALIVE_ACTORS, self.address],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return list(json.loads(out.stdout.strip().splitlines()[-1]))

    def drain(self, node_id: str, deadline_s: int) -> None:
        """`ray drain-node` with reason preemption, as the autoscaler drains a spot node."""
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        subprocess.run([ray_cli, "drain-node", "--address", self.address, "--node-id", node_id,
                        "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
                        "spot preemption (test)", "--deadline-remaining-seconds",
                        str(deadline_s)], check=True, capture_output=True, timeout=60)

    def shutdown(self) -> None:
        self.cluster.shutdown()


def agents_of(out: Any) -> list[psutil.Process]:
    """The `bamboo agent` processes Ray actors started for the run writing `out`."""
    mine = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "agent" in cmd and "--exit-with-parent" in cmd and f"{out}/logs" in cmd:
            mine.append(p)
    return mine


def wait_gone(out: Any, timeout: float = 10.0) -> list[psutil.Process]:
    """Until no agent of the run in `out` is left (those left after `timeout`)."""
    deadline = time.monotonic() + timeout
    while (left := agents_of(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
