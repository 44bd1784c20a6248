"""What the engine asks of whoever decides a step's fate: the votes of the commit protocol.

A step ends in two votes. After its micro-batches a node votes that it is ready and waits
for `Go.GO` (or `Go.ABORT`: the roles changed, redo the step's remaining work); after the
commit round it votes whether the round succeeded and waits for a `Verdict`: `COMMIT`
(apply the update, possibly with boundary flags: write a checkpoint, end the generation)
or `REDO`. Role maps arrive as epochs. The engine depends only on this interface; the
cluster's `CoordinatorLink` implements it over the coordinator's store. After a commit the
engine's `StepReport` goes up as a message of its own.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from bamboo.plan.roles import RoleMap

__all__ = ["Go", "Decision", "BoundaryFlag", "Verdict", "Votes", "StepReport"]


class Go(enum.Enum):
    """The answer to "my micro-batches are done"."""

    GO = "go"
    ABORT = "abort"


class Decision(enum.Enum):
    """The answer to "my commit round is done"."""

    COMMIT = "commit"
    REDO = "redo"


class BoundaryFlag(enum.Enum):
    """What happens at the boundary after a committed step."""

    CHECKPOINT = "ckpt"
    """Every stage's first live holder sends its layers for a durable checkpoint."""
    RECONFIGURE = "reconf"
    """The generation ends here; the next plan follows."""


@dataclass(frozen=True, slots=True)
class Verdict:
    decision: Decision
    flags: frozenset[BoundaryFlag] = frozenset()

    def encode(self) -> str:
        """The store's text form: `commit`, `commit+ckpt+reconf`, `redo`."""
        names = sorted(f.value for f in self.flags)
        return "+".join([self.decision.value] + names)

    @classmethod
    def decode(cls, text: str) -> Verdict:
        decision, *flags = text.split("+")
        return cls(Decision(decision), frozenset(BoundaryFlag(f) for f in flags))


@dataclass(kw_only=True, slots=True, frozen=True)
class StepReport:
    """What one node tells the coordinator after a committed step. Frozen: the engine
    builds it once, when the step commits, from what it counted during the step; it is
    sent once."""

    step: int
    rank: int
    stages: list[int]
    losses: list[tuple[int, float, float]] = field(default_factory=list)
    grad_norm: float = 0.0
    lr: float = 0.0
    loss_scale: float = 1.0
    """`--precision fp16`: the scale the step's loss was multiplied by (1 otherwise)."""
    skipped: bool = False
    """`--precision fp16`: its gradients overflowed, so no optimizer step was applied."""
    compute_s: float = 0.0
    frc_s: float = 0.0
    wait_s: float = 0.0
    reduce_s: float = 0.0
    optim_s: float = 0.0
    vote_s: float = 0.0
    """Seconds waiting for the answers to this step's go and commit votes:
    the slowest node's lag behind this one plus the round trips through the coordinator."""
    step_s: float = 0.0
    bytes_sent: int = 0
    bytes_replica: int = 0
    frc_forwards: int = 0
    """Eager FRC forwards run in this step (one per micro-batch, unless a failover came)."""
    frc_in_waits: int = 0
    """Of those, how many ran while the node waited for a transfer (`--frc-at waits`)."""
    buckets_early: int = 0
    """Buckets of the data-parallel sums launched before the commit round (`buckets.py`)."""
    frc_reused: int = 0
    brc: int = 0
    resent_grads: int = 0
    page_faults: int = 0
    """Minor page faults of the process during the step: memory the step touched for the
    first time (a large tensor the allocator got fresh from the kernel, zeroed page by page)."""
    rebuilds: int = 0
    """strict: process groups formed among the survivors during this step."""
    rebuild_s: float = 0.0
    """strict: seconds those formations took, with settling the step's transfers."""
    attempts: int = 1
    restarts: int = 0
    """`--redundancy reroute`: times this step's micro-batches started again under re-routed roles."""
    saved_bytes: int = 0
    """Bytes autograd saved for backward in this step's forwards (activation memory; each
    storage once per forward; parameters and a stage's received input not included)."""
    frc_saved_bytes: int = 0
    """The same, for the eager FRC forwards of the replica stage (kept the whole step; on
    the host under --frc-offload)."""
    state_bytes: int = 0
    """Parameters and optimizer state held, as their layer states pack them
    (`bamboo.engine.layer_state`): every stage and the replica."""
    params_held: int = 0
    """Parameters held: every stage and the replica."""
    device_bytes: int = 0
    """Peak device-resident bytes of the step, by tensor accounting: every held stage's
    parameters, gradient sum and optimizer state (the replica's unless offloaded), one
    transient .grad, and the running peak of saved activations, kept stage outputs and
    eager FRC's saved tensors (unless offloaded). Not process memory."""
    host_bytes: int = 0
    """Peak host bytes offload put there: FRC saved tensors, the replica kept in host
    memory (lazy) and its optimizer state under --frc-offload (counted as host memory even
    on a CPU-only machine)."""
    replica_host_bytes: int = 0
    """The replica's bytes in host memory after the step (0: none kept there)."""
    promotion_s: list[float] = field(default_factory=list)
    """Seconds each failover of this step took to bring its replica to the device."""
    rss_bytes: int = 0
    """The process's resident memory at the end of the step (after the optimizer step and
    the step's buffers are dropped): real memory, not tensor accounting."""
    rss_peak_bytes: int = 0
    """The process's resident high-water mark so far."""
    cuda_peak_bytes: int = 0
    """On CUDA: the caching allocator's peak allocated bytes during the step (0 on CPU)."""
    cuda_reserved_bytes: int = 0
    """On CUDA: the bytes the caching allocator holds at the end of the step (0 on CPU)."""
    digests: dict[str, str] = field(default_factory=dict)


class Votes(Protocol):
    """The engine's side of the step protocol."""

    latest_epoch: int
    """The newest role-map epoch known (kept current by a background watcher)."""
    on_epoch: Callable[[], None]
    """Called (from the watcher's thread) whenever a newer epoch appears."""
    vote_s: float
    """Seconds spent waiting for answers since the engine last set it to 0."""

    def phase_a_done(self, step: int, epoch: int) -> Go: ...

    def round_done(self, step: int, epoch: int, ok: bool,
                   losses: list[tuple[int, float, float]], grad_norm: float = 0.0,
                   metrics: list[tuple[int, str, float]] | None = None) -> Verdict: ...

    def eval_done(self, step: int, epoch: int, losses: list[tuple[int, float, float]],
                  metrics: list[tuple[int, str, float]] | None = None) -> Go: ...

    def next_epochs(self, current: int, wait: bool) -> list[RoleMap]: ...
