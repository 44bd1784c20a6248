"""Every message between workers, agents and the coordinator, and every shared name.

Workers report up their own pipe (an agent relays them over its connection); each report
is one of the frozen dataclasses below (or the engine's `StepReport`, defined with the
engine's votes in `bamboo.pipeline.votes`), so the coordinator dispatches on the type, never on
a string. Decisions come down through the coordinator's store under the keys defined here
(values: `bamboo.pipeline.votes`' enums in their text form, plans and role maps as JSON).
Liveness and progress go through two shared arrays whose layout is defined here too.

    gen/<g>            the plan of generation g (bamboo.reconfig.planner, JSON)
    epoch/<e>          the role map after the e-th change of membership (JSON); epochs
                       count on across generations, so keys never repeat
    go/<step>/<e>      Go: "go" when every live node finished its micro-batches, else "abort"
    decide/<step>/<e>  Verdict: "commit[+ckpt][+reconf]" or "redo"
    shutdown           the run is over: every worker exits
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bamboo.pipeline.votes import BoundaryFlag, Decision, Go, StepReport, Verdict

__all__ = [
    "Go", "Decision", "BoundaryFlag", "Verdict",
    "SHUTDOWN_KEY", "plan_key", "epoch_key", "go_key", "decide_key",
    "PHASES", "Progress",
    "WorkerMessage", "Ready", "MicroBatchesDone", "RoundDone", "StepReport", "LayerParams",
    "GenerationReady", "GenerationEnd", "CheckpointPart", "Notice", "Left", "Done",
    "WorkerError",
    "AgentMessage", "Hello", "Job", "Refused", "KillOrder", "NoticeOrder", "Beat", "Exit",
]

# -- store keys ---------------------------------------------------------------------------

SHUTDOWN_KEY = "shutdown"


def plan_key(gen: int) -> str:
    return f"gen/{gen}"


def epoch_key(epoch: int) -> str:
    return f"epoch/{epoch}"


def go_key(step: int, epoch: int) -> str:
    return f"go/{step}/{epoch}"


def decide_key(step: int, epoch: int) -> str:
    return f"decide/{step}/{epoch}"


# -- shared arrays ------------------------------------------------------------------------

PHASES = ("forward", "backward", "commit", "optimizer")
"""A node's phase within a step, as stored in its progress slot (by index)."""


class Progress:
    """The coordinator's view of each slot: a heartbeat time (`beats`, doubles, monotonic
    seconds) and the step and phase index being worked on (`cells`, two ints a slot).
    Workers write their slot; the coordinator (or an agent's relay) reads it."""

    def __init__(self, beats: Any, cells: Any) -> None:
        self.beats, self.cells = beats, cells

    @staticmethod
    def cells_for(slots: int) -> int:
        return 2 * slots

    def mark(self, slot: int, step: int, phase: int) -> None:
        self.cells[2 * slot] = step
        self.cells[2 * slot + 1] = phase

    def step_of(self, slot: int) -> int:
        return int(self.cells[2 * slot])

    def phase_of(self, slot: int) -> int:
        return int(self.cells[2 * slot + 1])

    def reset(self, slot: int, beat: float) -> None:
        self.beats[slot] = beat
        self.mark(slot, 0, 0)


# -- worker -> coordinator ----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerMessage:
    rank: int
    """The sender's rank in its generation (its node id before it joins one)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Ready(WorkerMessage):
    """The worker process is up and waits for a plan."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchesDone(WorkerMessage):
    """Vote 1: this node's micro-batches of `step` are done under role epoch `epoch`."""

    step: int
    epoch: int


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundDone(WorkerMessage):
    """Vote 2: this node's commit round of `step` finished (`ok`: nothing failed)."""

    step: int
    epoch: int
    ok: bool
    losses: list[tuple[int, float, float]]
    """(global micro-batch, loss, weight) of every micro-batch whose loss this node computed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerParams(WorkerMessage):
    """After the last step: the parameters of every layer this node holds (with replica)."""

    layers: list[tuple[int, list[tuple[str, Any]]]]


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationReady(WorkerMessage):
    """This node holds its state for generation `gen` and starts training."""

    gen: int
    stages: list[int]
    replica: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationEnd(WorkerMessage):
    """This node left generation `gen` holding `layers` at `step` (`failed`: the generation
    could not start here, and `layers` are those of the last boundary)."""

    gen: int
    layers: list[int]
    step: int
    failed: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointPart(WorkerMessage):
    """After a commit marked `ckpt`: the state of the layers this node writes."""

    step: int
    layers: dict[int, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class Notice(WorkerMessage):
    """A preemption notice reached this node (SIGTERM, or a cloud's metadata)."""

    source: str = "SIGTERM"


@dataclass(frozen=True, kw_only=True, slots=True)
class Left(WorkerMessage):
    """A draining node handed its state over and leaves."""

    gen: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Done(WorkerMessage):
    """The node finished the run's last step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerError(WorkerMessage):
    """The worker raised; it exits next."""

    step: int
    error: str
    traceback: str
    peer_lost: bool
    """The error was a lost peer (the loss itself is the cause, not this node)."""


# -- agent <-> coordinator ----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentMessage:
    pass


@dataclass(frozen=True, kw_only=True, slots=True)
class Hello(AgentMessage):
    pid: int
    host: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Job(AgentMessage):
    spec: Any
    """The worker's WorkerSpec."""
    etcd: dict | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Refused(AgentMessage):
    why: str


@dataclass(frozen=True, kw_only=True, slots=True)
class KillOrder(AgentMessage):
    """Kill the worker now (a fence, or a preemption)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NoticeOrder(AgentMessage):
    """Deliver a preemption notice to the worker (trace replay, `--kill ...+notice`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Beat(AgentMessage):
    """The agent's relay of its worker's heartbeat slot."""

    age: float
    step: int
    phase: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Exit(AgentMessage):
    code: int | None
