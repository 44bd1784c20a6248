"""`--redundancy auto` in a run: the costs and the preemption rate this run has seen, fed to
the decision function the simulator's `adaptive` policy uses (`bamboo.plan.redundancy_choice`).

Measured here, per run:

- the step time of each mode run so far (median `wall_s` of steps without a loss, or of
  all its steps when it had fewer than two clean ones; the first step of each generation
  left out); lazy's is also derived from an eager
  step by taking out its FRC time (every node reports `frc_s`), and an unmeasured mode is
  estimated from a measured one by `DEFAULT_OVERHEAD`; reroute's and off's are one
  measurement (a re-routing run without a loss runs off's instructions);
- the least eager and lazy would add to a step (`redundant_work_floor` of the steps run
  without replicas: the replica's optimizer step, and eager's forwards, beyond what the
  node's waits can hide when it has a processor of its own): an unmeasured mode's
  estimate is never below it, nor is the optimistic end of its band;
- the failover pause (median `pause_s` of in-flight losses, else one step), the
  reconfiguration time (median of the run's reconfigurations, else 1 s), and the restart
  cost of a loss nothing covers in flight (median `pause_s` of such losses, else a
  reconfiguration and two steps), plus, with one pipeline, the steps a restore redoes:
  half the checkpoint interval, or every step since the run's start when there is no
  checkpoint (a run without checkpoints risks all of its progress with `off`);
- the rate: losses (any kind) over the node-seconds the run held nodes, with the prior
  rate of `bamboo.plan.redundancy_choice` weighted as `PRIOR_WEIGHT_S` node-seconds.

A mode switch needs a new generation, whose cost is charged to every mode but the current
one (spread over the steps left).

Measuring before choosing: the choice is the best expectation, measured or estimated (a
mode chosen on an estimate is then run, so measured). A mode not run yet has an
estimated step time, known only to lie in a band (its overhead over off between 0 and
twice its default: `fastest_possible_step`). When that mode, at the optimistic end of its band,
would beat the chosen one at the current rate by more than a trial costs, the run tries
it: a generation in that mode until two of its steps are timed (its first is not; at most
`TRIAL_MAX_STEPS`), then the choice again, on what was measured. A trial is made only when its two mode switches and its slower steps cost
at most `TRIAL_BUDGET` of the run's remaining time, and each mode is tried once; since the
test runs at every step boundary with the rate observed so far, a rate that grows (or
falls) makes a mode worth trying as soon as its advantage passes its uncertainty. The
failover pause is also taken per mode (a lazy failover recomputes forwards an eager one
reuses), from the losses of the steps run in that mode.
"""
from __future__ import annotations

import dataclasses
import statistics

from bamboo.config.modes import RedundancyMode
from bamboo.control.failures import FailureHandler
from bamboo.control.generations import Generations
from bamboo.control.nodes import Supervisor
from bamboo.control.results import Results
from bamboo.control.state import RunContext
from bamboo.plan.redundancy_choice import (
    ALL_MODES,
    DEFAULT_OVERHEAD,
    MODES,
    ModeCosts,
    RateEstimator,
    choose_mode,
    expected_samples_per_s,
)

__all__ = ["AutoRedundancy"]

PRIOR_WEIGHT_S = 600.0
"""The prior rate counts for ten node-minutes here (the simulator's twelve node-hours would
outweigh everything a run of minutes observes)."""
_NOMINAL_STEP_S = 1.0
"""Only before any step ran: the absolute scale of step times matters only against the rate."""
TRIAL_EXPECTED_STEPS = 4
"""Steps a trial is expected to take (its first, two timed, the one its end is decided in)."""
TRIAL_MAX_STEPS = 6
"""A trial ends once two of its steps are timed, after at most this many steps."""
TRIAL_BUDGET = 0.05
"""A trial may cost at most this share of the remaining run's time."""


class AutoRedundancy:
    def __init__(self, ctx: RunContext, nodes: Supervisor, results: Results,
                 failures: FailureHandler, generations: Generations) -> None:
        self.ctx = ctx
        self.nodes, self.results, self.failures, self.gens = nodes, results, failures, generations
        self.rate = RateEstimator(prior_weight=PRIOR_WEIGHT_S)
        self.last_t: float | None = None
        self.counted_losses = 0
        self.mode_of_step: dict[int, str] = {}
        self.current: str | None = None
        self.gen_starts: set[int] = set()
        """First steps of generations (their wall time includes the setup)."""
        self.tried: set[str] = set()
        """Modes a trial was started for (each is tried once)."""
        self.trial: str | None = None
        self.trial_until = 0
        """The step the running trial ends before."""
        self.nothing_measured = True
        """No step time measured yet (`costs` then gives a nominal one)."""
        self.floors: dict[str, float] = {}
        """Mode -> the least seconds it would add to a step, from measured work (`_floors`)."""
        self.proposed: str | None = None
        """A trial a step boundary ended the generation for: the next plan runs it (its
        expectations are recomputed then, at a rate that may have moved a little)."""

    def observe(self) -> None:
        """Accrue the node-seconds held since the last call and the losses seen since."""
        now = self.ctx.clock()
        if self.last_t is not None:
            alive = self.nodes.alive_count()
            self.rate.observe(node_seconds=alive * (now - self.last_t))
        self.last_t = now
        failures = self.failures
        seen = len(failures.losses) + failures.standby_losses
        if seen > self.counted_losses:
            self.rate.observe(removals=seen - self.counted_losses)
            self.counted_losses = seen

    def step_ran(self, step: int) -> None:
        if self.current is not None:
            self.mode_of_step[step] = self.current

    # -- costs ------------------------------------------------------------------------------

    def _timed_steps(self, mode: str) -> list[dict]:
        """Steps run in `mode`, without a generation's first step; without the steps that
        lost a node too, unless fewer than two are left (a run that loses a node every
        step has no clean step: its typical step is what it pays)."""
        failed = {x.step for x in self.failures.losses}
        steps = [r for r in self.results.records if r["wall_s"] > 0 and r["step"] not in
                 self.gen_starts and self.mode_of_step.get(r["step"]) == mode]
        clean = [r for r in steps if r["step"] not in failed]
        return clean if len(clean) >= 2 else steps

    def costs(self) -> ModeCosts:
        ctx, cfg = self.ctx, self.ctx.cfg
        step_s: dict[str, float] = {}
        for mode in ALL_MODES:
            walls = [r["wall_s"] for r in self._timed_steps(mode)]
            if len(walls) >= 2:
                step_s[mode] = statistics.median(walls)
        eager = self._timed_steps("eager")
        if "lazy" not in step_s and len(eager) >= 2:
            lazy = statistics.median(
                r["wall_s"] - r["frc_s"] for r in eager)
            if lazy > 0:
                step_s["lazy"] = lazy
        # reroute's failure-free step runs exactly off's instructions (no replica, no FRC):
        # one measures the other
        for mode, same in (("reroute", "off"), ("off", "reroute")):
            if mode not in step_s and same in step_s:
                step_s[mode] = step_s[same]
        self.floors = self._floors()
        overhead = dict(DEFAULT_OVERHEAD)
        bare = step_s.get("off")
        for mode, floor in self.floors.items():
            if bare and mode not in step_s:
                overhead[mode] = max(overhead[mode], floor / bare)
        self.nothing_measured = not step_s
        if not step_s:
            step_s["off"] = _NOMINAL_STEP_S
        tau = min(step_s.values())
        losses = [x for x in self.failures.losses if x.written]
        in_flight = [x.pause_s for x in losses if x.in_flight]
        by_mode: dict[str, float] = {}
        for mode in ALL_MODES:
            pauses = [x.pause_s for x in losses if x.in_flight and self.mode_of_step.get(x.step) == mode]
            if pauses:
                by_mode[mode] = statistics.median(pauses)
        restarted = [x.pause_s for x in losses if not x.in_flight and
                     str(x.handled_as) in ("peer_restore", "checkpoint_restore")]
        reconf = [t["total_s"] for t in self.gens.times if "total_s" in t]
        reconf_s = statistics.median(reconf) if reconf else 1.0
        # A loss nothing covers in flight costs what such losses cost this run (the step
        # thrown away, the new generation, the state moved); before one was seen: a
        # reconfiguration plus two steps (the one thrown away and the new generation's first).
        restart_s = statistics.median(restarted) if restarted else reconf_s + 2 * tau
        done = ctx.committed - (ctx.resume_step or 0)
        every = self.gens.interval.every
        rollback_steps = min(every / 2, max(done, 1)) if every else max(done, 1)
        plan = ctx.plan
        stages, pipelines = (plan.stages, plan.pipelines) if plan else (cfg.layout.stages,
                                                                         cfg.data_parallel)
        return ModeCosts(samples_per_step=cfg.global_micro_batches * cfg.layout.micro_batch_size,
                         stages=stages, pipelines=pipelines, step_s=step_s, overhead=overhead,
                         failover_pause_s=statistics.median(in_flight) if in_flight else tau,
                         failover_pause_by_mode=by_mode,
                         reconfiguration_s=reconf_s, restart_s=restart_s,
                         shadow_slowdown=2.0,
                         rollback_s=rollback_steps * tau if pipelines == 1 else 0.0)

    def _floors(self) -> dict[str, float]:
        """Mode -> the least seconds eager and lazy would add to a step: the median over
        the timed steps without replicas (off, reroute) of `redundant_work_floor`."""
        rows = [r["floor_s"] for m in ("off", "reroute") for r in self._timed_steps(m)
                if r.get("floor_s")]
        if not rows:
            return {}
        return {m: statistics.median(row[m] for row in rows) for m in ("eager", "lazy")}

    # -- the choice -------------------------------------------------------------------------

    def choose(self, gen: int) -> RedundancyMode:
        """The mode of generation `gen` (recorded as a `redundancy_mode` event), or with
        `gen` < 0, the mode a new generation would get now (no event).

        A switch costs a reconfiguration: the expectation of every mode but the current one
        is lowered by that time spread over the steps left, so the chosen mode is exactly
        the best of the expectations recorded, unless a mode not measured yet is worth a
        trial (`_trial_candidate`)."""
        self.observe()
        costs = self.costs()
        rate = self.rate.rate_per_node_s
        choice = choose_mode(costs, rate, self.modes(costs))
        left_steps = max(self.ctx.cfg.training.steps - self.ctx.committed, 1)
        left_s = left_steps * min(choice.step_s.values())
        keep = left_s / (left_s + costs.reconfiguration_s)
        expected = {m: v * (1.0 if m == self.current or self.current is None else keep)
                    for m, v in choice.expected.items()}
        trial = None
        running = self.trial is not None and not costs.measured(self.trial) \
            and self.ctx.committed < self.trial_until
        if running:
            mode = self.trial  # a trial runs until its mode is measured
        else:
            best = max(expected.values())
            # the current mode first on a tie, where it is still weighed (reroute is not at D=1)
            order = ([self.current] if self.current in expected else []) + list(expected)
            mode = next(m for m in order if expected[m] == best)
            if gen >= 0 and self.proposed is not None and not costs.measured(self.proposed):
                trial = self.proposed  # what the boundary ended the generation for
            elif not self.nothing_measured:  # the first mode is measured first
                trial = self._trial_candidate(costs, rate, mode, best, left_s, left_steps)
            if trial is not None:
                mode = trial
        if gen < 0:
            self.proposed = trial if trial is not None and not running else None
        else:
            self.proposed = None
            if not running:
                self.trial = None
            if trial is not None:
                self.trial, self.trial_until = trial, self.ctx.committed + TRIAL_MAX_STEPS
                self.tried.add(trial)
            self.current = mode
            self.gen_starts.add(self.ctx.committed)
            self.ctx.events.write("redundancy_mode", gen=gen, step=self.ctx.committed, mode=mode,
                                  rate_per_node_hour=choice.rate_per_node_hour,
                                  expected={m: round(v, 4) for m, v in expected.items()},
                                  step_s={m: round(v, 6) for m, v in choice.step_s.items()},
                                  estimated=sorted(choice.estimated),
                                  trial=self.trial == mode and self.trial is not None,
                                  measured_step_s={} if self.nothing_measured else
                                  {m: round(v, 6) for m, v in costs.step_s.items()},
                                  failover_pause_s={m: round(v, 4) for m, v in
                                                    costs.failover_pause_by_mode.items()},
                                  work_floor_s={m: round(v, 4) for m, v in self.floors.items()})
        return RedundancyMode(mode)  # the planner's words, decoded where the run takes them

    @staticmethod
    def modes(costs: ModeCosts) -> tuple[str, ...]:
        """The modes weighed: eager, lazy and off, and reroute where D >= 2."""
        return ALL_MODES if costs.pipelines >= 2 else MODES

    def _trial_candidate(self, costs: ModeCosts, rate: float, chosen: str, best: float,
                         left_s: float, left_steps: int) -> str | None:
        """An unmeasured mode other than `chosen`, not tried yet, that at the optimistic end
        of its step time's band would beat `best` (the chosen mode's expectation) by more
        than its trial costs: two mode switches and its trial steps' extra time, which must
        also stay within `TRIAL_BUDGET` of the time left."""
        if left_steps < 2 * TRIAL_MAX_STEPS:
            return None
        chosen_step = costs.step_time(chosen)
        candidates: dict[str, float] = {}
        for mode in self.modes(costs):
            if mode == chosen or costs.measured(mode) or mode in self.tried:
                continue
            fastest = fastest_possible_step(costs, self.floors.get(mode))
            optimistic = dataclasses.replace(
                costs, step_s={**costs.step_s, mode: fastest})
            value = expected_samples_per_s(mode, optimistic, rate)
            cost_s = 2 * costs.reconfiguration_s + \
                TRIAL_EXPECTED_STEPS * max(0.0, costs.step_time(mode) - chosen_step)
            gain_s = (value / best - 1.0) * max(left_s - cost_s, 0.0)
            if value > best and cost_s <= TRIAL_BUDGET * left_s and gain_s > cost_s:
                candidates[mode] = value
        return max(candidates, key=candidates.get) if candidates else None


def fastest_possible_step(costs: ModeCosts, floor_s: float | None = None) -> float:
    """The shortest step an unmeasured mode could have: each mode's overhead over off lies
    in [0, 2 x its default] (`DEFAULT_OVERHEAD`), so no mode is faster than off, and off is
    at least a measured mode's step over (1 + twice that mode's default overhead). With
    `floor_s`, the least the mode's redundant work adds (measured in steps of off), the
    step is at least off's plus that."""
    step = costs.step_s
    if "off" in step:
        return step["off"] + max(floor_s or 0.0, 0.0)
    return min(v / (1.0 + 2.0 * DEFAULT_OVERHEAD[m]) for m, v in step.items())
