"""``--redundancy auto``: pick eager, lazy or off from the observed preemption rate and measured costs.

One decision function, two users: the training coordinator calls :func:`choose_mode` at
every generation (each reconfiguration) to set the redundancy mode of the next one, and
the simulator's ``adaptive`` policy (:class:`bamboo.sim.policies.AdaptivePolicy`) scores
every (pipelines, mode) layout with the very same :func:`mode_terms` / :func:`value` /
:func:`best_terms`. The formula lives here and only here. Pure Python, no torch.

The model. With ``lam`` preemptions per node-second and ``r = lam * D * P`` failures per
second among the D x P working nodes, a mode that runs a failure-free step in ``tau``
seconds is expected to deliver ::

    expected = samples_per_step / tau / (1 + r * per_failure)

samples per second, where ``per_failure`` is the wall time one loss costs:

* ``off`` (and any mode at D == P == 1): every loss is fatal, ``fatal = restart_s + tau /
  2 + rollback_s`` (global restart, half a step in flight thrown away, and the expected
  redo when the restore has to roll back to a durable checkpoint).
* any other mode at one stage (P == 1, D >= 2): no replica (it would be on the lost node
  itself), so every mode runs off's step; a loss is re-routed in flight to the D - 1
  peers, who keep the micro-batches they finished and take the lost slot's share (``tau /
  (D - 1)``), and the generation ends at that step's boundary (``reconfiguration_s``); it
  is fatal only if every peer goes too before then.
* ``eager`` / ``lazy``: ``base + q * fatal + lazy`` with ``base = failover_pause_s +
  tau * (shadow_slowdown - 1) + reconfiguration_s`` (failover, one slowed step while the
  shadow carries two stages, the reconfiguration that follows), ``q = 1 - exp(-2 * lam *
  (reconfiguration_s + tau))`` the chance that one of the two neighbours of the lost
  stage goes too before the reconfiguration restores redundancy (then the loss is fatal
  after all), and ``lazy = tau / 2`` for lazy only (the forwards of the lost stage are
  recomputed; eager FRC already ran them). That lazy term is all eager can save, so eager
  only wins when its extra step time is below ``r * tau_eager * tau_lazy / 2`` per step.

The rate is the posterior mean of a Gamma prior (:data:`PRIOR_RATE` per node-second,
worth :data:`PRIOR_WEIGHT` node-seconds of observation) updated with the removals
seen over the node-seconds of exposure: :func:`posterior_rate`, or :class:`RateEstimator`
to accumulate them. The prior is pessimistic (10% per node-hour), so a run starts
protected and drops redundancy only once the cluster has proven quiet.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

__all__ = [
    "MODES",
    "ALL_MODES",
    "PRIOR_RATE",
    "PRIOR_WEIGHT",
    "DEFAULT_OVERHEAD",
    "ModeCosts",
    "ModeTerms",
    "Choice",
    "RateEstimator",
    "posterior_rate",
    "mode_terms",
    "value",
    "best_terms",
    "expected_samples_per_s",
    "choose_mode",
    "NodeWork",
    "redundant_work_floor",
]

MODES: tuple[str, ...] = ("eager", "lazy", "off")
"""The modes chosen among by default (and the simulator's `adaptive` policy), in tie-break order:
on an exact tie the earlier (more protected) mode wins."""

ALL_MODES: tuple[str, ...] = ("eager", "lazy", "reroute", "off")
"""Every mode :func:`choose_mode` can weigh, in tie-break order. ``reroute`` (D >= 2): no
replica; a loss restarts the step under way (half a step of work, expected; not at one
stage, where the peers keep their finished work) and the lost slot's micro-batches go to the
stage's D - 1 peers, each carrying 1/(D - 1) of a slot more (the shadow's extra load spread:
``1 + (shadow_slowdown - 1) / (D - 1)``); the loss is fatal only if every peer of the stage
goes too before the reconfiguration. Once a re-route's pause is measured (the loss step's
excess over a clean step), it replaces the restart and slowed-step terms, which it already
holds."""

PRIOR_RATE = 0.10 / 3600.0
"""Prior preemption rate per node-second (10% per node-hour: pessimistic, so a run starts protected)."""

PRIOR_WEIGHT = 12 * 3600.0
"""Node-seconds of observation the prior counts for (12 node-hours)."""

DEFAULT_OVERHEAD: Mapping[str, float] = MappingProxyType({"eager": 0.10, "lazy": 0.03, "reroute": 0.0,
                                                          "off": 0.0})
"""Fraction of a no-redundancy step each mode adds (the simulator presets' ``rc_overhead`` and
``lazy_overhead``); only used to estimate the step time of a mode not measured yet."""


class NodeWork(NamedTuple):
    """One node's timers in a step run without replicas (``off`` or ``reroute``)."""

    stages: tuple[int, ...]
    compute_s: float
    """Forward and backward of its stage."""
    wait_s: float
    optim_s: float
    """Its stage's optimizer step."""
    own_processor: bool
    """Whether its waits are idle time (see ``bamboo.protocol.messages.Ready``)."""


def redundant_work_floor(nodes: Sequence[NodeWork], stages: int,
                         backward_ratio: float = 2.0) -> dict[str, float]:
    """The least time ``eager`` and ``lazy`` would add to this step, from its measured work.

    Both keep a replica of the successor stage (s + 1) mod P on each node and step its
    optimizer: lazy adds that stage's optimizer time, eager adds it plus one forward of
    that stage per micro-batch (its compute over ``1 + backward_ratio``). A node can hide
    the added work in its waits only when it has a processor of its own; otherwise a wait
    is another node running, and the work adds to its time. The floor is the most any one
    node adds (the step is at least as long as its busiest node). ``{}`` when no node
    holds exactly one stage, or P == 1 (no replica)."""
    single = [n for n in nodes if len(n.stages) == 1]
    if stages < 2 or not single:
        return {}
    by_stage: dict[int, list[NodeWork]] = {}
    for n in single:
        by_stage.setdefault(n.stages[0], []).append(n)
    compute = {s: statistics.median(n.compute_s for n in ns) for s, ns in by_stage.items()}
    optim = {s: statistics.median(n.optim_s for n in ns) for s, ns in by_stage.items()}
    floor = {"eager": 0.0, "lazy": 0.0}
    for n in single:
        succ = (n.stages[0] + 1) % stages
        if succ not in compute:
            continue
        idle = n.wait_s if n.own_processor else 0.0
        replica = optim[succ]
        forwards = compute[succ] / (1.0 + backward_ratio)
        floor["lazy"] = max(floor["lazy"], replica - idle)
        floor["eager"] = max(floor["eager"], replica + forwards - idle)
    return floor


def posterior_rate(removals: float, exposure_node_s: float, prior_rate: float = PRIOR_RATE,
                   prior_weight: float = PRIOR_WEIGHT) -> float:
    """Posterior mean preemptions per node-second: ``(prior_rate * prior_weight + removals) /
    (prior_weight + exposure_node_s)``. Equals ``prior_rate`` with no exposure and tends to
    ``removals / exposure_node_s`` as the exposure grows."""
    return (prior_rate * prior_weight + removals) / (prior_weight + exposure_node_s)


class RateEstimator:
    """Accumulates what :func:`posterior_rate` needs over a run.

    Count as exposure the node-seconds of every node the job holds (working or spare), and
    as removals every node lost to the platform (preempted, killed, lease expired); not a
    worker stopped by a software error or by the job itself. That is what the simulator counts.
    """

    __slots__ = ("prior_rate", "prior_weight", "removals", "exposure_node_s")

    def __init__(self, prior_rate: float = PRIOR_RATE, prior_weight: float = PRIOR_WEIGHT) -> None:
        if not (math.isfinite(prior_rate) and prior_rate >= 0 and math.isfinite(prior_weight) and prior_weight > 0):
            raise ValueError("prior_rate must be finite >= 0 and prior_weight finite > 0")
        self.prior_rate = prior_rate
        self.prior_weight = prior_weight
        self.removals = 0
        self.exposure_node_s = 0.0

    def observe(self, node_seconds: float = 0.0, removals: int = 0) -> None:
        """Add ``node_seconds`` of exposure (nodes held x seconds) and ``removals`` lost nodes."""
        if node_seconds < 0 or removals < 0 or not math.isfinite(node_seconds):
            raise ValueError("exposure and removals must be finite and >= 0")
        self.exposure_node_s += node_seconds
        self.removals += removals

    @property
    def rate_per_node_s(self) -> float:
        """Posterior mean preemptions per node-second."""
        return posterior_rate(self.removals, self.exposure_node_s, self.prior_rate, self.prior_weight)

    @property
    def rate_per_node_hour(self) -> float:
        return self.rate_per_node_s * 3600.0


def _frozen_map(m: Mapping[str, float], what: str) -> Mapping[str, float]:
    out: dict[str, float] = {}
    for k, v in dict(m).items():
        if k not in ALL_MODES:
            raise ValueError(f"{what}: unknown mode {k!r} (modes: {', '.join(ALL_MODES)})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{what}[{k!r}] must be a finite number, got {v!r}")
        out[k] = float(v)
    return MappingProxyType(out)


@dataclass(frozen=True, kw_only=True)
class ModeCosts:
    """What one generation costs, as measured in the run (or given by a simulator preset).

    ``step_s`` holds the seconds of a failure-free global step in each mode measured so
    far; it may lack modes (but not all three). A missing mode's step time is estimated
    from a measured one by the ``overhead`` factors: ``step(m) = step(ref) * (1 +
    overhead[m]) / (1 + overhead[ref])``, ``ref`` the first measured mode of ``off``,
    ``lazy``, ``eager`` (see :meth:`step_time`).
    """

    samples_per_step: float
    """Samples in one global step."""
    stages: int
    """P: pipeline stages."""
    pipelines: int
    """D: data-parallel pipelines of the generation being chosen for."""
    step_s: Mapping[str, float]
    """Mode -> seconds of one failure-free step in that mode (measured modes only)."""
    overhead: Mapping[str, float] = field(default_factory=lambda: DEFAULT_OVERHEAD)
    """Mode -> fraction of a no-redundancy step the mode adds, used only to estimate unmeasured
    step times; modes left out take :data:`DEFAULT_OVERHEAD`'s (eager 0.10, lazy 0.03, off 0)."""
    failover_pause_s: float = 0.0
    """Extra wall time of one failover (detection, new role map, merging the schedules)."""
    failover_pause_by_mode: Mapping[str, float] = field(default_factory=dict)
    """Mode -> the failover pause measured in that mode, where one was; it replaces
    ``failover_pause_s`` for that mode, and lazy's recomputation term with it (a lazy
    failover's measured pause already holds its forwards)."""
    reconfiguration_s: float = 0.0
    """Wall time of one reconfiguration among live nodes (the next generation's set-up)."""
    restart_s: float = 0.0
    """Wall time of a global restart after a fatal loss (rendezvous + restoring state)."""
    shadow_slowdown: float = 1.5
    """Step-time factor while a shadow carries two stages (> 0; normally >= 1)."""
    rollback_s: float = 0.0
    """Expected seconds of training redone after a fatal loss: about half the durable
    checkpoint interval when no peer pipeline holds a copy of the lost stage (D == 1), 0
    when a peer restore loses nothing."""

    def __post_init__(self) -> None:
        step = _frozen_map(self.step_s, "step_s")
        if not step:
            raise ValueError("step_s: at least one mode's step time must be known")
        if any(v <= 0 for v in step.values()):
            raise ValueError("step_s: step times must be > 0")
        over = _frozen_map({**DEFAULT_OVERHEAD, **dict(self.overhead)}, "overhead")
        if any(v <= -1.0 for v in over.values()):
            raise ValueError("overhead: each factor must be > -1")
        object.__setattr__(self, "step_s", step)
        object.__setattr__(self, "overhead", over)
        pauses = _frozen_map(self.failover_pause_by_mode, "failover_pause_by_mode")
        if any(v < 0 for v in pauses.values()):
            raise ValueError("failover_pause_by_mode: pauses must be >= 0")
        object.__setattr__(self, "failover_pause_by_mode", pauses)
        if isinstance(self.stages, bool) or int(self.stages) != self.stages or self.stages < 1:
            raise ValueError(f"stages must be an integer >= 1, got {self.stages!r}")
        if isinstance(self.pipelines, bool) or int(self.pipelines) != self.pipelines or self.pipelines < 1:
            raise ValueError(f"pipelines must be an integer >= 1, got {self.pipelines!r}")
        object.__setattr__(self, "stages", int(self.stages))
        object.__setattr__(self, "pipelines", int(self.pipelines))
        for name in ("samples_per_step", "shadow_slowdown"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be finite and > 0, got {v!r}")
        for name in ("failover_pause_s", "reconfiguration_s", "restart_s", "rollback_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {v!r}")

    def measured(self, mode: str) -> bool:
        """Whether ``mode``'s step time was given (not estimated)."""
        return mode in self.step_s

    def step_time(self, mode: str) -> float:
        """Seconds of a failure-free step in ``mode``: measured, else estimated from a measured mode."""
        if mode not in ALL_MODES:
            raise ValueError(f"unknown mode {mode!r} (modes: {', '.join(ALL_MODES)})")
        step = self.step_s
        if mode in step:
            return step[mode]
        ref = next(m for m in ("off", "reroute", "lazy", "eager") if m in step)
        if self.stages == 1:
            return step[ref]  # one stage: no replica, no FRC; every mode runs off's step
        over = self.overhead
        return step[ref] * (1.0 + over[mode]) / (1.0 + over[ref])


class ModeTerms(NamedTuple):
    """The rate-independent constants of one mode's expected throughput (see :func:`value`)."""

    mode: str
    samples_per_s: float
    """Failure-free samples per second: samples_per_step / tau."""
    pipelines: int
    stages: int
    exposure_s: float
    """Window after a failover (or a re-route) in which losing a neighbour (every peer) is
    fatal: reconfiguration_s + tau."""
    fatal_s: float
    """Cost of a fatal loss: restart_s + tau / 2 + rollback_s."""
    base_s: float
    """Cost of a covered loss: failover_pause_s + tau * (shadow_slowdown - 1) + reconfiguration_s
    for a shadow; for a re-route see :data:`ALL_MODES` and, at one stage, the module docstring."""
    lazy_s: float
    """Lazy recomputation of the lost stage's forwards: tau / 2 (0 unless lazy)."""
    protected: bool
    """False when every loss is fatal (mode off; or shadows at P == 1 and D == 1; reroute: D == 1)."""
    risk_nodes: float = 2.0
    """Nodes whose loss within ``exposure_s`` makes a covered loss fatal after all: the two
    neighbours of a shadowed stage; for reroute, each of the stage's D - 1 peers."""
    risk_power: int = 1
    """How many of them must go: 1 for a shadow, every peer (D - 1) for reroute."""


def mode_terms(mode: str, costs: ModeCosts) -> ModeTerms:
    """Precompute ``mode``'s terms from ``costs`` (do it once; :func:`value` is then cheap)."""
    tau = costs.step_time(mode)
    recon = costs.reconfiguration_s
    measured_pause = costs.failover_pause_by_mode.get(mode)
    pause = costs.failover_pause_s if measured_pause is None else measured_pause
    if costs.stages == 1 and mode != "off":
        if measured_pause is None:  # at one stage every mode but off re-routes alike
            measured_pause = next((v for m, v in costs.failover_pause_by_mode.items()
                                   if m != "off"), None)
            pause = costs.failover_pause_s if measured_pause is None else measured_pause
        return _one_stage_terms(mode, costs, tau, pause, measured_pause is not None)
    if mode == "reroute":
        peers = costs.pipelines - 1
        slowdown = 1.0 + (costs.shadow_slowdown - 1.0) / max(peers, 1)
        # a measured pause is the loss step's excess: it holds the restarted attempt and
        # its re-routed (slower) run already
        covered = pause + recon if measured_pause is not None else \
            pause + tau / 2 + tau * (slowdown - 1.0) + recon
        return ModeTerms(mode, costs.samples_per_step / tau, costs.pipelines, costs.stages,
                         recon + tau, costs.restart_s + tau / 2 + costs.rollback_s,
                         covered, 0.0, peers >= 1, 1.0, max(peers, 1))
    return ModeTerms(
        mode,
        costs.samples_per_step / tau,
        costs.pipelines,
        costs.stages,
        recon + tau,
        costs.restart_s + tau / 2 + costs.rollback_s,
        pause + tau * (costs.shadow_slowdown - 1.0) + recon,
        tau / 2 if mode == "lazy" and measured_pause is None else 0.0,
        mode != "off" and costs.stages > 1,
    )


def _one_stage_terms(mode: str, costs: ModeCosts, tau: float, pause: float,
                     measured: bool) -> ModeTerms:
    """A loss at one stage: re-routed in flight to the D - 1 peers, who keep their finished
    micro-batches and take the lost slot's share (a measured pause, the loss step's excess,
    holds that share already), then the generation's end at the boundary."""
    peers = costs.pipelines - 1
    share = 0.0 if measured else tau / max(peers, 1)
    recon = costs.reconfiguration_s
    return ModeTerms(mode, costs.samples_per_step / tau, costs.pipelines, 1, recon + tau,
                     costs.restart_s + tau / 2 + costs.rollback_s, pause + share + recon, 0.0,
                     peers >= 1, 1.0, max(peers, 1))


def value(terms: ModeTerms, rate_per_node_s: float) -> float:
    """Expected samples per second of ``terms`` at ``rate_per_node_s`` preemptions per node-second."""
    _, sps_tau, D, P, exposure_s, fatal_s, base_s, lazy_s, protected, risk_nodes, power = terms
    lam = rate_per_node_s
    if protected:
        fatal_after_all = (1.0 - math.exp(-risk_nodes * lam * exposure_s)) ** power
        per_failure = base_s + fatal_after_all * fatal_s + lazy_s
    else:
        per_failure = fatal_s
    return sps_tau / (1.0 + lam * D * P * per_failure)


def best_terms(rows: Iterable[ModeTerms], rate_per_node_s: float) -> tuple[ModeTerms | None, float]:
    """The row of highest :func:`value` and that value; on an exact tie the first row wins.
    ``(None, -1.0)`` when ``rows`` is empty."""
    best: ModeTerms | None = None
    best_v = -1.0
    for row in rows:
        v = value(row, rate_per_node_s)
        if v > best_v:
            best, best_v = row, v
    return best, best_v


def expected_samples_per_s(mode: str, costs: ModeCosts, rate_per_node_s: float) -> float:
    """Expected samples per second of one generation in ``mode`` (see the module docstring)."""
    return value(mode_terms(mode, costs), rate_per_node_s)


@dataclass(frozen=True, kw_only=True)
class Choice:
    """What :func:`choose_mode` decided, and why."""

    mode: str
    """The chosen mode: the argmax of ``expected`` (exact ties: the earliest in :data:`MODES`)."""
    expected: Mapping[str, float]
    """Mode -> expected samples per second, for each mode considered."""
    rate_per_node_s: float
    """The preemption rate the decision used, per node-second."""
    step_s: Mapping[str, float]
    """Mode -> the step time used (measured or estimated)."""
    estimated: tuple[str, ...]
    """Modes considered whose step time was estimated, not measured."""

    @property
    def rate_per_node_hour(self) -> float:
        return self.rate_per_node_s * 3600.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record of the decision (e.g. for events.jsonl)."""
        return {
            "mode": self.mode,
            "expected_samples_per_s": dict(self.expected),
            "rate_per_node_hour": self.rate_per_node_hour,
            "step_s": dict(self.step_s),
            "estimated": list(self.estimated),
        }


def choose_mode(costs: ModeCosts, rate_per_node_s: float, modes: Sequence[str] = MODES) -> Choice:
    """The mode among ``modes`` with the highest expected samples per second.

    ``rate_per_node_s``: preemptions per node-second, normally :func:`posterior_rate` of the
    run so far. Exact ties go to the mode that comes first in :data:`MODES` (eager, lazy,
    off), whatever the order of ``modes``.
    """
    if not (math.isfinite(rate_per_node_s) and rate_per_node_s >= 0):
        raise ValueError(f"rate_per_node_s must be finite and >= 0, got {rate_per_node_s!r}")
    wanted = set(modes)
    unknown = wanted - set(ALL_MODES)
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(sorted(unknown))} (modes: {', '.join(ALL_MODES)})")
    if not wanted:
        raise ValueError("modes: at least one mode is needed")
    rows = [mode_terms(m, costs) for m in ALL_MODES if m in wanted]
    best, _ = best_terms(rows, rate_per_node_s)
    assert best is not None
    return Choice(
        mode=best.mode,
        expected=MappingProxyType({row.mode: value(row, rate_per_node_s) for row in rows}),
        rate_per_node_s=rate_per_node_s,
        step_s=MappingProxyType({row.mode: costs.step_time(row.mode) for row in rows}),
        estimated=tuple(row.mode for row in rows if not costs.measured(row.mode)),
    )
