"""Discrete-event core: replays a trace against a policy, accounting steps analytically.

There is no event per training step. Events are membership changes from the
trace, instance-ready times (allocation delay after an add), and a policy's own
timers (rendezvous done, a step boundary where it wants to decide something,
checkpoint start/end). Between two events the layout and step time are constant,
so completed steps follow from elapsed time; the in-flight step is carried as a
progress fraction. Three sorted sources are merged: the trace (pre-sorted), the
ready queue (FIFO: the allocation delay is constant) and a small timer heap.

Wall time is split into categories that always sum to the trace duration:
useful (steps at the no-redundancy step time), redundant (RC overhead, shadow
slowdown, failover pauses), checkpoint (writing checkpoints), restart (global
rendezvous, restart from a checkpoint), rebalance (reconfiguration among live
nodes), lost (computed but discarded: rolled-back steps, interrupted steps) and
idle (too few nodes to train, or waiting for instances to boot).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from heapq import heappop, heappush
from random import Random

from .presets import ModelPreset
from .traces import ADD, Trace

__all__ = [
    "SimConfig",
    "RunResult",
    "Policy",
    "ClusterPolicy",
    "CATEGORIES",
    "RUN",
    "CKPT",
    "RESTART",
    "REBALANCE",
    "IDLE",
]

RUN, CKPT, RESTART, REBALANCE, IDLE = 0, 1, 2, 3, 4
CATEGORIES = ("useful", "redundant", "checkpoint", "restart", "rebalance", "lost", "idle")
_EPS = 1e-9


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """Knobs shared by every policy; every default is stated in docs/simulator.md."""

    spot_price: float = 0.91
    """Dollars per spot instance-hour (p3.2xlarge)."""
    on_demand_price: float = 3.06
    """Dollars per on-demand instance-hour (p3.2xlarge)."""
    alloc_delay_s: float = 45.0
    """Seconds from an instance's allocation (trace 'add') until it can join."""
    checkpoint_every_s: float = 600.0
    """checkpoint policy: seconds of training between two checkpoints."""
    ckpt_save_s: float | None = None
    """Seconds to write a checkpoint (None: the model preset's)."""
    restart_s: float | None = None
    """checkpoint policy: seconds to restart from a checkpoint (None: the preset's)."""
    fallback_every_s: float = 1800.0
    """bamboo/adaptive: seconds between durable fallback checkpoints (0: never)."""
    fatal_rollback: bool = True
    """bamboo: a fatal failure that leaves no live copy of a stage rolls back to the last
    durable checkpoint (False: the authors' simulator, which restarts without losing steps)."""
    placement: str = "ordered"
    """How nodes are placed on (pipeline, stage): 'ordered' (join order) or 'random' (seeded)."""
    on_demand: str = "matched"
    """on-demand cluster: 'matched' (layout of the spot job's mean size, no RC), 'ref'
    (the authors' reference cluster) or a node count."""


@dataclass(slots=True)
class RunResult:
    """What one policy achieved on one trace."""

    policy: str
    duration_s: float
    steps: int
    samples: int
    cost: float
    preemptions: int
    fatal_failures: int
    reconfigurations: int
    breakdown: dict[str, float]
    extra: dict[str, float] = field(default_factory=dict)
    timeline: list[tuple[float, int, int, float]] | None = None
    """(t, billed instances, samples committed, dollars so far), when recorded."""

    @property
    def throughput(self) -> float:
        return self.samples / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def cost_per_hour(self) -> float:
        return self.cost * 3600.0 / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def value(self) -> float:
        """Samples per dollar (= 3600 x throughput / cost_per_hour)."""
        return self.samples / self.cost if self.cost > 0 else 0.0


class Policy:
    """One way of running the job on the trace; subclasses implement :meth:`run`."""

    name = "policy"

    def __init__(self, preset: ModelPreset, config: SimConfig, seed: int = 0) -> None:
        self.preset = preset
        self.cfg = config
        self.rng = Random(seed)

    def run(self, trace: Trace, record: bool = False) -> RunResult:  # pragma: no cover
        raise NotImplementedError


class ClusterPolicy(Policy):
    """Shared event loop and accounting for policies that run on the trace's spot nodes."""

    def _reset(self) -> None:
        self.t = 0.0
        self.epoch = 0
        self.seq = 0
        self.heap: list[tuple[float, int, int, int, object]] = []
        self.billed: set[int] = set()
        self.ready: dict[int, None] = {}
        self.mode = IDLE
        self.acc = [0.0] * 5  # time per non-running mode (index RUN unused)
        self.lost = 0.0
        self.useful = 0.0
        self.redundant = 0.0
        self.steps = 0
        self.ck_steps = 0
        self.ck_useful = 0.0
        self.ck_redundant = 0.0
        self.tau = 1.0
        self.tau_useful = 1.0
        self.frac = 0.0
        self.ptime = 0.0
        self.cost = 0.0
        self.price_s = self.cfg.spot_price / 3600.0
        self.preemptions = 0
        self.fatal_failures = 0
        self.reconfigurations = 0
        self.counters: dict[str, float] = {}

    # -- hooks for subclasses
    def accept(self, node: int) -> bool:
        """Whether to take an instance the trace offers (and pay for it)."""
        return True

    def on_ready(self, t: float, node: int) -> None:
        raise NotImplementedError

    def on_lost(self, t: float, node: int) -> None:
        raise NotImplementedError

    def on_timer(self, t: float, kind: int, payload: object) -> None:
        raise NotImplementedError

    # -- event loop
    def run(self, trace: Trace, record: bool = False) -> RunResult:
        self._reset()
        times, kinds, nodes = trace.times, trace.kinds, trace.nodes
        horizon = trace.duration
        delay = self.cfg.alloc_delay_s
        ready_q: deque[tuple[float, int]] = deque()
        heap = self.heap
        billed = self.billed
        inf = math.inf
        i, n = 0, len(times)
        timeline: list[tuple[float, int, int, float]] | None = [] if record else None
        while True:
            t_tr = times[i] if i < n else inf
            t_rd = ready_q[0][0] if ready_q else inf
            t_hp = heap[0][0] if heap else inf
            if t_hp <= t_tr and t_hp <= t_rd:
                if t_hp > horizon:
                    break
                t, _, kind, epoch, payload = heappop(heap)
                if epoch != self.epoch:
                    continue
                self.advance(t)
                self.on_timer(t, kind, payload)
            elif t_rd <= t_tr:
                if t_rd > horizon:
                    break
                t, node = ready_q.popleft()
                if node not in billed:
                    continue
                self.advance(t)
                self.ready[node] = None
                self.on_ready(t, node)
            else:
                if t_tr > horizon:
                    break
                t = t_tr
                node = nodes[i]
                kind = kinds[i]
                i += 1
                self.advance(t)
                if kind == ADD:
                    if self.accept(node):
                        billed.add(node)
                        ready_q.append((t + delay, node))
                elif node in billed:
                    billed.discard(node)
                    self.preemptions += 1
                    self.ready.pop(node, None)
                    self.on_lost(t, node)
            if timeline is not None:
                timeline.append((t, len(billed), self.steps * self.preset.samples_per_step, self.cost))
        self.advance(horizon)
        if timeline is not None:
            timeline.append((horizon, len(billed), self.steps * self.preset.samples_per_step, self.cost))
        return self._result(horizon, timeline)

    def _result(self, horizon: float, timeline: list | None) -> RunResult:
        lost = self.lost + self.ptime  # the step in flight at the end never completed
        acc = self.acc
        breakdown = {
            "useful": self.useful,
            "redundant": self.redundant,
            "checkpoint": acc[CKPT],
            "restart": acc[RESTART],
            "rebalance": acc[REBALANCE],
            "lost": lost,
            "idle": acc[IDLE],
        }
        return RunResult(
            policy=self.name,
            duration_s=horizon,
            steps=self.steps,
            samples=self.steps * self.preset.samples_per_step,
            cost=self.cost,
            preemptions=self.preemptions,
            fatal_failures=self.fatal_failures,
            reconfigurations=self.reconfigurations,
            breakdown=breakdown,
            extra=dict(self.counters),
            timeline=timeline,
        )

    # -- time accounting
    def advance(self, t: float) -> None:
        dt = t - self.t
        if dt <= 0.0:
            return
        self.cost += len(self.billed) * self.price_s * dt
        if self.mode == RUN:
            self._run_for(dt)
        else:
            self.acc[self.mode] += dt
        self.t = t

    def _run_for(self, dt: float) -> None:
        tau = self.tau
        rem = (1.0 - self.frac) * tau
        if dt < rem - _EPS:
            self.frac += dt / tau
            self.ptime += dt
            return
        self._commit(1, self.ptime + rem)
        dt -= rem
        k = int((dt + _EPS) / tau)
        if k:
            self._commit(k, k * tau)
            dt -= k * tau
        if dt < 0.0:
            dt = 0.0
        self.frac = dt / tau
        self.ptime = dt

    def _commit(self, k: int, seconds: float) -> None:
        u = k * self.tau_useful
        if u > seconds:
            u = seconds
        self.steps += k
        self.useful += u
        self.redundant += seconds - u
        self.ck_steps += k
        self.ck_useful += u
        self.ck_redundant += seconds - u

    def set_tau(self, tau: float, tau_useful: float | None = None) -> None:
        """Change the step time; the in-flight step keeps its progress fraction."""
        self.tau = tau
        if tau_useful is not None:
            self.tau_useful = tau_useful

    def start_running(self, tau: float, tau_useful: float) -> None:
        self.mode = RUN
        self.tau = tau
        self.tau_useful = tau_useful
        self.frac = 0.0
        self.ptime = 0.0

    def stall(self, seconds: float) -> None:
        """The in-flight step takes ``seconds`` longer (counted as redundant work)."""
        self.frac -= seconds / self.tau

    def next_boundary(self, t: float) -> float:
        return t + (1.0 - self.frac) * self.tau

    def drop_partial(self) -> None:
        """The in-flight step is abandoned."""
        self.lost += self.ptime
        self.frac = 0.0
        self.ptime = 0.0

    def durable(self) -> None:
        """Every step done so far is in a durable checkpoint."""
        self.ck_steps = 0
        self.ck_useful = 0.0
        self.ck_redundant = 0.0

    def rollback(self) -> None:
        """Return to the last durable checkpoint: later steps are lost."""
        self.steps -= self.ck_steps
        self.useful -= self.ck_useful
        self.redundant -= self.ck_redundant
        self.lost += self.ck_useful + self.ck_redundant
        self.counters["rolled_back_steps"] = self.counters.get("rolled_back_steps", 0) + self.ck_steps
        self.durable()

    def push(self, t: float, kind: int, payload: object = None) -> None:
        self.seq += 1
        heappush(self.heap, (t, self.seq, kind, self.epoch, payload))

    def bump(self, key: str, by: float = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + by
