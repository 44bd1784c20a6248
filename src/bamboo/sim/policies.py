"""Policies: how a job runs on the trace's instances, each a class behind one interface.

``bamboo train``'s redundancy modes are policies of the same names: ``eager`` (the paper's
system, also ``bamboo``), ``lazy``, ``off``, ``reroute`` and ``auto`` (also ``adaptive``); the
peers ``torchrun`` and ``torchft`` are in :mod:`bamboo.sim.peers`.

* ``bamboo``: redundant computation as in the paper. A lost node's predecessor
  becomes its shadow (step slowed while it carries two stages); losing a shadow, or
  a node whose predecessor is already a shadow (two adjacent stages of one pipeline
  before a reconfiguration), is a fatal failure: global restart, restoring the
  stage from a peer pipeline when one holds it, else from the last durable
  checkpoint. Reconfiguration triggers are the authors': spares can replace the
  shadows, the chance of a fatal failure exceeds 5%, or a new pipeline fits.
* ``checkpoint``: no redundancy; checkpoint every N seconds; any loss of a node in
  the layout restarts every worker from the last checkpoint on the nodes
  available (torchrun-style restart, Varuna-like morphing: checkpoint then restart
  when a new pipeline fits).
* ``on-demand``: a fixed on-demand cluster, closed form.
* ``reroute``: no replicas (ReCycle, SOSP'24): a lost node's micro-batches go to the
  holders of the same stage in the other pipelines until a reconfiguration gives the
  slot a node again; only a stage lost in every pipeline is fatal. At one stage (P == 1:
  no replica to shadow from) every mode but ``off`` re-routes so, keeping the peers'
  finished micro-batches, and ends the generation at that step's boundary.
* ``adaptive``: Bamboo's mechanism, but at each (re)configuration it picks (with
  :mod:`bamboo.plan.redundancy_choice`, the decision ``--redundancy auto`` training uses) the
  redundancy mode (eager, lazy, off) and the number of pipelines that maximise
  expected samples per dollar under the preemption rate observed so far, and only
  pays for the instances that layout needs (plus one spare per pipeline).
"""

from __future__ import annotations

from bamboo.plan import redundancy_choice as auto
from bamboo.sim.checkpoint_policy import CheckpointPolicy
from bamboo.sim.core import CKPT, IDLE, REBALANCE, RESTART, RUN, Policy, RunResult, SimConfig
from bamboo.sim.cost_presets import SimModel
from bamboo.sim.on_demand import OnDemandPolicy, on_demand_layout
from bamboo.sim.peers import TorchftPolicy, TorchrunPolicy
from bamboo.sim.restarting import (
    RDV,
    RUNNING,
    STOPPED,
    T_DECIDE,
    T_FALLBACK,
    T_RDV_DONE,
    T_RESUME,
    RestartingPolicy,
)

__all__ = [
    "BambooPolicy",
    "EagerPolicy",
    "LazyPolicy",
    "OffPolicy",
    "AutoPolicy",
    "TorchrunPolicy",
    "TorchftPolicy",
    "CheckpointPolicy",
    "OnDemandPolicy",
    "AdaptivePolicy",
    "ReroutePolicy",
    "POLICIES",
    "make_policy",
    "on_demand_layout",
]

class BambooPolicy(RestartingPolicy):
    """Redundant computation with failover, fatal fallback and reconfiguration (the paper's system)."""

    name = "bamboo"

    def _reset(self) -> None:
        super()._reset()
        # Layout: position d * P + s is stage s of pipeline d.
        self.holder: list[int | None] = []
        """Position -> the node computing it (None: lost, only transiently)."""
        self.slot: dict[int, int] = {}
        """Working node -> its own position."""
        self.extra: dict[int, int] = {}
        """Shadow node -> the position it took over (a shadow holds two stages)."""
        self.overloaded = 0
        self.decision_pending = False
        self.base_tau = 1.0
        self.rc_mode = "eager"
        self.last_durable = 0.0

    # -- the redundancy mode's costs (adaptive overrides the mode)
    def mode_overhead(self, mode: str) -> float:
        p = self.preset
        if p.stages == 1:
            return 0.0  # one stage: no replica, no FRC in any mode
        if mode == "eager":
            return p.rc_overhead
        return p.lazy_overhead if mode == "lazy" else 0.0

    def choose_layout(self, n_ready: int) -> int:
        return min(n_ready // self.P, self.max_d)

    # -- membership
    def on_ready(self, t: float, node: int) -> None:
        st = self.status
        if st == STOPPED:
            self.start_rdv(t, RESTART)
        elif st == RDV:
            self.members.add(node)
        else:
            self.standby[node] = None
            self.want_decision(t)

    def on_lost(self, t: float, node: int) -> None:
        if not self._loss_absorbed(node) and self.status == RUNNING and node in self.slot:
            self.node_failed(t, node)

    def node_failed(self, t: float, node: int) -> None:
        holder, extra = self.holder, self.extra
        pos = self.slot.pop(node)
        holder[pos] = None
        took = extra.pop(node, None)
        if took is not None:  # a shadow is lost: both its stages are gone
            holder[took] = None
            self.fatal(t, (pos, took))
            return
        P = self.P
        if P == 1:  # no replica: re-routed in flight to the peers, where any is left
            if self.rc_mode == "off" or not self.reroute(t, pos):
                self.fatal(t, (pos,))
            return
        pred = holder[pos - 1 if pos % P else pos + P - 1]  # the previous stage, cyclically
        if pred is None or pred in extra or self.rc_mode == "off":
            self.fatal(t, (pos,))
            return
        extra[pred] = pos
        holder[pos] = pred
        self.overloaded += 1
        self.bump("failovers")
        if self.overloaded == 1:
            self.set_tau(self.base_tau * self.preset.shadow_slowdown)
        pause = self.preset.failover_pause_s
        if self.rc_mode == "lazy":
            pause += self.frac * self.base_tau  # forwards of this step recomputed before BRC
        if pause > 0:
            self.stall(pause)
        self.want_decision(t)

    def reroute(self, t: float, pos: int) -> bool:
        """Give the lost position's micro-batches to the live holders of its stage in the other
        pipelines: with k of a stage's D holders lost, each live one does D / (D - k) of its
        usual work, and the step runs at the pace of the most loaded stage. False (nothing
        changed) when no holder of that stage is left.

        The lost node's finished share of the step under way is done again; so is the whole
        step's progress at P > 1, and at P == 1 from a generation's second re-route on (the
        peers' finished micro-batches are kept only by a generation's first re-route at one
        stage)."""
        P, D, holder = self.P, self.D, self.holder
        stage = pos % P
        lost = [sum(holder[d * P + s] is None for d in range(D)) for s in range(P)]
        if lost[stage] >= D:
            return False
        keeps_peers_work = P == 1 and self.overloaded == 0
        self.overloaded += 1
        self.bump("reroutes")
        self.set_tau(self.base_tau * max(D / (D - k) for k in lost))
        redo = self.frac * self.base_tau / ((D - lost[stage]) if keeps_peers_work else 1)
        pause = self.preset.failover_pause_s + redo
        if pause > 0:
            self.stall(pause)
        self.want_decision(t)
        return True

    def fatal(self, t: float, lost: tuple[int, ...]) -> None:
        """Every copy of some stage in one pipeline is gone (``lost``: their positions)."""
        if self.rc_mode != "off":
            self.fatal_failures += 1
        D, P, holder = self.D, self.P, self.holder
        peer = all(
            any(holder[d2 * P + pos % P] is not None for d2 in range(D) if d2 != pos // P) for pos in lost
        )
        self.drop_partial()
        if peer:
            self.bump("peer_restores")
        else:
            self.bump("checkpoint_restores")
            if self.cfg.fatal_rollback:
                self.rollback()
        self.start_rdv(t, RESTART)

    # -- reconfiguration
    def want_decision(self, t: float) -> None:
        if not self.decision_pending and self.status == RUNNING:
            self.decision_pending = True
            self.push(self.next_boundary(t), T_DECIDE)

    def should_reconfigure(self) -> bool:
        ov = self.overloaded
        w = len(self.standby)
        D, P = self.D, self.P
        if ov and w >= ov:
            return True
        if ov and self.P == 1 and self.rc_mode != "reroute":
            return True  # a re-route at one stage ends its generation at the boundary
        active = D * P - ov
        if ov and 2 * ov / active > 0.05:
            return True
        return D < self.max_d and (active + w) // P > D

    def start_rdv(self, t: float, mode: int) -> None:
        self.drop_partial()
        self.epoch += 1
        self.status = RDV
        self.mode = mode
        self.rdv_mode = mode
        self.members = set(self.ready)
        self.broken = False
        self.holder = []
        self.slot = {}
        self.extra = {}
        self.standby = {}
        self.overloaded = 0
        self.decision_pending = False
        self.push(t + self.rdv_seconds(mode), T_RDV_DONE)

    def rdv_seconds(self, mode: int) -> float:
        return self.preset.rebalance_s if mode == REBALANCE else self.preset.restart_s

    def on_timer(self, t: float, kind: int, payload: object) -> None:
        if kind == T_RDV_DONE:
            if self.broken:  # a member vanished: the rendezvous starts over
                self.members = set(self.ready)
                self.broken = False
                self.push(t + self.rdv_seconds(self.rdv_mode), T_RDV_DONE)
                self.bump("rendezvous_retries")
            else:
                self.form_layout(t)
        elif kind == T_DECIDE:
            if self.status != RUNNING:
                self.decision_pending = False
            elif self.mode == CKPT:
                pass  # decided when the checkpoint is written (T_RESUME)
            elif 1e-6 < self.frac < 1.0 - 1e-6:
                self.push(self.next_boundary(t), T_DECIDE)  # boundary moved (checkpoint pause)
            else:
                self.decision_pending = False
                if self.should_reconfigure():
                    self.start_rdv(t, REBALANCE)
        elif kind == T_FALLBACK:
            if self.status == RUNNING and self.mode == RUN:
                self.durable()  # snapshot of the step state; training waits while it is written
                self.last_durable = t
                self.mode = CKPT
                self.push(t + self.ckpt_save_s(), T_RESUME)
        elif kind == T_RESUME:
            if self.status == RUNNING and self.mode == CKPT:
                self.mode = RUN
                if self.decision_pending:
                    self.push(self.next_boundary(t), T_DECIDE)
                self.push(t + self.cfg.fallback_every_s, T_FALLBACK)

    def placement_order(self) -> list[int]:
        nodes = list(self.ready)
        if self.cfg.placement == "random":
            self.rng.shuffle(nodes)
        return nodes

    def form_layout(self, t: float) -> None:
        nodes = self.placement_order()
        D = self.choose_layout(len(nodes))
        if D <= 0:
            self.status = STOPPED
            self.mode = IDLE
            return
        used = D * self.P
        holder = self.holder = nodes[:used]
        self.slot = dict(zip(holder, range(used)))
        self.extra = {}
        self.standby = dict.fromkeys(nodes[used:])
        if self.started:
            self.reconfigurations += 1
        self.started = True
        self.status = RUNNING
        self.D = D
        plain = self.plain_s[D]
        self.base_tau = plain * (1.0 + self.mode_overhead(self.rc_mode))
        self.start_running(self.base_tau, plain)
        if self.cfg.fallback_every_s > 0:  # the fallback schedule survives reconfigurations
            self.push(max(t, self.last_durable + self.cfg.fallback_every_s), T_FALLBACK)


class ReroutePolicy(BambooPolicy):
    """Re-routing to data-parallel peers instead of shadows (`--redundancy reroute`).

    No replica costs anything before a loss. When the holder of stage s of pipeline d is
    lost, the other pipelines' holders of stage s take its micro-batches
    (:meth:`BambooPolicy.reroute`, after the failover pause). A stage lost in every pipeline
    (or D == 1) is fatal: a restore point, as for bamboo. The reconfiguration triggers are
    bamboo's: a standby for each re-routed slot, or a layout with more pipelines; at one
    stage the other modes re-route too, and end the generation at the loss step's boundary."""

    name = "reroute"

    def _reset(self) -> None:
        super()._reset()
        self.rc_mode = "reroute"

    def mode_overhead(self, mode: str) -> float:
        return 0.0  # no replica, no FRC

    def node_failed(self, t: float, node: int) -> None:
        pos = self.slot.pop(node)
        self.holder[pos] = None
        if not self.reroute(t, pos):  # no live holder of this stage anywhere
            self.fatal(t, (pos,))


class AdaptivePolicy(BambooPolicy):
    """Picks the redundancy mode and pipelines from the observed preemption rate, maximising samples per dollar.

    The decision is :mod:`bamboo.plan.redundancy_choice`'s, the one ``--redundancy auto`` training
    runs use: the same rate estimate (:func:`~bamboo.plan.redundancy_choice.posterior_rate`) and the
    same expected throughput (:func:`~bamboo.plan.redundancy_choice.mode_terms` and
    :func:`~bamboo.plan.redundancy_choice.value`), evaluated for every (D, mode) of the layout.
    """

    name = "adaptive"
    PRIOR_RATE = auto.PRIOR_RATE
    """Prior preemption rate per node-second (10% per hour: pessimistic, so it starts protected)."""
    PRIOR_WEIGHT = auto.PRIOR_WEIGHT
    """Node-seconds of observation the prior counts for."""

    def _reset(self) -> None:
        super()._reset()
        self.exposure = 0.0
        self.removals = 0
        self.mode_seconds = {"eager": 0.0, "lazy": 0.0, "off": 0.0}
        self.terms = self._terms()
        self.observe = True  # ClusterPolicy.advance accrues exposure and mode_seconds

    def on_lost(self, t: float, node: int) -> None:
        self.removals += 1
        super().on_lost(t, node)

    def rate(self) -> float:
        """Posterior mean preemption rate per node-second."""
        return auto.posterior_rate(self.removals, self.exposure, self.PRIOR_RATE, self.PRIOR_WEIGHT)

    def mode_costs(self, D: int) -> auto.ModeCosts:
        """The costs of a layout of D pipelines, as :mod:`bamboo.plan.redundancy_choice` takes them."""
        p = self.preset
        every = self.cfg.fallback_every_s
        plain = p.plain_step_time(D)
        return auto.ModeCosts(
            samples_per_step=p.samples_per_step,
            stages=p.stages,
            pipelines=D,
            step_s={mode: plain * (1.0 + self.mode_overhead(mode)) for mode in auto.MODES},
            failover_pause_s=p.failover_pause_s,
            reconfiguration_s=p.rebalance_s,
            restart_s=p.restart_s,
            shadow_slowdown=p.shadow_slowdown,
            # a fatal loss with no peer pipeline rolls back to the last fallback checkpoint
            rollback_s=every / 2 if (self.cfg.fatal_rollback and every > 0 and D == 1) else 0.0,
        )

    def _terms(self) -> list[auto.ModeTerms]:
        """Per (D, mode), D ascending then modes in :data:`~bamboo.plan.redundancy_choice.MODES` order,
        the constants of :meth:`expected_throughput` (only the rate varies)."""
        out = []
        for D in range(1, self.preset.max_pipelines + 1):
            costs = self.mode_costs(D)
            out.extend(auto.mode_terms(mode, costs) for mode in auto.MODES)
        return out

    def expected_throughput(self, mode: str, D: int, lam: float) -> float:
        """Expected samples per second of layout D in ``mode`` at preemption rate ``lam`` per node."""
        for row in self._terms():
            if row.pipelines == D and row.mode == mode:
                return auto.value(row, lam)
        raise ValueError(f"no layout D={D} mode={mode!r}")

    def choose_layout(self, n_ready: int) -> int:
        d_max = min(n_ready // self.P, self.max_d)
        # same instances paid for whatever the layout: value ~ throughput; ties go to fewer pipelines
        best, _ = auto.best_terms(self.terms[: d_max * len(auto.MODES)], self.rate())
        if best is None:
            self.rc_mode = "eager"
            return 0
        self.rc_mode = best.mode
        return best.pipelines

    def _result(self, horizon: float, timeline: list | None) -> RunResult:
        res = super()._result(horizon, timeline)
        for mode, sec in self.mode_seconds.items():
            res.extra[f"seconds_{mode}"] = sec
        return res


class LazyPolicy(BambooPolicy):
    """`--redundancy lazy`: the replica kept in sync (lazy_overhead); a failover recomputes the
    step's forwards before the backward (the failover pause plus the step's progress)."""

    name = "lazy"

    def _reset(self) -> None:
        super()._reset()
        self.rc_mode = "lazy"


class OffPolicy(BambooPolicy):
    """`--redundancy off`: no replica; a loss restores the stage from a peer pipeline (a
    global restart), or from the last durable checkpoint where no peer holds it."""

    name = "off"

    def _reset(self) -> None:
        super()._reset()
        self.rc_mode = "off"


class EagerPolicy(BambooPolicy):
    """`--redundancy eager`: the paper's system (also named `bamboo`)."""

    name = "eager"


class AutoPolicy(AdaptivePolicy):
    """`--redundancy auto` (also named `adaptive`)."""

    name = "auto"


POLICIES: dict[str, type[Policy]] = {
    # bamboo train's --redundancy modes
    "eager": EagerPolicy,
    "lazy": LazyPolicy,
    "off": OffPolicy,
    "reroute": ReroutePolicy,
    "auto": AutoPolicy,
    # the peers
    "checkpoint": CheckpointPolicy,
    "torchrun": TorchrunPolicy,
    "torchft": TorchftPolicy,
    "on-demand": OnDemandPolicy,
    # earlier names
    "bamboo": BambooPolicy,
    "adaptive": AdaptivePolicy,
}


def make_policy(name: str, preset: SimModel, config: SimConfig, seed: int = 0) -> Policy:
    """Build a policy by name."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    return cls(preset, config, seed)
