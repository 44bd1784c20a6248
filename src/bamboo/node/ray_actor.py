"""One Bamboo node's home on a Ray node: the actor that runs `bamboo agent` beside it.

`bamboo.launch.on_ray` creates one `NodeActor` per node it asks Ray for. The actor starts
`bamboo agent --join COORDINATOR --exit-with-parent` as its child (the token on its stdin,
its machine named after the actor's Ray node), so from there on the node is an agent's
worker: the same worker, wire and invariant as on bare machines. The agent ends with the
actor (a killed actor, a lost Ray node, a dead driver); `serve` returns the agent's exit
code when it ends first (the run finished: 0; drained on a notice: 3).

Also here: `probe_run_dir`, the check that a Ray node can write the run directory, run as a
zero-CPU task on every node before the run starts. Imported where Ray runs it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["NodeActor", "probe_run_dir", "machine_name", "ray_node_of"]

_PREFIX = "ray-"


def machine_name(node_id: str, index: int) -> str:
    """The machine an actor's agent says it is: unique in the run, naming its Ray node."""
    return f"{_PREFIX}{index}@{node_id}"


def ray_node_of(machine: str | None) -> str | None:
    """The Ray node id in a `machine_name` (None for any other machine)."""
    if machine is None or not machine.startswith(_PREFIX) or "@" not in machine:
        return None
    return machine.rpartition("@")[2]


def probe_run_dir(run_dir: str) -> tuple[str, str, str | None]:
    """(this Ray node's id, its host, None) when `run_dir` is a directory this node can
    write, else (id, host, what is wrong)."""
    import ray
    node = ray.get_runtime_context().get_node_id()
    host = socket.gethostname()
    path = Path(run_dir)
    if not path.is_dir():
        return node, host, f"{run_dir} does not exist there"
    probe = path / f".ray-probe-{node[:12]}-{os.getpid()}"
    try:
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        return node, host, f"{run_dir} is not writable there ({e.strerror or e})"
    return node, host, None


class NodeActor:
    """A Ray actor holding one `bamboo agent` process (see the module docstring)."""

    def __init__(self, join: str, token: str, index: int, log_dir: str, rejoin_s: float
                 ) -> None:
        import ray
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.host = socket.gethostname()
        self.machine = machine_name(self.node_id, index)
        os.makedirs(log_dir, exist_ok=True)
        self._log = open(os.path.join(log_dir, f"agent-{_PREFIX}{index}.log"), "ab")
        self.agent = subprocess.Popen(
            [sys.executable, "-m", "bamboo", "agent", "--join", join, "--token-file",
             "/dev/stdin", "--workers", "1", "--rejoin-s", f"{rejoin_s:g}", "--log-dir",
             log_dir, "--machine", self.machine, "--exit-with-parent"],
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT)
        assert self.agent.stdin is not None
        self.agent.stdin.write(token.encode() + b"\n")
        self.agent.stdin.close()

    def where(self) -> tuple[str, str, str]:
        """(Ray node id, host, machine name)."""
        return self.node_id, self.host, self.machine

    def serve(self) -> int:
        """Wait for the agent to end: its exit code (negative: the signal that ended it)."""
        code = self.agent.wait()
        self._log.close()
        return code

    def stop(self) -> None:
        """End the agent now (its workers go with it)."""
        if self.agent.poll() is None:
            self.agent.send_signal(signal.SIGKILL)
