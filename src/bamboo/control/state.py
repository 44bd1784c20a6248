"""What the coordinator's parts share: the run's services and the run's state.

`RunContext` holds the services (config, store, events, display, clock) and the state
every part reads: the current plan and role map, the committed step and its losses, the
nodes, the reconfiguration under way. Tests build the parts through the core
(`core.CoordinatorCore.start`) around a dict store and a fake clock.

One writer per field. Every field of the shared state has exactly one part that writes
it; the others only read it. A part that needs another's field changed calls that part's
method, or returns what happened to the core, which hands it on: the parts are built
without callbacks (`CoordinatorCore._build_parts`). `tests/unit/control/test_writers.py`
fails when a second module writes a field (of the context, of a node, of a loss or of a
plan).

| field | its one writer | readers |
| --- | --- | --- |
| `cfg`, `store`, `events`, `display`, `run_path`, `param_counts`, `partition_costs`, `clock`, `t0`, `resume_step`, `resume_path` | `core` (`CoordinatorCore._context`, once, before any part exists) | every part |
| `rc` (derived: `plan`'s mode, or the job's before the first plan; no writer) | none | `failures`, `generations`, `health` |
| `plan` | `generations.Generations.enter` | `core`, `display`, `failures`, `final_layers`, `health`, `preemptions`, `redundancy_mode`, `results`, `supply`, `steps` |
| `roles` | `generations.Generations` (`enter`, `publish_roles` for a failover/peer restore/re-route that `failures` planned, `abandon`) | `core`, `display`, `failures`, `final_layers`, `health`, `kills`, `preemptions`, `steps` |
| `reconf` and each field of it (`ending`, `holdings`, `abandoned`, `lost`, `why`, `restarting`) | `generations.Generations` (`begin`, `abandon`, `restarting`, `not_ending`, `on_end`, `try_plan`) | `core`, `display`, `failures`, `health`, `supply`, `steps` |
| `committed`, `losses` | `steps.StepProtocol` (`_commit`; `rewind` when the core enters a plan from a restore point) | `checkpointing`, `core`, `failures`, `generations`, `health`, `kills`, `preemptions`, `redundancy_mode`, `restore`, `results`, `user_stop` |
| `metrics` | `steps.StepProtocol` (`_commit`, `rewind`, as `losses`) | `checkpointing`, `health`, `results` |
| `layouts` | `steps.StepProtocol._note_layout` | `results` (summary) |
| `eval_losses`, `eval_metrics` | `results.Results.record_eval` | `checkpointing`, `core` |
| `stepwise`, `interface` | `core` (`CoordinatorCore._context`, once) | `generations`, `orders` |
| `skipped_steps` | `steps.StepProtocol` (`_commit`, `rewind`, as `losses`) | `checkpointing`, `generations`, `results` |
| `start_loss_scale` | `core` (`CoordinatorCore._context`, once) | through `loss_scale_at` |
| `lr_scales`, `end_step` | `orders.Orders.give` (a step-by-step run's orders; `core._context` sets where a resume starts) | `checkpointing`, `core`, `generations`, `results` |

Each `Loss` (a lost node, until its `node_lost` event is out) is written by
`failures.FailureHandler` alone: a new generation that restores what nothing in flight
covered reaches it through `FailureHandler.covered`, by way of the core. The generation's
plan (`GenerationPlan`) is frozen: `Generations.enter` completes it with the run's state
once, before publishing it, and no one writes it after.

A node's fields (`nodes.Node`) follow the same rule: the supervisor writes them (`state`
through `Supervisor.set_state`; a kill through `kill`, `kill_due`, `fence`, `retire`; `ready`,
`plays`, `exited`, `release`), and `Generations.enter` its `rank` in the current generation.
"""
from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bamboo.config import JobConfig
from bamboo.plan.loss_scale import LossScale, scale_at
from bamboo.plan.planner import GenerationPlan
from bamboo.plan.roles import RoleMap
from bamboo.run.interface import Interface

__all__ = ["RunFailed", "Store", "Events", "Display", "RunContext", "HandledAs", "Loss",
           "Reconfiguration"]


class RunFailed(RuntimeError):
    """The run stopped before its last step; str() is the one line for the user."""

    def __init__(self, message: str, summary: dict[str, Any], exit_code: int = 1) -> None:
        super().__init__(message)
        self.summary, self.exit_code = summary, exit_code


class Stop(Exception):
    """Raised by a part that decided the run cannot go on: caught by the loop, which writes
    the summary and raises RunFailed."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Store(Protocol):
    """The part of a store the coordinator writes (a TCPStore, or a dict in tests)."""

    def set(self, key: str, value: str) -> None: ...

    def delete_key(self, key: str) -> bool: ...

    def num_keys(self) -> int: ...


class Events(Protocol):
    bytes_written: int

    def write(self, event: str, **fields: Any) -> dict: ...


class Display(Protocol):
    def message(self, text: str) -> None: ...


class HandledAs(enum.StrEnum):
    """How a lost node was covered (the `handled_as` of its `node_lost` event)."""

    PENDING = "pending"
    """Not decided yet: the next generation's plan says how."""
    FAILOVER = "failover"
    PEER_RESTORE = "peer_restore"
    CHECKPOINT_RESTORE = "checkpoint_restore"
    DRAIN = "drain"
    STANDBY = "standby"
    STOPPED = "stopped"
    """The run could not survive it."""
    REROUTE = "reroute"
    """Its stage's micro-batches went to the stage's data-parallel peers (`--redundancy reroute`)."""


@dataclass(slots=True)
class Loss:
    """One lost node, from the moment it is seen until its `node_lost` event is written."""

    node: str
    rank: int | None
    step: int
    phase: str
    handled_as: HandledAs
    shadow: str | None
    t: float
    signal: str
    pause_s: float = 0.0
    """The extra wall time of the step it happened in (of the step redone, for a restore)."""
    counts: dict[str, int] = field(default_factory=dict)
    in_flight: bool = False
    """Handled inside the step (a failover or peer restore by role change), with BRC."""
    written: bool = False
    """Its `node_lost` event is out (each loss is written exactly once)."""
    reconfiguration_s: float = 0.0
    """Its share of the reconfigurations after it until its layout was whole again (a standby
    joining, the layers spread again, a drain's hand-off): the extra wall time of each new
    generation's first step, split among the losses still open when it was planned."""
    active_before: int = 0
    """The active nodes of the generation it was lost from: a later generation with as many
    gives it its layout back (`repaired`)."""
    repaired: bool = False
    """A generation with as many active nodes as before it formed: later reconfigurations
    are none of its cost."""

    @property
    def cost_s(self) -> float:
        """Every second it cost: summary.json's `pause_s` of this loss."""
        return self.pause_s + self.reconfiguration_s


@dataclass(slots=True)
class Reconfiguration:
    """A generation change under way."""

    reason: str
    started: float
    ending: set[int]
    """Node ids of the old generation whose `gen_end` is awaited."""
    holdings: dict[int, set[int]] = field(default_factory=dict)
    abandoned: bool = False
    lost: list[Loss] = field(default_factory=list)
    """Losses the new generation must account for (peer or checkpoint restore)."""
    why: str = ""
    """Why no in-flight copy covered a loss."""
    restarting: set[int] | None = None
    """Checkpoint-restart recovery: the fresh workers the next generation waits for."""


@dataclass(slots=True)
class RunContext:
    """The services and shared state of one run."""

    cfg: JobConfig
    store: Store
    events: Events
    display: Display
    run_path: Path
    param_counts: list[int]
    partition_costs: list[float] = field(default_factory=list)
    """What stages are cut by (`JobConfig.partition_costs`): parameter counts by default."""
    clock: Callable[[], float] = time.monotonic
    t0: float = 0.0
    committed: int = 0
    """Steps committed: the next step to run."""
    losses: list[float] = field(default_factory=list)
    eval_losses: list[list[float]] = field(default_factory=list)
    """[steps done, held-out loss] of every evaluation, in step order."""
    metrics: list[dict[str, float]] = field(default_factory=list)
    """The job's metrics (`--metric`) of each committed step, as `losses` (empty without)."""
    eval_metrics: list[list[Any]] = field(default_factory=list)
    """[steps done, {name: held-out value}] of every evaluation, with `--metric`."""
    plan: GenerationPlan | None = None
    roles: RoleMap | None = None
    reconf: Reconfiguration | None = None
    resume_step: int | None = None
    resume_path: Path | None = None
    layouts: list[dict[str, Any]] = field(default_factory=list)
    """The layouts the committed steps ran, one entry per change: summary.json's `layouts`,
    which `bamboo.chaos.bits` judges the parameter bits by."""
    interface: Interface = Interface.CLI
    """Where the run was started from: its messages say how to go on in its words."""
    stepwise: bool = False
    """The user's loop drives the run (`bamboo.Trainer`): nodes wait for orders between
    steps (`orders.Orders`)."""
    lr_scales: list[list[float]] = field(default_factory=list)
    """`[from step, scale]` of every change of the learning-rate scale (a step-by-step run's
    `set_lr_scale`; 1.0 before the first): summary.json's `lr_scales`, and a checkpoint's,
    from which a resume goes on with the scale it had."""
    end_step: int = 0
    """The step the run ends at: `--steps`, or the boundary a step-by-step run finished at."""
    skipped_steps: list[int] = field(default_factory=list)
    """`--precision fp16`: the committed steps whose gradients overflowed (no optimizer step
    was applied; bamboo.plan.loss_scale)."""
    start_loss_scale: list[float] | None = None
    """`--precision fp16`: the loss scaler's state where the run started (a resumed run's
    checkpoint's); None: the initial one."""

    @property
    def rc(self) -> bool:
        """Whether the current generation keeps replicas (its plan's mode; before the first
        plan, whether the job's mode may: `auto` may)."""
        if self.plan is not None:
            return self.plan.redundancy.keeps_replica
        mode = self.cfg.redundancy.kind
        return mode.keeps_replica or mode.chosen_per_generation

    def loss_scale_at(self, step: int) -> LossScale:
        """The fp16 loss scaler's state at the boundary before `step`."""
        return scale_at(step, self.skipped_steps, LossScale.from_json(self.start_loss_scale),
                        self.resume_step or 0)

    def say(self, text: str) -> None:
        self.display.message(text)
