"""Every message between workers, agents and the coordinator, and every shared name.

Workers report up their own pipe (an agent relays them over its connection); each report
is one of the frozen dataclasses below (or the engine's `StepReport`, defined with the
engine's votes in `bamboo.protocol.votes`), so the coordinator dispatches on the type, never on
a string. Decisions come down through the coordinator's store under the keys defined here
(values: `bamboo.protocol.votes`' enums in their text form, plans and role maps as JSON).
Liveness and progress go through two shared arrays whose layout is defined here too.

    gen/<g>            the plan of generation g (bamboo.plan.planner, JSON)
    epoch/<e>          the role map after the e-th change of membership (JSON); epochs
                       count on across generations, so keys never repeat
    go/<step>/<e>      Go: "go" when every live node finished its micro-batches, else "abort"
    decide/<step>/<e>  Verdict: "commit[+ckpt][+reconf]" or "redo"
    order/<k>/<n>      a step-by-step run's n-th order at the boundary after k steps
                       (bamboo.plan.orders: eval, save, step, finish; JSON)
    order/<k>/<n>/done that order is complete: a node that comes back to the boundary
                       skips it
    final/<node>       after the last step: layers (JSON list) whose final parameters this
                       node is to write from its copy, their first holder having been lost
    shutdown           the run is over: every worker exits
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bamboo.protocol.votes import BoundaryFlag, Decision, Go, StepReport, Verdict

__all__ = [
    "Go", "Decision", "BoundaryFlag", "Verdict",
    "SHUTDOWN_KEY", "plan_key", "epoch_key", "go_key", "decide_key", "eval_key",
    "final_request_key", "order_key", "order_done_key",
    "PHASES", "Progress",
    "WorkerMessage", "Ready", "MicroBatchesDone", "RoundDone", "EvalDone", "StepReport",
    "LayerParams",
    "GenerationReady", "GenerationEnd", "CheckpointPart", "Notice", "Left", "Done",
    "WorkerError",
    "AgentMessage", "Hello", "Job", "Refused", "KillOrder", "NoticeOrder", "Ping", "Finished",
    "FromWorker", "Beat", "Exit", "AGENT_MESSAGES", "WORKER_MESSAGES",
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


def eval_key(step: int, epoch: int) -> str:
    return f"eval/{step}/{epoch}"


def order_key(step: int, n: int) -> str:
    return f"order/{step}/{n}"


def order_done_key(step: int, n: int) -> str:
    return f"order/{step}/{n}/done"


def final_request_key(node_name: str) -> str:
    return f"final/{node_name}"


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

    cpus: tuple[int, ...] = ()
    """The cores `--pin-cpus auto` pinned it to (empty: not pinned)."""
    own_processor: bool = False
    """It has a processor no other worker uses: an accelerator, its own pinned cores, or a
    machine with at least as many cores as workers. Without one, its waits are other
    workers running, so redundant work cannot hide in them (`--redundancy auto` reads it)."""


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
    grad_norm: float = 0.0
    """The step's global gradient norm as this node's commit round agreed on it (checked for
    a non-finite value before the step is committed: a diverging run stops there)."""
    metrics: list[tuple[int, str, float]] = field(default_factory=list)
    """(global micro-batch, name, value) of the job's metrics (`--metric`) of the micro-batches
    in `losses`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalDone(WorkerMessage):
    """The evaluation vote: this node's part of the held-out pass after `step` steps is done
    under role epoch `epoch`; answered go (all live nodes done under that epoch) or abort
    (the roles changed: every node evaluates again under the new ones)."""

    step: int
    epoch: int
    losses: list[tuple[int, float, float]]
    """(val micro-batch, loss, weight) of every val micro-batch whose loss this node computed."""
    metrics: list[tuple[int, str, float]] = field(default_factory=list)
    """(val micro-batch, name, value) of the job's metrics of those val micro-batches."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerParams(WorkerMessage):
    """After the last step: the layers whose final parameters this node wrote to the run's
    checkpoint storage (`final-<steps>/`, as each stage's first live holder, or from its
    copy when the coordinator asked: `final_request_key`); empty from every other node.
    `error`: the write failed (the trained model cannot be assembled)."""

    layers: list[int] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationReady(WorkerMessage):
    """This node holds its state for generation `gen` and starts training."""

    gen: int
    stages: list[int]
    replica: int | None
    state_from: str = ""
    """Where the state it lacked came from: "peers" (a transfer), "checkpoint", or ""."""
    state_bytes: int = 0
    """Bytes of layer state received or read."""
    state_s: float = 0.0
    """Seconds that took (a transfer counts from its first post to its last receive)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationEnd(WorkerMessage):
    """This node left generation `gen` holding `layers` at `step` (`failed`: the generation
    could not start here, and `layers` are those of the last boundary)."""

    gen: int
    layers: list[int]
    step: int
    failed: str | None = None
    layer_bytes: list[int] = field(default_factory=list)
    """The packed state's bytes of each of `layers`, in order: what a transfer of it moves."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointPart(WorkerMessage):
    """After a commit marked `ckpt`: this node's layers of checkpoint `step` are written and
    durable (`error`: the write failed, that checkpoint is never published)."""

    step: int
    layers: list[int]
    error: str | None = None
    bytes: int = 0
    """Bytes of layer state written."""
    seconds: float = 0.0
    """Seconds the write took (on the node's writer thread, after the copy)."""


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
# JSON frames (bamboo.protocol.frames); an agent runs K workers, each message names one by its
# local index `worker` (worker k uses the machine's GPU k).


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentMessage:
    pass


@dataclass(frozen=True, kw_only=True, slots=True)
class Hello(AgentMessage):
    """What an agent says of itself in the join handshake."""

    pid: int
    host: str
    workers: int = 1
    machine: str = ""
    """A name for the machine, unique in the job (host name and pid by default)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Job(AgentMessage):
    """Start worker `worker` with this spec."""

    worker: int
    spec: Any
    """The worker's WorkerSpec (its store_host None: the address the agent joined on)."""
    etcd: dict[str, str] | None = None
    lease_s: float = 10.0
    """The coordinator pings at least every second: silence this long means it is gone."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Refused(AgentMessage):
    why: str


@dataclass(frozen=True, kw_only=True, slots=True)
class KillOrder(AgentMessage):
    """Kill worker `worker` now (a fence, or a preemption)."""

    worker: int


@dataclass(frozen=True, kw_only=True, slots=True)
class NoticeOrder(AgentMessage):
    """Deliver a preemption notice to the worker (trace replay, `--kill ...+notice`, a Ray
    node draining)."""

    worker: int
    source: str = "coordinator"
    """Who gave the notice, as the worker's `Notice` names it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Ping(AgentMessage):
    """The coordinator is alive (sent every second to every agent)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Finished(AgentMessage):
    """The run is over: stop the workers and exit 0 (do not rejoin)."""

    status: str = "completed"


@dataclass(frozen=True, kw_only=True, slots=True)
class FromWorker(AgentMessage):
    """A worker's report, relayed."""

    worker: int
    msg: Any


@dataclass(frozen=True, kw_only=True, slots=True)
class Beat(AgentMessage):
    """The agent's relay of its workers' heartbeat slots: [worker, age, step, phase] each."""

    slots: list[list[float]]


@dataclass(frozen=True, kw_only=True, slots=True)
class Exit(AgentMessage):
    worker: int
    code: int | None


AGENT_MESSAGES = (Hello, Job, Refused, KillOrder, NoticeOrder, Ping, Finished, FromWorker,
                  Beat, Exit)
WORKER_MESSAGES = (Ready, MicroBatchesDone, RoundDone, EvalDone, StepReport, LayerParams,
                   GenerationReady, GenerationEnd, CheckpointPart, Notice, Left, Done, WorkerError)
