"""Discrete-event core: replays a trace against a policy, accounting steps analytically.

There is no event per training step. Events are membership changes from the
trace, instance-ready times (allocation delay after an add), and a policy's own
timers (rendezvous done, a step boundary where it wants to decide something,
checkpoint start/end). Between two events the layout and step time are constant,
so completed steps follow from elapsed time; the in-flight step is carried as a
progress fraction. Two sorted sources are merged: the trace rows with their
instance-ready events (merged once per trace and allocation delay by
:meth:`Trace.events`, shared by every policy) and a small timer heap.

Wall time is split into categories that always sum to the trace duration:
useful (steps at the no-redundancy step time), redundant (RC overhead, shadow
slowdown, failover pauses), checkpoint (writing checkpoints), restart (global
rendezvous, restart from a checkpoint), rebalance (reconfiguration among live
nodes), lost (computed but discarded: rolled-back steps, interrupted steps) and
idle (too few nodes to train, or waiting for instances to boot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from heapq import heappop, heappush
from random import Random

from bamboo.traces.trace import ADD, READY, Trace

from .cost_presets import SimModel

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
    checkpoint_every_steps: int = 0
    """torchrun policy: steps between two checkpoints (0: checkpoint_every_s in whole steps)."""
    torchrun_min_nodes: int = 0
    """torchrun policy: workers it needs to (re)start (its --nnodes minimum; 0: one pipeline)."""
    shared_cores: int = 0
    """0: a processor (GPU) per worker, as in a cluster. C > 0: the workers share C processors
    (a local run), so a torchft step with fewer groups is faster (their work on C cores)."""
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

    def __init__(self, preset: SimModel, config: SimConfig, seed: int = 0) -> None:
        self.preset = preset
        self.cfg = config
        self.rng = Random(seed)
        self.plain_s = {d: preset.plain_step_time(d) for d in preset.step_s}
        """Seconds per step without redundancy, by number of pipelines."""
        self.max_d = preset.max_pipelines

    def run(self, trace: Trace, record: bool = False) -> RunResult:  # pragma: no cover
        raise NotImplementedError


class ClusterPolicy(Policy):
    """Shared event loop and accounting for policies that run on the trace's spot nodes."""

    def _reset(self) -> None:
        self.t = 0.0
        self.epoch = 0
        self.seq = 0
        self.heap: list[tuple[float, int, int, int, object]] = []
        self.billed: dict[int, int] = {}
        """Instances paid for now: node -> index of its add row."""
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
        self.observe = False
        self.events = 0
        self.first_run_t: float | None = None
        """When training first ran (start-up before it is not a step's time)."""

    # -- checkpoint costs: the config's figure, else the model's
    def ckpt_save_s(self) -> float:
        """Seconds to write one checkpoint."""
        return self.cfg.ckpt_save_s if self.cfg.ckpt_save_s is not None else self.preset.ckpt_save_s

    def ckpt_restart_s(self) -> float:
        """Seconds to restart every worker from a checkpoint."""
        return self.cfg.restart_s if self.cfg.restart_s is not None else self.preset.ckpt_restart_s

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
        ev_t, ev_k, ev_n, ev_s = trace.events(self.cfg.alloc_delay_s)
        horizon = trace.duration
        heap = self.heap
        billed = self.billed
        ready = self.ready
        advance, accept = self.advance, self.accept
        on_timer, on_ready, on_lost = self.on_timer, self.on_ready, self.on_lost
        inf = math.inf
        i, n = 0, len(ev_t)
        t_ev = ev_t[0] if n else inf
        timeline: list[tuple[float, int, int, float]] | None = [] if record else None
        sps = self.preset.samples_per_step
        stale = 0
        while True:
            if heap and heap[0][0] <= t_ev:
                if heap[0][0] > horizon:
                    break
                t, _, kind, epoch, payload = heappop(heap)
                if epoch != self.epoch:
                    stale += 1
                    continue
                advance(t)
                on_timer(t, kind, payload)
            else:
                t = t_ev
                if t > horizon:  # also the end of the rows (inf)
                    break
                kind = ev_k[i]
                node = ev_n[i]
                serial = ev_s[i]
                i += 1
                t_ev = ev_t[i] if i < n else inf
                if kind == READY:
                    if billed.get(node) != serial:
                        continue  # lost (or never taken) before it was ready
                    advance(t)
                    ready[node] = None
                    on_ready(t, node)
                elif kind == ADD:
                    advance(t)
                    if node not in billed and accept(node):  # a duplicate add of a live node is ignored
                        billed[node] = serial
                else:
                    advance(t)
                    if node in billed:
                        del billed[node]
                        self.preemptions += 1
                        ready.pop(node, None)
                        on_lost(t, node)
            if timeline is not None:
                timeline.append((t, len(billed), self.steps * sps, self.cost))
        advance(horizon)
        # events handled: rows and READYs reached, timers fired (stale ones not counted)
        self.events = i + self.seq - len(heap) - stale
        if timeline is not None:
            timeline.append((horizon, len(billed), self.steps * sps, self.cost))
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
        """Account the time up to ``t`` (the hot path: steps are counted, not simulated)."""
        dt = t - self.t
        if dt <= 0.0:
            return
        nb = len(self.billed)
        self.cost += nb * self.price_s * dt
        self.t = t
        if self.observe:  # adaptive: node-seconds exposed, seconds run per redundancy mode
            self.exposure += nb * dt
            if self.mode == RUN:
                self.mode_seconds[self.rc_mode] += dt
        if self.mode != RUN:
            self.acc[self.mode] += dt
            return
        tau = self.tau
        rem = (1.0 - self.frac) * tau
        if dt < rem - _EPS:
            self.frac += dt / tau
            self.ptime += dt
            return
        # the step in flight completes
        seconds = self.ptime + rem
        u = self.tau_useful
        if u > seconds:
            u = seconds
        r = seconds - u
        steps, useful, redundant = self.steps + 1, self.useful + u, self.redundant + r
        ck_steps, ck_useful, ck_redundant = self.ck_steps + 1, self.ck_useful + u, self.ck_redundant + r
        dt -= rem
        k = int((dt + _EPS) / tau)
        if k:  # and k more whole steps
            seconds = k * tau
            u = k * self.tau_useful
            if u > seconds:
                u = seconds
            r = seconds - u
            steps += k
            useful += u
            redundant += r
            ck_steps += k
            ck_useful += u
            ck_redundant += r
            dt -= seconds
        self.steps, self.useful, self.redundant = steps, useful, redundant
        self.ck_steps, self.ck_useful, self.ck_redundant = ck_steps, ck_useful, ck_redundant
        if dt < 0.0:
            dt = 0.0
        self.frac = dt / tau
        self.ptime = dt

    def set_tau(self, tau: float, tau_useful: float | None = None) -> None:
        """Change the step time; the in-flight step keeps its progress fraction."""
        self.tau = tau
        if tau_useful is not None:
            self.tau_useful = tau_useful

    def start_running(self, tau: float, tau_useful: float) -> None:
        if self.first_run_t is None:
            self.first_run_t = self.t
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
