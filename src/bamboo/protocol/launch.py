"""Where nodes run: the one interface between the coordinator and whatever starts its nodes.

A `Launcher` starts a node from a `WorkerSpec` and hands back a `Started`: the node's
`NodeProcess` (how the coordinator learns of its death: `sentinel` and `exitcode`; how it
fences it: `kill`; how it passes on a preemption notice: `terminate_notice`) and the channel
of the node's reports (`ReportChannel`; a notice the node's machine gets arrives there as a
report too). New capacity (an agent that joined, a GPU whose worker ended while its machine
stayed) comes as `Offer`s; deaths the launcher learns of by other means (a membership lease
that ran out) come from `expired`.

Local worker processes (`bamboo.launch.local`) and agents on other machines
(`bamboo.launch.agents`) implement it; `bamboo.control` knows nothing else of where nodes
run, so a new launcher is one class beside those two. Torch-free.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from bamboo.config import JobConfig
from bamboo.plan.faults import Fault
from bamboo.protocol.messages import Progress

__all__ = ["WorkerSpec", "StoreAddress", "ReportChannel", "NodeProcess", "Started", "Offer",
           "LaunchError", "Launcher"]


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSpec:
    """Everything a worker needs to start."""

    node: int
    """Node id: the worker is `n{node}` for the whole run."""
    slot: int
    """Its index in the shared heartbeat and progress arrays."""
    first_gen: int
    """The first generation whose plan it waits for."""
    store_host: str
    store_port: int
    config: JobConfig
    faults: tuple[Fault, ...] = ()
    device_index: int | None = None
    """With CUDA: the worker's slot on its machine, which picks its GPU (see
    `bamboo.node.devices.choose_device_index`): an agent's worker k has slot k; a local run
    gives each worker a slot no live local worker holds, on the least used GPU
    (`bamboo.launch.local`). None: slot 0. Never the node id (node ids keep growing as
    replacements join)."""
    local_workers: int = 1
    """How many workers this machine runs at most at once: under `--pin-cpus auto` each gets
    an equal share of its cores, by `device_index` (`bamboo.node.pinning`)."""

    @property
    def name(self) -> str:
        return f"n{self.node}"


@dataclass(frozen=True, slots=True)
class StoreAddress:
    """Where the run's store listens, and the host its workers are told."""

    bind_host: str
    port: int
    """0: any free port."""
    advertised: str | None
    """The host workers reach the store at (None: whatever address each agent joined on)."""


class ReportChannel(Protocol):
    """A node's reports to the coordinator, in order (a `multiprocessing` pipe's reading
    end is one); `fileno` lets the coordinator wait on many at once."""

    def poll(self, timeout: float | None = 0.0) -> bool: ...

    def recv(self) -> Any: ...

    def close(self) -> None: ...

    def fileno(self) -> int: ...


class NodeProcess(Protocol):
    """A started node as the coordinator handles it, wherever it runs."""

    @property
    def pid(self) -> int | None:
        """The process id on its own host."""

    @property
    def sentinel(self) -> int:
        """A descriptor that becomes readable when the node has ended."""

    @property
    def exitcode(self) -> int | None:
        """The node's exit code once it ended (a negative signal number: killed)."""

    def is_alive(self) -> bool: ...

    def kill(self) -> None:
        """SIGKILL now (fencing): the node counts as gone even if its machine never answers."""

    def terminate_notice(self) -> None:
        """Give the node a preemption notice (SIGTERM), as its cloud would."""

    def join(self, timeout: float | None = None) -> None: ...

    def close(self) -> None:
        """Release its descriptors, once it has ended."""


@dataclass(frozen=True, slots=True)
class Started:
    """A node its launcher started."""

    process: NodeProcess
    reports: ReportChannel
    host: str | None = None
    """The host it runs on, as its events name it (None: this one)."""
    machine: str | None = None
    """The machine it shares with other nodes of one agent (None: a machine of its own)."""
    device_slot: int | None = None
    """Its slot on its machine (its GPU), when the launcher chose one."""
    worker: int | None = None
    """Its index among its machine's workers, when the machine runs several."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Where it runs in the launcher's words (`ray_node_id`), added to its node events."""


@dataclass(frozen=True, slots=True)
class Offer:
    """Room for one more node that a launcher learned of (new capacity)."""

    machine: str
    """The machine that has the room."""
    arrival: str | None = None
    """How the room came (said once with the nodes started on it): "agent m1 joined from
    10.0.0.2:41234"; None for a slot freed on a machine the run already uses."""
    spare: bool = False
    """A slot freed by a worker that ended while its machine stayed: worth a node only while
    the run has steps left."""
    ticket: Any = None
    """The launcher's own handle of the room (which agent, which slot)."""


class LaunchError(Exception):
    """A launcher cannot start the node asked for; str() is the one line for the user."""


class Launcher(Protocol):
    """Where a run's nodes run. The coordinator asks it for nodes and for what it waits on;
    everything else about a node (its reports, its death) comes through `Started`."""

    on_demand: bool
    """Whether `start` needs no offer (local processes: yes; agents: only offered rooms)."""

    def store_address(self) -> StoreAddress:
        """Where the run's store listens and what its workers are told."""

    def start(self, spec: WorkerSpec, heartbeats: Progress, offer: Offer | None = None
              ) -> Started:
        """Start a node with `spec`, in the room `offer` names (None: wherever this launcher
        starts nodes on demand); LaunchError when it cannot. The node (or its machine's
        relay) stamps its heartbeat and progress in slot `spec.slot` of `heartbeats`."""

    def offers(self, timeout_s: float = 0.0) -> list[Offer]:
        """New rooms since the last call, waiting up to `timeout_s` for the first."""

    def decline(self, offer: Offer, why: str) -> str | None:
        """An offered room the run will not use (`why`: --max-nodes is reached). The host
        whose offer was thereby refused outright (told `why`, it goes away), or None."""

    def expired(self) -> list[tuple[str, str]]:
        """Nodes known dead by other means than their own process since the last call (an
        etcd lease that ran out, a Ray node reported dead), fenced then: (name, why)."""

    def broken(self, exit_code: int | None = None) -> str | None:
        """Why this launcher's nodes all died at once and no more can start here (one line),
        asked when a node ended with `exit_code`; None while it works."""

    def waiting(self, count: int) -> str | None:
        """The line said when the run begins to wait for its first `count` nodes' rooms."""

    def progress(self, started: int, count: int) -> str:
        """Where that wait stands, said every few seconds."""

    def gave_up(self, started: int, count: int) -> str:
        """The stop that ends that wait when `patience_s` has passed (what to do, too)."""

    def patience_s(self) -> float:
        """How long a wait for rooms lasts before the run stops (the first nodes) or gives up
        waiting (a reconfiguration)."""

    def awaited(self) -> str:
        """What a reconfiguration left without a live node waits for, said in the message of
        the stop that ends that wait ("an agent to offer a worker (...)")."""

    def close(self, final_status: str | None) -> None:
        """The run ended ("completed", "failed"; None: interrupted, or it never started)."""
